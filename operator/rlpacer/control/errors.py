"""Errors raised by the control layer.

Every error names the offending field (or input) and how to fix it, so a user reading it in a
log, an Event or a 422 answer knows what to change.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration value. ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ObservationError(ValueError):
    """An impossible observation; the controller's state is left unchanged."""


class StateError(ValueError):
    """A state dict that cannot be restored (wrong kind, version or shape)."""
