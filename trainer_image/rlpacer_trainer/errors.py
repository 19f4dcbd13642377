"""Errors shared by light modules (the reward workers import no torch, so not ``config``)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A run config that cannot work; the message names the field."""


class LearnerDoesNotFit(RuntimeError):
    """The learner's estimated memory per rank exceeds what a rank has
    (:mod:`rlpacer_trainer.fit`); the message gives the numbers and the spec fields that fix
    it. Permanent: a pod exits with ``contract.EXIT_LEARNER_DOES_NOT_FIT`` on it and the
    operator fails the job (reason LearnerDoesNotFit) without a retry."""
