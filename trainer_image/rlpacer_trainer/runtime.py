"""Assembles a run: Ray, engines (Ray actors), learner, planner, controller, driver.

Locally Ray starts in-process with ``num_cpus=2`` (no dashboard); in a pod the driver attaches
to the job's Ray cluster (:mod:`rlpacer_trainer.topology`). Engines (one per rollout replica)
and learners (one per learner replica) are Ray actors with fractional CPUs, each placed on its
own pod when the cluster's nodes advertise them; the driver holds no model weights. Threads
are capped (see engine.py on why): ``OMP_NUM_THREADS=1`` for every actor, each engine its bound
cores, and a learner on this host torch threads for all of its cores (it trains while the
engines wait; :func:`rlpacer_trainer.learners.pick_threads`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, cast

from rlpacer.api import job as job_api
from rlpacer.control.tail_batching import TailBatchingPlanner
from rlpacer_trainer import models, topology
from rlpacer_trainer.config import RunConfig
from rlpacer_trainer.controller_client import InProcessController
from rlpacer_trainer.driver import Driver
from rlpacer_trainer.engine import (
    EngineConfig,
    EngineDtype,
    RayEngine,
    VLLMEngine,
    kv_cache_bytes_needed,
)
from rlpacer_trainer.learners import InProcessLearners, LearnerWorker, RayLearners

#: The job-level runtime env of every driver (actors inherit it). The driver's modules must be
#: importable by actors (editable install, or the source tree).
RUNTIME_ENV: dict[str, Any] = {
    "env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                 **models.OFFLINE_ENV}
}


def init_ray(address: str | None = None, num_cpus: int = 2, **ray_kwargs: Any) -> None:
    """Start Ray in-process (no address), or connect to a node on this host (``address``).

    A driver on a host of its own (a pod) must not call this with the cluster's address
    directly: :func:`rlpacer_trainer.topology.attached` starts the pod's Ray node first and
    passes the ``ray_kwargs`` (``_node_ip_address``, ``_temp_dir``) that pick it.
    """
    import ray

    if ray.is_initialized():
        return
    runtime_env = {**RUNTIME_ENV, "env_vars": dict(RUNTIME_ENV["env_vars"])}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=False, **ray_kwargs)
    else:
        # address="local": always a new in-process cluster, never one a `ray start` on this
        # machine left behind (Ray would join whatever /tmp/ray/ray_current_cluster names)
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 runtime_env=runtime_env, log_to_driver=False, **ray_kwargs)


#: vLLM's default token budget per engine step on a CPU (LLM class, one worker)
VLLM_DEFAULT_BATCHED_TOKENS = 4096
MAX_NUM_SEQS = 256


def engine_config(cfg: RunConfig, model_path: Path | None = None, *, replica: int = 0,
                  slot: int = 0) -> EngineConfig:
    batched = kv_bytes = None
    path = str(model_path or cfg.model_path)
    if int(cfg.spec.rollout.gpus_per_replica) == 0:  # no prompt split over steps on a CPU
        batched = max(VLLM_DEFAULT_BATCHED_TOKENS, cfg.max_model_len,
                      MAX_NUM_SEQS * cfg.max_prompt_tokens)
        # a CPU engine's KV cache: what it can hold at once, at most kv_cache_gib
        need = kv_cache_bytes_needed(path, MAX_NUM_SEQS, cfg.max_model_len, cfg.engine_dtype)
        if need is not None:
            kv_bytes = min(need, cfg.kv_cache_gib << 30)
    return EngineConfig(
        model_path=path,
        max_model_len=cfg.max_model_len,
        dtype=cast(EngineDtype, cfg.engine_dtype),
        max_num_batched_tokens=batched,
        max_num_seqs=MAX_NUM_SEQS,
        kv_cache_gib=cfg.kv_cache_gib,
        kv_cache_bytes=kv_bytes,
        threads_bind=cfg.threads_bind,
        seed=cfg.data_seed,
        replica=replica,
        slot=slot,
    )


def start_engines(cfg: RunConfig, count: int, use_ray: bool = True, *,
                  wait: bool = True) -> list[Any]:
    """One engine per rollout replica ``0..count-1``, all starting at once (each loads the
    model on its own pod: a job's start-up waits for the slowest, not for their sum).

    On a job's Ray cluster whose rollout pods advertise ``rlpacer.io/rollout-<i>``, engine i
    is placed on replica i's pod, alone there, with ``gpusPerReplica`` GPUs and
    ``tensorParallelSize``. Otherwise (``rlpacer run``) all run on this machine, each bound to
    its own core (round robin over the cores this process may use: ``slot:auto``).
    ``wait=False`` returns while they start (:func:`start_job` waits for them and the
    learners together)."""
    if not use_ray:
        return [VLLMEngine(engine_config(cfg, replica=i, slot=i)) for i in range(count)]
    import ray

    have = ray.cluster_resources()  # type: ignore[no-untyped-call]
    pinned = all(topology.pod_resource("rollout", i) in have for i in range(count))
    engines = [start_engine(cfg, i, pinned=pinned, wait=False) for i in range(count)]
    if wait:
        ray.get([e.ready_ref() for e in engines])
    return engines


def start_job(cfg: RunConfig) -> tuple[list[Any], RayLearners, dict[str, float]]:
    """The rollout engines and the learners, started together on the job's Ray cluster: the
    engines load the model while the learners do (on their own pods, or on this machine's
    cores), so an attempt's start-up costs the slowest of them rather than their sum. Returns
    them with the seconds until each kind was up (``engines``, ``learners``); raises what a
    failed engine or learner raised."""
    import time

    import ray

    t0 = time.perf_counter()
    engines = start_engines(cfg, count=int(cfg.spec.rollout.replicas), wait=False)
    learners = start_learners(cfg, wait=False)
    kinds = {"engines": [e.ready_ref() for e in engines], "learners": learners.ready_refs()}
    up: dict[str, float] = {}
    pending = [r for refs in kinds.values() for r in refs]
    while pending:
        _, pending = ray.wait(pending, num_returns=1)
        for kind, refs in kinds.items():
            if kind not in up and not set(refs) & set(pending):
                up[kind] = time.perf_counter() - t0
    ray.get([r for refs in kinds.values() for r in refs])  # a failed start raises here
    return engines, learners, up


def replica_tp_gpus(cfg: RunConfig, replica: int) -> tuple[int, int]:
    """Tensor-parallel size and GPUs of rollout replica ``replica``'s engine: a long round's
    extra replica (from ``rollout.replicas`` on) is a wide engine's with
    ``tailBatching.longRound.tensorParallelSize``, every other the rollout's."""
    spec = cfg.spec
    if replica >= int(spec.rollout.replicas):
        return job_api.extra_replica_tp(spec), job_api.extra_replica_gpus(spec)
    return int(spec.rollout.tensor_parallel_size), int(spec.rollout.gpus_per_replica)


def replica_engine_config(cfg: RunConfig, replica: int) -> EngineConfig:
    """The engine config of rollout replica ``replica`` on its own pod: on GPUs it spans
    its tensor-parallel size of them (:func:`replica_tp_gpus`), with vLLM's worker
    processes; on a CPU it is 1 (the config says so, for the engine to report)."""
    ecfg = engine_config(cfg, replica=replica, slot=replica)
    tp, gpus = replica_tp_gpus(cfg, replica)
    if gpus > 0:
        ecfg = dataclasses.replace(ecfg, tensor_parallel_size=tp, single_process=False)
    return ecfg


def start_engine(cfg: RunConfig, replica: int, *, pinned: bool = True,
                 wait: bool = True) -> Any:
    """The Ray engine of rollout replica ``replica``; ``pinned``: on that replica's pod (its
    ``rlpacer.io/rollout-<i>`` resource), the way a long round's added replica joins."""
    return RayEngine(
        replica_engine_config(cfg, replica), num_cpus=cfg.engine_cpus,
        num_gpus=replica_tp_gpus(cfg, replica)[1],
        resources={topology.pod_resource("rollout", replica): 0.01} if pinned else None,
        wait=wait)


def offered_rollout_replicas() -> set[int]:
    """The rollout replicas whose pods have joined the job's Ray cluster (each offers its
    ``rlpacer.io/rollout-<i>`` resource)."""
    import ray

    prefix = topology.pod_resource("rollout", 0)[:-1]
    out = set()
    for name in ray.cluster_resources():  # type: ignore[no-untyped-call]
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            out.add(int(name[len(prefix):]))
    return out


def build_driver(
    cfg: RunConfig,
    engines: list[Any],
    *,
    controller: Any | None = None,
    attempt: int = 0,
    checkpoint_dir: Path | None = None,
    on_step: Any = None,
    learners: Any | None = None,
    engine_factory: Any = None,
    offered_replicas: Any = None,
) -> Driver:
    """A fresh driver at the model source's weights (engines are reset to them too).
    ``learners``: from :func:`start_learners`; None: one learner in this process.
    ``engine_factory`` (replica -> engine) and ``offered_replicas`` (() -> the replicas whose
    pods have joined Ray): how the driver starts the engines of replicas that join later (a
    long round's, or one restarted after its engine died); None: the engine set is fixed."""
    learner = learners or InProcessLearners(LearnerWorker(
        str(cfg.model_path), cfg.learner_config(), threads=cfg.learner_threads or 1))
    planner = TailBatchingPlanner(cfg.planner_config(), cfg.num_prompts, seed=cfg.data_seed,
                                  epochs=cfg.planner_epochs())
    if controller is None:
        controller = InProcessController(cfg.controller_config(), cfg.total_steps,
                                         replicas=len(engines))
    drv = Driver(cfg=cfg, controller=controller, engines=engines, learner=learner,
                 planner=planner, attempt=attempt, checkpoint_dir=checkpoint_dir,
                 on_step=on_step, engine_factory=engine_factory,
                 offered_replicas=offered_replicas)
    drv.owns_learner = learners is None
    if os.environ.get("RLPACER_WEIGHT_TRANSPORT") == "nccl":
        if not isinstance(learner, RayLearners) or int(cfg.spec.rollout.gpus_per_replica) < 1:
            raise ValueError("RLPACER_WEIGHT_TRANSPORT=nccl needs GPU engines and learner actors")
        drv.weight_transport = "nccl"
    drv.sync_weights()  # engines may hold another run's weights (bench-train reuses them)
    return drv


def wait_for_pods(cfg: RunConfig, timeout_s: float = 600.0, poll_s: float = 1.0) -> None:
    """On a job's Ray cluster: wait until every learner and rollout pod the spec names has
    joined (its ``rlpacer.io/<role>-<i>`` resource is offered), so each engine and learner
    can be placed on its own pod; a pod that never joins fails the attempt, naming it."""
    import time

    import ray

    spec = cfg.spec
    need = ({topology.pod_resource("learner", i) for i in range(int(spec.trainer.replicas))}
            | {topology.pod_resource("rollout", i) for i in range(int(spec.rollout.replicas))})
    deadline = time.monotonic() + timeout_s
    last_log = 0.0
    while True:
        missing = need - set(ray.cluster_resources())  # type: ignore[no-untyped-call]
        if not missing:
            return
        now = time.monotonic()
        if now > deadline:
            raise topology.TopologyError(
                f"these pods never joined the job's Ray cluster in {timeout_s:.0f} s: "
                f"{sorted(missing)} (their resources are not offered)")
        if now - last_log > 15:
            print(f"waiting for pods to join Ray: {sorted(missing)}", flush=True)
            last_log = now
        time.sleep(poll_s)


def start_learners(cfg: RunConfig, *, wait: bool = True) -> RayLearners:
    """The learner's ranks: ``spec.trainer.replicas`` pods x (``gpusPerReplica``, or
    ``cpuRanksPerReplica`` without GPUs) Ray actors, each on its learner pod when the job's
    Ray cluster has them, else on this machine's Ray; from two ranks on they train together,
    FSDP-sharded or replicated (``spec.trainer.sharding``)."""
    spec = cfg.spec.trainer
    gpus = int(spec.gpus_per_replica)
    return RayLearners(str(cfg.model_path), cfg.learner_config(), int(spec.replicas),
                       ranks_per_pod=cfg.learner_ranks_per_pod,
                       num_cpus=cfg.learner_cpus, gpus=gpus, threads=cfg.learner_threads,
                       wait=wait)


def local_cpu_count() -> int:
    return os.cpu_count() or 1
