"""Fit before start: the learner's estimated memory per rank against what a rank has.

:func:`check_learner` reads the model's ``config.json``, estimates one learner rank's bytes at
the peak of a step (:mod:`rlpacer.control.memory`: weights, gradients, optimizer, activations
at the micro-batch token budget, overhead) and raises :class:`LearnerDoesNotFit` with the
numbers and the spec fields that fix it when the rank has less:

* CUDA: the current device's total memory (``torch.cuda.mem_get_info``);
* CPU: the cgroup's memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) if any,
  else ``MemTotal`` of ``/proc/meminfo``, shared by the ranks on this host;
* ``RLPACER_LEARNER_MEMORY_BYTES`` (a testing setting) overrides both: the bytes one rank has.

Each learner rank checks before it loads the model; the driver checks before any engine
starts (:func:`check_run`) where it can know a rank's memory: the learner runs on its host
(``rlpacer run``), or the testing setting is given. The pod entrypoint and ``rlpacer run`` turn
the error into ``contract.EXIT_LEARNER_DOES_NOT_FIT`` / a one-line error
(:func:`does_not_fit`), and the operator fails the job with reason ``LearnerDoesNotFit``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlpacer.control.errors import ConfigError as ShapeError
from rlpacer.control.memory import (
    LearnerLayout,
    MemoryEstimate,
    ModelShape,
    Precision,
    estimate,
    gib,
)
from rlpacer_trainer.errors import ConfigError, LearnerDoesNotFit

__all__ = ["ENV_LEARNER_MEMORY", "LearnerDoesNotFit", "check_learner", "check_run",
           "does_not_fit", "learner_layout", "rank_memory"]

#: Testing setting: the bytes one learner rank has (overrides the device's or host's memory).
ENV_LEARNER_MEMORY = "RLPACER_LEARNER_MEMORY_BYTES"

_CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
#: a cgroup v1 "no limit" is a huge page-rounded number; anything above this is no limit
_NO_LIMIT = 1 << 60


def read_shape(model_path: str | Path) -> ModelShape:
    """The decoder's shape from ``<model_path>/config.json``; a config the estimate cannot
    read raises :class:`ConfigError` naming spec.model.source and the key."""
    path = Path(model_path) / "config.json"
    conf = json.loads(path.read_text())
    try:
        return ModelShape.from_config(conf)
    except ShapeError as e:
        raise ConfigError(f"spec.model.source: {path}: {e}") from e


def _cgroup_limit(files: tuple[str, ...] = _CGROUP_FILES) -> int | None:
    for f in files:
        try:
            text = Path(f).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < _NO_LIMIT:
            return int(text)
    return None


def _mem_total(meminfo: str = "/proc/meminfo") -> int | None:
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def rank_memory(device: str, *, ranks_per_host: int = 1,
                env: Mapping[str, str] | None = None) -> tuple[int | None, str]:
    """The bytes one learner rank has, and where the figure comes from (None: unknown)."""
    env = os.environ if env is None else env
    override = env.get(ENV_LEARNER_MEMORY)
    if override:
        try:
            return int(override), ENV_LEARNER_MEMORY
        except ValueError:
            raise ConfigError(f"{ENV_LEARNER_MEMORY}={override!r}: give a number of bytes"
                              ) from None
    if device.startswith("cuda"):
        import torch

        _, total = torch.cuda.mem_get_info()
        return int(total), f"GPU {torch.cuda.get_device_name()}"
    limit = _cgroup_limit()
    where = "the pod's memory limit"
    if limit is None:
        limit, where = _mem_total(), "the host's memory"
    if limit is None:
        return None, "unknown"
    if ranks_per_host > 1:
        return limit // ranks_per_host, f"{where} over {ranks_per_host} ranks on this host"
    return limit, where


def check_learner(model_path: str | Path, *, world: int, sharded: bool,
                  micro_batch_tokens: int, activation_checkpointing: bool, kl: bool,
                  device: str, ranks_per_host: int = 1,
                  env: Mapping[str, str] | None = None) -> MemoryEstimate:
    """The estimate of one rank of this learner; raises :class:`LearnerDoesNotFit` when it
    exceeds the memory the rank has (module docstring). ``device``: ``cuda`` (bf16-mixed) or
    ``cpu`` (fp32); ``ranks_per_host``: CPU ranks sharing this host's memory."""
    gpu = device.startswith("cuda")
    layout = LearnerLayout(world=world, sharded=sharded,
                           precision=Precision.BF16_MIXED if gpu else Precision.FP32,
                           micro_batch_tokens=micro_batch_tokens,
                           activation_checkpointing=activation_checkpointing, kl=kl)
    est = estimate(read_shape(model_path), layout)
    have, where = rank_memory(device, ranks_per_host=ranks_per_host, env=env)
    if have is not None and est.total > have:
        raise LearnerDoesNotFit(message(est, have, where, gpu=gpu))
    return est


def message(est: MemoryEstimate, have: int, where: str, *, gpu: bool) -> str:
    """One line (the operator keeps the driver's last error line): the numbers and the fixes,
    naming the spec fields."""
    lay = est.layout
    per_pod = "gpusPerReplica" if gpu else "cpuRanksPerReplica"
    fixes = [f"more learner ranks (spec.trainer.replicas x {per_pod})"]
    if not lay.sharded:
        fixes.append("spec.trainer.sharding: FSDP")
    if not lay.activation_checkpointing:
        fixes.append("spec.trainer.activationCheckpointing: true")
    fixes.append(f"a smaller spec.trainer.microBatchTokens (now {lay.micro_batch_tokens})")
    if lay.kl:
        fixes.append("KL off (algorithm klCoef 0: no reference model)")
    fixes.append("a smaller model (spec.model.source)")
    return (f"learner does not fit: {est.describe()} exceeds {gib(have)} per rank ({where});"
            f" fixes: {'; '.join(fixes)}")


def learner_layout(cfg: Any) -> dict[str, Any]:
    """The learner's layout from a RunConfig's spec: ``world``, ``sharded``,
    ``micro_batch_tokens``, ``activation_checkpointing``, ``kl``, ``device`` and
    ``ranks_per_replica`` (the keyword arguments of :func:`check_learner`, less the last)."""
    trainer = cfg.spec.trainer
    gpus = int(trainer.gpus_per_replica)
    per_replica = gpus if gpus > 0 else int(trainer.cpu_ranks_per_replica)
    world = int(trainer.replicas) * per_replica
    from rlpacer.api._base import decimal

    return {
        "world": world,
        # as the learner decides (learners.is_sharded): FSDP with something to shard over
        "sharded": str(trainer.sharding.value) == "FSDP" and (world > 1 or gpus > 0),
        "micro_batch_tokens": int(trainer.micro_batch_tokens),
        "activation_checkpointing": bool(trainer.activation_checkpointing),
        "kl": decimal(cfg.algorithm.kl_coef) > 0,
        "device": "cuda" if gpus > 0 else "cpu",
        "ranks_per_replica": per_replica,
    }


def check_run(cfg: Any, *, local: bool, env: Mapping[str, str] | None = None
              ) -> MemoryEstimate | None:
    """The driver's check, before any engine starts: with the learner on this host
    (``local``: every rank here) or the testing setting given. Elsewhere (learner pods) each
    rank checks itself before it loads the model; None: not checked here."""
    env = os.environ if env is None else env
    kw = learner_layout(cfg)
    per_replica = kw.pop("ranks_per_replica")
    if not env.get(ENV_LEARNER_MEMORY):
        if not local:
            return None
        if kw["device"] == "cuda":
            import torch

            if not torch.cuda.is_available():
                return None
    # CPU ranks on this host share its memory: all of them locally, a replica's on a pod
    host_ranks = kw["world"] if local else per_replica
    return check_learner(cfg.model_path, **kw,
                         ranks_per_host=host_ranks if kw["device"] == "cpu" else 1, env=env)


def does_not_fit(err: BaseException) -> LearnerDoesNotFit | None:
    """``err`` as the :class:`LearnerDoesNotFit` it is or wraps (a learner rank's, raised in
    its Ray actor's ``__init__``: Ray hands the driver an error whose text carries it)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, LearnerDoesNotFit):
            return e
        cause = getattr(e, "cause", None)  # Ray's RayTaskError / ActorDiedError
        todo += [e.__cause__, e.__context__,
                 cause if isinstance(cause, BaseException) else None]
    marker = f"{LearnerDoesNotFit.__name__}: "
    text = str(err)
    if marker in text:
        line = text[text.rindex(marker) + len(marker):].strip().splitlines()
        return LearnerDoesNotFit(line[0] if line else text)
    return None
