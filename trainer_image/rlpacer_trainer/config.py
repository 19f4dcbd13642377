"""The trainer's one config: the RLTrainingJob spec plus local-only knobs.

The spec (``rlpacer.api.job``) is validated at load, so a bad manifest fails with the field
named. :class:`RunConfig` adds what only a local run or a pod decides (output folder, seed
overrides, engine sizing on this machine) and derives the per-component configs: learner,
tail-batching planner, controller.
"""

from __future__ import annotations

import dataclasses
import json
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
from rlpacer_trainer import algos, data, models, rewards, task
from rlpacer_trainer.errors import ConfigError
from rlpacer_trainer.learner import LearnerConfig

BUILTIN_TASKS = ("chain",)
#: The head sizes vLLM's CPU attention backend serves (vLLM 0.32:
#: ``vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend.get_supported_head_sizes``); any
#: other dies at the engine's first step with "Unsupported CPU attention configuration".
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

__all__ = ["ConfigError", "RunConfig"]


class DataInvalid(ConfigError):
    """The job's data is bad (a record, a field, a prompt over the cap): the message names
    the spec field, the file, the line and the record field. A pod exits with
    ``contract.EXIT_DATA_INVALID`` on it."""


def check_cpu_engine_model(source: str, path: Path) -> None:
    """Refuse, before any engine starts, a model vLLM's CPU engine cannot serve: its head_dim
    (``head_dim`` of config.json, else ``hidden_size / num_attention_heads``) must be one of
    :data:`CPU_ATTENTION_HEAD_SIZES`."""
    conf = json.loads((path / "config.json").read_text())
    conf = conf.get("text_config") or conf
    head_dim = conf.get("head_dim")
    if head_dim is None and conf.get("hidden_size") and conf.get("num_attention_heads"):
        head_dim = int(conf["hidden_size"]) // int(conf["num_attention_heads"])
    if head_dim is not None and int(head_dim) not in CPU_ATTENTION_HEAD_SIZES:
        raise ConfigError(
            f"spec.model.source: {source} has head_dim {head_dim} (config.json), which vLLM's"
            " CPU engine cannot serve (spec.rollout.gpusPerReplica is 0); supported head sizes"
            f" on CPU: {', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))}. Use a model with one"
            " of them, or GPU rollout engines (spec.rollout.gpusPerReplica >= 1)")


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
    long_round_fill: int | None = None  # override tailBatching.longRound.fillPrompts
    extra_responses: int | None = None  # override tailBatching.extraResponsesPerPrompt
    # override groupControl.objective: "step" or "second" (rlpacer.control.sagc.OBJECTIVES)
    sagc_objective: str | None = None
    warmup_updates: int = 8  # learner lr warm-up (optimizer steps; see LearnerConfig)
    lr_reference_samples: int = 256  # sqrt lr scaling below this many samples per update
    max_refill_rounds: int = 2  # dynamic sampling: extra short rounds per step at most
    kv_cache_gib: int = 1
    threads_bind: str = "slot:auto"  # one core per engine on a host (engine.resolve_threads_bind)
    engine_cpus: float = 0.5  # Ray actor CPUs per engine (fractional: engines and learner share)
    # torch threads per learner replica; 0: picked (learners.pick_threads): every core of this
    # host when it runs the whole job (rlpacer run: the learner trains while the engine
    # waits), 1 on a learner pod
    learner_threads: int = 0
    learner_cpus: float = 0.5  # Ray actor CPUs per learner replica (fractional, as engines)

    def __post_init__(self) -> None:
        spec = self.job.spec
        self._files: tuple[list[data.Example], list[data.Example]] | None = None
        if spec.data.source.startswith("builtin://"):
            if spec.data.source.removeprefix("builtin://") not in BUILTIN_TASKS:
                raise ConfigError(
                    f"spec.data.source: unknown builtin task {spec.data.source!r}; known:"
                    f" {', '.join('builtin://' + t for t in BUILTIN_TASKS)}")
        else:
            try:
                self._files = data.load(spec.data)  # every record read and checked now
            except data.DataError as e:
                raise DataInvalid(str(e)) from e
        rewards.check_spec(spec.reward)  # names spec.reward.<field>
        if self.fixed_group_size is not None and self.fixed_group_size < 1:
            raise ConfigError("--fixed-group-size must be >= 1")
        try:
            self._model_path = models.resolve(spec.model.source)  # fails early, naming it
        except models.ModelSourceError as e:
            raise ConfigError(str(e)) from e
        if int(spec.rollout.gpus_per_replica) == 0:
            check_cpu_engine_model(spec.model.source, self._model_path)
        if models.is_builtin(spec.model.source) and spec.data.system_prompt is not None:
            raise ConfigError(
                f"spec.data.systemPrompt: {spec.model.source} has the task's character"
                " vocabulary and no chat template; remove systemPrompt or name a Hugging"
                " Face-format model in spec.model.source")
        self._tokenizer: models.PromptTokenizer | None = None
        self._max_prompt_tokens: int | None = None
        _ = self.max_model_len  # every prompt encoded and measured against the caps now

    @classmethod
    def load(cls, path: str | Path, *, stored: bool = False, **kw: Any) -> RunConfig:
        """``stored``: the manifest of a job the API server holds (a pod's config): rules
        newer than the job may be are not enforced (``rlpacer.api.job.parse_job``)."""
        return cls(job=load_manifest(path, stored=stored), **kw)

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
        """Training prompts per epoch: a file's records (less a held-out split), or the
        builtin task's ``numPrompts`` (4096 unset)."""
        if self._files is not None:
            return len(self._files[0])
        n = self.spec.data.num_prompts
        return int(n) if n else 4096

    @property
    def max_tokens(self) -> int:
        return int(self.spec.rollout.max_response_tokens)

    @property
    def temperature(self) -> float:
        return decimal(self.spec.rollout.temperature)

    @property
    def top_p(self) -> float:
        return decimal(self.spec.rollout.top_p)

    @property
    def model_path(self) -> Path:
        return self._model_path

    def tokenizer(self) -> models.PromptTokenizer:
        """The model's: the builtin tiny one's characters, else the directory's tokenizer
        with its chat template and ``spec.data.systemPrompt``."""
        if self._tokenizer is None:
            self._tokenizer = models.tokenizer(self.spec.model.source, self.model_path,
                                               self.spec.data.system_prompt)
        return self._tokenizer

    @property
    def learner_ranks_per_pod(self) -> int:
        """Learner ranks on each learner pod: one per GPU, else ``cpuRanksPerReplica``."""
        t = self.spec.trainer
        return int(t.gpus_per_replica) or int(t.cpu_ranks_per_replica)

    @property
    def engine_dtype(self) -> str:
        """``spec.model.dtype``; unset: bfloat16 on GPU engines, float32 on CPU ones."""
        return models.resolve_dtype(self.spec.model.dtype,
                                    gpu=int(self.spec.rollout.gpus_per_replica) > 0)

    @property
    def max_prompt_tokens(self) -> int:
        """``spec.rollout.maxPromptTokens``; unset: the longest encoded prompt of the data.
        A longer prompt than the spec's cap is refused, naming it."""
        if self._max_prompt_tokens is None:
            tok = self.tokenizer()
            longest, which, where = 0, "", ""
            for p in [*self.problems(), *self.eval_problems()]:
                try:
                    n = len(tok.prompt_ids(p.prompt))
                except ValueError as e:
                    where = getattr(p, "where", "")
                    raise DataInvalid(f"spec.data.source: {where}: spec.data.promptField: {e}"
                                      ) from e
                if n > longest:
                    longest, which, where = n, p.prompt, getattr(p, "where", "")
            cap = self.spec.rollout.max_prompt_tokens
            if cap is not None and longest > int(cap):
                err = DataInvalid if where else ConfigError
                raise err(
                    f"spec.rollout.maxPromptTokens: {cap}, but a prompt of the data takes"
                    f" {longest} tokens ({where + ': ' if where else ''}{which[:60]!r}); raise"
                    " maxPromptTokens or shorten the prompt")
            self._max_prompt_tokens = int(cap) if cap is not None else longest
        return self._max_prompt_tokens

    @property
    def max_model_len(self) -> int:
        """The engines' max model length: maxPromptTokens + maxResponseTokens, within the
        model's context (``max_position_embeddings``)."""
        n = self.max_prompt_tokens + self.max_tokens
        ctx = models.max_positions(self.model_path)
        if ctx is not None and n > ctx:
            raise ConfigError(
                f"spec.rollout.maxPromptTokens + spec.rollout.maxResponseTokens ="
                f" {self.max_prompt_tokens} + {self.max_tokens} = {n} exceeds the model's"
                f" context of {ctx} tokens (max_position_embeddings of {self.model_path});"
                " lower maxResponseTokens or maxPromptTokens")
        return n

    @property
    def checkpoint_every(self) -> int:
        """``spec.checkpoint.everySteps``: the driver checkpoints after every this many steps."""
        return int(self.spec.checkpoint.every_steps)

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
            # unset: bfloat16 autocast on a GPU learner, float32 on a CPU (LearnerWorker)
            autocast=None if self.spec.model.dtype is None else str(self.spec.model.dtype),
            micro_batch_tokens=int(self.spec.trainer.micro_batch_tokens),
            sharding=str(self.spec.trainer.sharding.value),
            activation_checkpointing=bool(self.spec.trainer.activation_checkpointing),
            publish_dtype=self.engine_dtype,
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
            extra_responses=(int(self.extra_responses) if self.extra_responses is not None
                             else int(tb.extra_responses_per_prompt)),
            enabled=self.tail_batching_enabled,
            activation=str(tb.activation.value).lower(),  # Adaptive|Always -> the planner's
            straggler_ratio=decimal(self.spec.group_control.straggler_ratio),
            min_yield_ratio=decimal(tb.long_round.min_yield_ratio),
            long_round_prompts=(int(tb.long_round.prompts)
                                if tb.long_round.prompts is not None else None),
            long_round_fill=(int(self.long_round_fill) if self.long_round_fill is not None
                             else int(tb.long_round.fill_prompts or 0)),
            keep_near_cap=(decimal(tb.keep_near_cap) if tb.keep_near_cap is not None
                           else None),
            response_cap=(int(self.max_tokens) if tb.keep_near_cap is not None else None),
        )

    @property
    def scale_up_lead_s(self) -> float:
        """``tailBatching.longRound.scaleUpLeadSeconds``: how far ahead of a forecast long
        round the driver asks for its replicas until one is measured (0: no early scale-up;
        always 0 without tail batching)."""
        if not self.tail_batching_enabled:
            return 0.0
        return float(self.spec.tail_batching.long_round.scale_up_lead_seconds)

    @property
    def max_deferred_rounds(self) -> int:
        """``tailBatching.longRound.maxDeferredRounds``: short rounds the driver may run in a
        due long round's place while its extra replicas are not ready (0: it waits; always 0
        without tail batching)."""
        if not self.tail_batching_enabled:
            return 0
        return int(self.spec.tail_batching.long_round.max_deferred_rounds)

    @property
    def route_quantile(self) -> float | None:
        """``tailBatching.lengthPrior``: the rank from which prompts are routed to long
        rounds, or None (no routing; never without tail batching)."""
        lp = self.spec.tail_batching.length_prior
        if lp is None or not lp.route or not self.tail_batching_enabled:
            return None
        return decimal(lp.route_quantile)

    @property
    def stream_training(self) -> bool:
        """``trainer.streamTraining``: groups trained as they finish (the driver's StepStream)."""
        return bool(self.spec.trainer.stream_training)

    @property
    def join_mid_round(self) -> bool:
        """``tailBatching.longRound.joinMidRound``: a long round starts on what serves and
        the extras join during it (never without tail batching: no long rounds)."""
        return bool(self.spec.tail_batching.long_round.join_mid_round
                    and self.tail_batching_enabled)

    @property
    def release_when_fits(self) -> bool:
        """``tailBatching.longRound.releaseWhenFits``: a long round's added replicas go once
        its unfinished requests fit on the rollout's own (never without tail batching)."""
        return bool(self.spec.tail_batching.long_round.release_when_fits
                    and self.tail_batching_enabled)

    @property
    def length_half_life(self) -> float | None:
        """``tailBatching.lengthPrior.halfLifeGroups``: the prior's forgetting, or None."""
        lp = self.spec.tail_batching.length_prior
        return None if lp is None or lp.half_life_groups is None else float(lp.half_life_groups)

    @property
    def length_dispatch(self) -> bool:
        """``tailBatching.lengthPrior.dispatch``: requests go to engines by predicted length."""
        lp = self.spec.tail_batching.length_prior
        return lp is not None and bool(lp.dispatch)

    @property
    def length_context(self) -> bool:
        """``tailBatching.lengthPrior.context``: reports carry the next round's predicted
        straggler risk per candidate G (SAGC's context; nothing to choose in Fixed mode)."""
        lp = self.spec.tail_batching.length_prior
        return (lp is not None and bool(lp.context)
                and self.controller_config().mode is GroupControlMode.SAGC)

    def planner_epochs(self) -> int:
        """Enough epochs that the planner never runs dry before ``total_steps``."""
        # a step takes at most a full short round's fresh prompts per round (retired long
        # rounds take no step, but their prompts were launched by short rounds)
        per_round = self.planner_config().launched_prompts
        need = self.total_steps * per_round * (self.max_refill_rounds + 1)
        return max(1, math.ceil(need / self.num_prompts))

    def controller_config(self) -> JobControllerConfig:
        import dataclasses as dc

        from rlpacer.operator.hosting import controller_config

        cfg = controller_config(self.spec)
        if self.sagc_objective is not None:
            cfg = dc.replace(cfg, sagc=dc.replace(cfg.sagc, objective=self.sagc_objective))
        if self.fixed_group_size is not None:

            sagc = dc.replace(cfg.sagc, initial=self.fixed_group_size,
                              candidates=tuple(sorted({*cfg.sagc.candidates,
                                                       self.fixed_group_size})))
            cfg = dc.replace(cfg, mode=GroupControlMode.FIXED, sagc=sagc)
        return cfg

    def problems(self) -> list[Any]:
        """The training prompts: ``task.Problem`` (builtin) or ``data.Example`` (files),
        each with ``.pid`` (its index here), ``.prompt`` and ``.reference``."""
        if self._files is not None:
            return list(self._files[0])
        return task.make_problems(self.num_prompts, seed=task.TRAIN_SEED + self.data_seed)

    def eval_problems(self) -> list[Any]:
        """The held-out prompts (files: evalSource or the evalFraction split, maybe none)."""
        if self._files is not None:
            return list(self._files[1])
        return task.make_problems(self.eval_prompts, seed=task.EVAL_SEED)
