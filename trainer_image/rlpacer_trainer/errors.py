"""Errors shared by light modules (the reward workers import no torch, so not ``config``)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A run config that cannot work; the message names the field."""
