"""The trainer's one config: the RLTrainingJob spec plus local-only knobs.

The spec (``rlpacer.api.job``) is validated at load, so a bad manifest fails with the field
named. :class:`RunConfig` adds what only a local run or a pod decides (output folder, seed
overrides, engine sizing on this machine) and derives the per-component configs: learner,
tail-batching planner, controller.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from rlpacer.api._base import decimal
from rlpacer.api.job import (
    EffectiveAlgorithm,
    RLTrainingJob,
    effective_algorithm,
    load_manifest,
)
from rlpacer.control.plan import JobControllerConfig
from rlpacer.control.sagc import GroupControlMode
from rlpacer.control.tail_batching import TailBatchingConfig
from rlpacer_trainer import algos, rewards, task, tiny
from rlpacer_trainer.errors import ConfigError
from rlpacer_trainer.learner import LearnerConfig

BUILTIN_TASKS = ("chain",)

__all__ = ["ConfigError", "RunConfig"]


@dataclasses.dataclass
class RunConfig:
    """Everything one run needs. ``job`` is the validated manifest."""

    job: RLTrainingJob
    out_dir: Path = Path("runs/local")
    fixed_group_size: int | None = None  # --fixed-group-size: Fixed mode at this G
    tail_batching: bool | None = None  # --no-tail-batching sets False
    steps: int | None = None  # override spec.steps
    seed: int | None = None  # override spec.data.seed (data order) and sampling seeds
    eval_prompts: int = 256
    mini_batches: int = 2
    warmup_updates: int = 8  # learner lr warm-up (optimizer steps; see LearnerConfig)
    lr_reference_samples: int = 256  # sqrt lr scaling below this many samples per update
    max_refill_rounds: int = 2  # dynamic sampling: extra short rounds per step at most
    kv_cache_gib: int = 1
    threads_bind: str = "slot:auto"  # one core per engine on a host (engine.resolve_threads_bind)
    engine_cpus: float = 0.5  # Ray actor CPUs per engine (fractional: engines and learner share)
    learner_threads: int = 1
    learner_cpus: float = 0.5  # Ray actor CPUs per learner replica (fractional, as engines)

    def __post_init__(self) -> None:
        spec = self.job.spec
        if not spec.data.source.startswith("builtin://"):
            raise ConfigError(
                f"spec.data.source: {spec.data.source!r}: this trainer build runs builtin tasks"
                f" only ({', '.join('builtin://' + t for t in BUILTIN_TASKS)})"
            )
        if spec.data.source.removeprefix("builtin://") not in BUILTIN_TASKS:
            raise ConfigError(f"spec.data.source: unknown builtin task {spec.data.source!r}")
        rewards.check_spec(spec.reward)  # names spec.reward.<field>
        if self.fixed_group_size is not None and self.fixed_group_size < 1:
            raise ConfigError("--fixed-group-size must be >= 1")
        tiny.resolve_source(spec.model.source)  # fails early, naming model.source

    @classmethod
    def load(cls, path: str | Path, **kw: Any) -> RunConfig:
        return cls(job=load_manifest(path), **kw)

    # --- derived ---------------------------------------------------------------------------
    @property
    def spec(self) -> Any:
        return self.job.spec

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else int(self.spec.steps)

    @property
    def data_seed(self) -> int:
        return self.seed if self.seed is not None else int(self.spec.data.seed)

    @property
    def num_prompts(self) -> int:
        n = self.spec.data.num_prompts
        return int(n) if n else 4096

    @property
    def max_tokens(self) -> int:
        return int(self.spec.rollout.max_response_tokens)

    @property
    def temperature(self) -> float:
        return decimal(self.spec.rollout.temperature)

    @property
    def model_path(self) -> Path:
        return tiny.resolve_source(self.spec.model.source)

    @property
    def tail_batching_enabled(self) -> bool:
        if self.tail_batching is not None:
            return self.tail_batching
        return bool(self.spec.tail_batching.enabled)

    @property
    def algorithm(self) -> EffectiveAlgorithm:
        """The preset with the spec's overrides (what this run trains with)."""
        return effective_algorithm(self.spec)

    def learner_config(self) -> LearnerConfig:
        a = self.algorithm
        agg = (algos.LossAggregation.TOKEN_MEAN if a.loss_aggregation.value == "TokenMean"
               else algos.LossAggregation.SEQUENCE_MEAN_TOKEN_MEAN)
        return LearnerConfig(
            learning_rate=decimal(a.learning_rate),
            clip_low=decimal(a.clip_ratio_low),
            clip_high=decimal(a.clip_ratio_high),
            aggregation=agg.value,
            kl_coef=decimal(a.kl_coef),
            mini_batches=self.mini_batches,
            warmup_updates=self.warmup_updates,
            reference_samples=self.lr_reference_samples,
            temperature=max(self.temperature, 1e-3),
        )

    @property
    def dynamic_sampling(self) -> bool:
        return self.algorithm.dynamic_sampling

    @property
    def overlong_buffer(self) -> int:
        return self.algorithm.overlong_buffer_tokens

    @property
    def overlong_scale(self) -> float:
        a = self.algorithm
        return decimal(a.overlong_penalty) if a.overlong_buffer_tokens > 0 else 0.0

    def planner_config(self) -> TailBatchingConfig:
        tb = self.spec.tail_batching
        return TailBatchingConfig(
            prompts_per_step=int(self.spec.prompts_per_step),
            prompt_overprovision=decimal(tb.prompt_overprovision),
            extra_responses=int(tb.extra_responses_per_prompt),
            enabled=self.tail_batching_enabled,
        )

    def planner_epochs(self) -> int:
        """Enough epochs that the planner never runs dry before ``total_steps``."""
        need = self.total_steps * int(self.spec.prompts_per_step) * (self.max_refill_rounds + 1)
        return max(1, math.ceil(need / self.num_prompts))

    def controller_config(self) -> JobControllerConfig:
        from rlpacer.operator.hosting import controller_config

        cfg = controller_config(self.spec)
        if self.fixed_group_size is not None:
            import dataclasses as dc

            sagc = dc.replace(cfg.sagc, initial=self.fixed_group_size,
                              candidates=tuple(sorted({*cfg.sagc.candidates,
                                                       self.fixed_group_size})))
            cfg = dc.replace(cfg, mode=GroupControlMode.FIXED, sagc=sagc)
        return cfg

    def problems(self) -> list[task.Problem]:
        return task.make_problems(self.num_prompts, seed=task.TRAIN_SEED + self.data_seed)

    def eval_problems(self) -> list[task.Problem]:
        return task.make_problems(self.eval_prompts, seed=task.EVAL_SEED)
