"""Assembles a run: Ray, engines (Ray actors), learner, planner, controller, driver.

Locally Ray starts in-process with ``num_cpus=2`` (no dashboard); in a pod, ``RAY_ADDRESS``
joins the job's cluster. Engines are Ray actors with fractional CPUs; the learner lives in the
driver process with one intra-op thread (see engine.py on why threads are capped).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlpacer.control.tail_batching import TailBatchingPlanner
from rlpacer_trainer import tiny
from rlpacer_trainer.config import RunConfig
from rlpacer_trainer.controller_client import InProcessController
from rlpacer_trainer.driver import Driver
from rlpacer_trainer.engine import EngineConfig, RayEngine, VLLMEngine
from rlpacer_trainer.learner import Learner

#: The job-level runtime env of every driver (actors inherit it). The driver's modules must be
#: importable by actors (editable install, or the source tree).
RUNTIME_ENV: dict[str, Any] = {
    "env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
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
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env,
                 log_to_driver=False, **ray_kwargs)


def engine_config(cfg: RunConfig, model_path: Path | None = None) -> EngineConfig:
    return EngineConfig(
        model_path=str(model_path or cfg.model_path),
        max_model_len=256,
        max_num_seqs=256,
        kv_cache_gib=cfg.kv_cache_gib,
        threads_bind=cfg.threads_bind,
        seed=cfg.data_seed,
    )


def start_engines(cfg: RunConfig, count: int, use_ray: bool = True) -> list[Any]:
    ecfg = engine_config(cfg)
    if use_ray:
        return [RayEngine(ecfg, num_cpus=cfg.engine_cpus) for _ in range(count)]
    return [VLLMEngine(ecfg) for _ in range(count)]


def build_driver(
    cfg: RunConfig,
    engines: list[Any],
    *,
    controller: Any | None = None,
    attempt: int = 0,
    checkpoint_dir: Path | None = None,
    on_step: Any = None,
) -> Driver:
    """A fresh driver at the model source's weights (engines are reset to them too)."""
    tiny.set_threads(cfg.learner_threads)
    model = tiny.load_model(cfg.model_path)
    learner = Learner(model, cfg.learner_config())
    planner = TailBatchingPlanner(cfg.planner_config(), cfg.num_prompts, seed=cfg.data_seed,
                                  epochs=cfg.planner_epochs())
    if controller is None:
        controller = InProcessController(cfg.controller_config(), cfg.total_steps,
                                         replicas=len(engines))
    drv = Driver(cfg=cfg, controller=controller, engines=engines, learner=learner,
                 planner=planner, attempt=attempt, checkpoint_dir=checkpoint_dir,
                 on_step=on_step)
    drv.sync_weights()  # engines may hold another run's weights (bench-train reuses them)
    return drv


def local_cpu_count() -> int:
    return os.cpu_count() or 1
