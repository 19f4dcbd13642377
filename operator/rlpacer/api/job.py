"""The RLTrainingJob API (group ``rlpacer.io``, version ``v1alpha1``, short name ``rltj``).

These pydantic models are the source of truth: the CRD in ``crds/`` is generated from them
(``rlpacer crds``) and a test fails when it drifts. Every field has a description so that
``kubectl explain rltj.spec`` teaches the API. Decimals are strings (no floats in the CRD);
their ranges are checked here (config load, ``rlpacer run``) and by CEL rules in the CRD.

One manifest format everywhere: ``kubectl apply -f job.yaml`` on a cluster and
``rlpacer run job.yaml`` locally read the same spec.
"""

from __future__ import annotations

import enum
import itertools
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar

import yaml
from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rlpacer.api import sources
from rlpacer.api._base import (
    MAX_DURATION_SECONDS,
    MAX_SEED,
    STORED_CONTEXT,
    APIModel,
    Decimal,
    DecimalRange,
    TypedObject,
    decimal,
    read_stored,
    stored,
)

GROUP = "rlpacer.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLTrainingJob"
PLURAL = "rltrainingjobs"
SINGULAR = "rltrainingjob"
SHORT_NAMES = ["rltj"]

# Kubernetes limits object names used in DNS labels (Services) to 63 characters; children
# derive names from the job's, so the builders shorten with a hash where needed.
MAX_NAME_LENGTH = 63

#: Largest group size (responses per prompt).
MAX_GROUP_SIZE = 1024
GroupSize = Annotated[int, Field(ge=1, le=MAX_GROUP_SIZE)]
#: Most steps a job may run (``spec.steps``; also bounds ``status.step``).
MAX_STEPS = 10_000_000
#: Largest length cap of a response or a prompt, in tokens (2**20).
MAX_TOKENS = 1_048_576
#: Largest absolute reward-valued setting (a penalty, a failure score): rewards are float32 in
#: the learner; this leaves room for any reward scale while sums over a batch stay finite.
MAX_REWARD = 1e6


class AlgorithmName(enum.StrEnum):
    GRPO = "GRPO"
    DAPO = "DAPO"


class LossAggregation(enum.StrEnum):
    TOKEN_MEAN = "TokenMean"  # DAPO: every token weighs the same across the batch
    SEQUENCE_MEAN = "SequenceMean"  # GRPO: mean over tokens per response, then over responses


class GroupControlMode(enum.StrEnum):
    SAGC = "SAGC"
    FIXED = "Fixed"


class GroupControlObjective(enum.StrEnum):
    PER_STEP = "PerStep"  # log2(G) per step (the paper's)
    PER_SECOND = "PerSecond"  # log2(G) per second of a step's measured wall clock


class TailBatchingActivation(enum.StrEnum):
    ADAPTIVE = "Adaptive"  # over-provision short rounds only while their lengths straggle
    ALWAYS = "Always"  # over-provision every short round


class LearnerSharding(enum.StrEnum):
    FSDP = "FSDP"  # parameters, gradients and optimizer state sharded over the ranks
    REPLICATED = "Replicated"  # every rank a full copy; gradients all-reduced


class ModelDType(enum.StrEnum):
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class ModelSpec(APIModel):
    source: str = Field(
        min_length=1,
        max_length=512,
        description=(
            "Where the policy's initial weights come from: builtin://<name> for the project's"
            " tiny models (e.g. builtin://tiny-chain), pvc://<claim>/<path> for a Hugging"
            " Face-format directory (config.json, *.safetensors, tokenizer files, optional"
            " chat template) on a PersistentVolumeClaim, mounted read-only in the pods, or"
            " file:///<path> / a plain path (rlpacer run, or a path inside the image)."
            " Loaded with transformers' Auto classes and by vLLM; nothing is downloaded."
        ),
    )
    dtype: ModelDType | None = Field(
        default=None,
        description=(
            "Compute dtype: the rollout engines' weights and the learner's forward passes"
            " (autocast; the learner keeps float32 master weights). Unset: bfloat16 on GPUs,"
            " float32 on CPUs."
        ),
    )

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        sources.local_path(v, "spec.model.source", env={})  # raises on a malformed URI
        return v


class DataSpec(APIModel):
    source: str = Field(
        min_length=1,
        max_length=512,
        description=(
            "Prompt dataset: builtin://<task> for the project's synthetic tasks (e.g."
            " builtin://chain), or a JSON Lines file (one object per line) from"
            " pvc://<claim>/<path>.jsonl (mounted read-only in the driver pod) or"
            " file:///<path>.jsonl / a plain path. Checked when the trainer starts: bad data"
            " fails the job with reason DataInvalid, naming the file, line and field."
        ),
    )
    prompt_field: str = Field(
        default="prompt", min_length=1, max_length=256,
        description=(
            "Field of each record holding the prompt text (files only); dots reach into"
            " nested objects, e.g. meta.question."
        ),
    )
    answer_field: str = Field(
        default="answer", min_length=1, max_length=256,
        description=(
            "Field of each record holding the reference answer the reward compares with"
            " (files only); dots reach into nested objects. Numbers are read as their text."
        ),
    )
    system_prompt: str | None = Field(
        default=None, max_length=65536,
        description=(
            "A system message put before every prompt: through the model's chat template"
            " when it has one, else as text followed by a blank line. Not for builtin://"
            " models (their vocabulary is the task's characters)."
        ),
    )
    eval_source: str | None = Field(
        default=None, min_length=1, max_length=512,
        description=(
            "Held-out prompts from a second file (same schemes and fields as source); the"
            " run's evaluation uses them. Exclusive with evalFraction."
        ),
    )
    eval_fraction: Annotated[Decimal, DecimalRange(0, 0.5, low_open=True)] | None = Field(
        default=None,
        description=(
            "Held-out split of source: this fraction of its records (in (0, 0.5], drawn with"
            " seed) is kept out of training and used by the run's evaluation. Exclusive with"
            " evalSource. Unset with no evalSource: a file run has no held-out set."
        ),
    )
    num_prompts: int | None = Field(
        default=None, ge=1, le=10_000_000,
        description="Size of a builtin dataset (prompts per epoch). Ignored for files.",
    )
    seed: int = Field(
        default=0, ge=0, le=MAX_SEED,
        description="Seed of the data order, of a held-out split and of builtin data.",
    )

    @field_validator("source", "eval_source")
    @classmethod
    def _source(cls, v: str | None, info: Any) -> str | None:
        if v is not None:
            name = "evalSource" if info.field_name == "eval_source" else "source"
            sources.local_path(v, f"spec.data.{name}", env={})
        return v

    @model_validator(mode="after")
    def _split(self) -> DataSpec:
        if self.eval_fraction is not None and self.eval_source is not None:
            raise ValueError("give evalFraction or evalSource, not both")
        builtin = self.source.startswith("builtin://")
        if builtin and (self.eval_fraction is not None or self.eval_source is not None):
            raise ValueError("evalFraction and evalSource are for file data; a builtin task"
                             " has its own held-out set")
        return self


class OverlongPenalty(APIModel):
    enabled: bool = Field(
        default=True,
        description=(
            "Overlong reward shaping on (true) or off (false). Unset overlongPenalty: the"
            " preset's choice (DAPO on, GRPO off)."
        ),
    )
    buffer_tokens: int | None = Field(
        default=None, ge=0, le=1_000_000,
        description=(
            "Responses within this many tokens of rollout.maxResponseTokens get a linearly"
            " growing penalty (< maxResponseTokens). Unset: a fifth of maxResponseTokens"
            " (DAPO's 4096 of 20480)."
        ),
    )
    penalty: Annotated[Decimal, DecimalRange(0, MAX_REWARD)] = Field(
        default="1.0",
        description=("Penalty at the length cap, in [0, 1000000] (rewards are float32 in the"
                     " learner; larger would swamp any reward scale)."),
    )


#: Each preset's knobs (docs/job-spec.md, "Algorithm presets"). GRPO (arXiv 2402.03300) as the
#: RollPacker and DeepSeekMath set-ups run it; DAPO (arXiv 2503.14476): clip-higher,
#: token-level loss, dynamic sampling, overlong shaping, no KL term.
PRESETS: dict[AlgorithmName, dict[str, Any]] = {
    AlgorithmName.GRPO: {
        "clip_ratio_low": "0.2", "clip_ratio_high": "0.2",
        "loss_aggregation": LossAggregation.SEQUENCE_MEAN, "dynamic_sampling": False,
        "overlong_penalty": False, "kl_coef": "0",
    },
    AlgorithmName.DAPO: {
        "clip_ratio_low": "0.2", "clip_ratio_high": "0.28",
        "loss_aggregation": LossAggregation.TOKEN_MEAN, "dynamic_sampling": True,
        "overlong_penalty": True, "kl_coef": "0",
    },
}


def _preset_doc(knob: str) -> str:
    def show(v: Any) -> str:
        return ("on" if v else "off") if isinstance(v, bool) else str(v)

    grpo, dapo = (show(PRESETS[n][knob]) for n in (AlgorithmName.GRPO, AlgorithmName.DAPO))
    return f" Unset: the preset's value (GRPO {grpo}, DAPO {dapo})."


class AlgorithmSpec(APIModel):
    """``name`` picks a preset (:data:`PRESETS`); each knob set here overrides the preset's
    value. The knobs have no schema default on purpose: "unset" must stay distinguishable
    from "set to GRPO's value" (:func:`effective_algorithm` resolves them)."""

    name: AlgorithmName = Field(
        default=AlgorithmName.GRPO,
        description="GRPO or DAPO: the preset of every knob below that is not set.",
    )
    clip_ratio_low: Annotated[Decimal, DecimalRange(0, 1, low_open=True)] | None = Field(
        default=None,
        description=("PPO clip ratio below 1, in (0, 1] (the ratio is clipped at"
                     " 1 - clipRatioLow, which must not go negative)."
                     + _preset_doc("clip_ratio_low")),
    )
    clip_ratio_high: Annotated[Decimal, DecimalRange(0, 10, low_open=True)] | None = Field(
        default=None,
        description=("PPO clip ratio above 1, in (0, 10] (DAPO's clip-higher; a clip at"
                     " 1 + 10 never binds in practice)." + _preset_doc("clip_ratio_high")),
    )
    dynamic_sampling: bool | None = Field(
        default=None,
        description=("Dynamic sampling: drop groups whose rewards are all equal and refill."
                     + _preset_doc("dynamic_sampling")),
    )
    loss_aggregation: LossAggregation | None = Field(
        default=None,
        description=("TokenMean (every token weighs the same) or SequenceMean (mean per"
                     " response, then over responses)." + _preset_doc("loss_aggregation")),
    )
    overlong_penalty: OverlongPenalty | None = Field(
        default=None,
        description=("Overlong reward shaping; {enabled: false} turns it off."
                     + _preset_doc("overlong_penalty")),
    )
    learning_rate: Annotated[Decimal, DecimalRange(0, 1, low_open=True)] = Field(
        default="1e-6",
        description="Learner learning rate, in (0, 1] (a step of 1 already wrecks a model).",
    )
    kl_coef: Annotated[Decimal, DecimalRange(0, 100)] | None = Field(
        default=None,
        description=("KL penalty to the reference policy, in [0, 100] (beyond, the policy"
                     " cannot move)." + _preset_doc("kl_coef")),
    )


class EffectiveAlgorithm(APIModel):
    """The algorithm a job runs: its preset with the spec's overrides applied."""

    name: AlgorithmName = Field(description="The preset.")
    clip_ratio_low: Decimal = Field(description="PPO clip ratio below 1.")
    clip_ratio_high: Decimal = Field(description="PPO clip ratio above 1.")
    loss_aggregation: LossAggregation = Field(description="TokenMean or SequenceMean.")
    dynamic_sampling: bool = Field(description="Dynamic sampling on.")
    overlong_buffer_tokens: int = Field(
        ge=0, le=MAX_TOKENS, description="Overlong shaping's buffer in tokens; 0: shaping off.")
    overlong_penalty: Decimal = Field(description="Overlong penalty at the length cap.")
    kl_coef: Decimal = Field(description="KL penalty coefficient; 0: no reference policy.")
    learning_rate: Decimal = Field(description="Learner learning rate.")


#: The built-in rewards (``spec.reward.type``); the trainer's registry has exactly these.
BUILTIN_REWARDS = ("ExactMatch", "ChainPrefix", "MathAnswer", "Regex")
#: A user reward: ``package.module:function``, importable in the trainer image.
REWARD_ENTRY_POINT = r"^[A-Za-z_][A-Za-z0-9_]*([.][A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


class RewardSpec(APIModel):
    type: str = Field(
        default="ExactMatch",
        min_length=1,
        max_length=128,
        description=(
            "A built-in reward (ExactMatch, ChainPrefix, MathAnswer, Regex) or a user reward"
            " module:function importable in the trainer image, called as"
            " fn(response, answer, prompt, **meta) -> float (docs/rewards.md)."
        ),
    )
    timeout_seconds: int = Field(
        default=30, ge=1, le=3600,
        description=("Hard limit per reward call: an overrunning call's worker process is"
                     " killed and replaced, and the call scores failureScore."),
    )
    workers: int = Field(
        default=2, ge=1, le=64,
        description="Reward worker processes (started once, reused; a killed one is replaced).",
    )
    failure_score: Annotated[Decimal, DecimalRange(-MAX_REWARD, MAX_REWARD)] = Field(
        default="0",
        description=("The score of a call that times out, whose worker dies (crash, exit,"
                     " signal) or that raises or returns no finite number; each is counted"
                     " in the step's metrics. In [-1000000, 1000000] (rewards are float32 in the"
                     " learner)."),
    )
    pattern: str | None = Field(
        default=None, min_length=1, max_length=1024,
        description=("Regex only (required there): a Python regular expression searched for in"
                     " the response; 1.0 when it matches, else 0.0. With a named group"
                     " (?P<answer>...), 1.0 only when the group of the last match equals the"
                     " problem's answer (stripped). Anchor with \\A...\\Z for a full match."),
    )

    @field_validator("type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        if v in BUILTIN_REWARDS or re.fullmatch(REWARD_ENTRY_POINT, v):
            return v
        if ":" in v:
            raise ValueError(
                f"{v!r} is not an entry point: write module:function with Python identifiers,"
                " e.g. my_rewards.math:score")
        raise ValueError(
            f"{v!r} is not a built-in reward ({', '.join(BUILTIN_REWARDS)}); a user reward is"
            " written module:function, e.g. my_rewards:score")

    @model_validator(mode="after")
    def _pattern_and_score(self) -> RewardSpec:
        if self.type == "Regex":
            if self.pattern is None:
                raise ValueError("pattern is required when type is Regex, e.g. pattern: '\\d+'")
            try:
                re.compile(self.pattern)
            except re.error as err:
                raise ValueError(f"pattern {self.pattern!r} is not a valid regular expression:"
                                 f" {err}") from None
        elif self.pattern is not None:
            raise ValueError(f"pattern is read only when type is Regex (type is {self.type});"
                             " remove it or set type: Regex")
        return self


#: Kubernetes resource quantities ("500m", "2", "8Gi", "1.5G").
QUANTITY_PATTERN = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([numkMGTPE]|[KMGTPE]i|[eE][+-]?[0-9]+)?$"
Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=64)]
#: A Kueue LocalQueue's name: a DNS-1123 subdomain (Kueue's Workload.spec.queueName pattern).
QUEUE_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_RESOURCE_NAME = r"^(cpu|memory|ephemeral-storage|hugepages-[0-9A-Za-z]+)$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
#: env names the operator sets or the trainer relies on: not settable in a role's env
RESERVED_ENV_PREFIXES = ("RLPACER_", "RAY_")
RESERVED_ENV = frozenset({"HOME", "XDG_CACHE_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                          "CUDA_VISIBLE_DEVICES"})


class ContainerResources(APIModel):
    requests: dict[str, Quantity] | None = Field(
        default=None, max_length=8,
        description=(
            "The pods' container resource requests, by the Pod API's names: cpu, memory,"
            " ephemeral-storage, hugepages-<size>. GPUs: gpusPerReplica."
        ),
    )
    limits: dict[str, Quantity] | None = Field(
        default=None, max_length=8,
        description="The pods' container resource limits (names as for requests).",
    )

    @field_validator("requests", "limits")
    @classmethod
    def _names(cls, v: dict[str, str] | None, info: Any) -> dict[str, str] | None:
        import re

        for key in v or {}:
            low = key.lower()
            if "gpu" in low or low.startswith(("nvidia.com/", "amd.com/")):
                raise ValueError(
                    f"{info.field_name}: {key!r}: GPUs are not set here; use the role's"
                    " gpusPerReplica (rollout.gpusPerReplica, trainer.gpusPerReplica), which"
                    " the namespace policy's GPU caps read")
            if not re.match(_RESOURCE_NAME, key):
                raise ValueError(f"{info.field_name}: {key!r}: not a pod resource here; use"
                                 " cpu, memory, ephemeral-storage or hugepages-<size>")
        return v


class EnvVar(APIModel):
    name: str = Field(min_length=1, max_length=256, pattern=ENV_NAME_PATTERN,
                      description="Variable name.")
    value: str = Field(default="", max_length=32768, description="Its value.")

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        if v.startswith(RESERVED_ENV_PREFIXES) or v in RESERVED_ENV:
            raise ValueError(f"{v!r} is set by the operator or the trainer; choose another"
                             " name (RLPACER_*, RAY_*, HOME, XDG_CACHE_HOME, HF_HUB_OFFLINE,"
                             " TRANSFORMERS_OFFLINE and CUDA_VISIBLE_DEVICES are reserved)")
        return v


class LocalObjectReference(APIModel):
    name: str = Field(min_length=1, max_length=253, description="Name of a Secret.")


class PodSettings(APIModel):
    """Pod API fields a role's pods take as given (the Pod API's names)."""

    resources: ContainerResources | None = Field(
        default=None,
        description="The role's container requests and limits (cpu, memory; GPUs excluded).",
    )
    env: list[EnvVar] | None = Field(
        default=None, max_length=64,
        description="Extra environment variables of the role's container (after the operator's).",
    )
    image_pull_secrets: list[LocalObjectReference] | None = Field(
        default=None, max_length=16,
        description="Secrets (docker-registry) the role's pods pull their image with.",
    )

    @field_validator("env")
    @classmethod
    def _unique(cls, v: list[EnvVar] | None) -> list[EnvVar] | None:
        names = [e.name for e in v or []]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"env: {dup} given more than once")
        return v


class RolloutSpec(PodSettings):
    image: str = Field(
        default="ghcr.io/rlpacer/trainer:0.1.0", max_length=512,
        description="Container image of the rollout workers (vLLM engines).",
    )
    replicas: int = Field(default=1, ge=1, le=1024, description="Rollout replicas in short rounds.")
    gpus_per_replica: int = Field(default=1, ge=0, le=64, description="GPUs per rollout replica.")
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=64,
        description=(
            "vLLM tensor parallelism: GPUs per engine. Must equal gpusPerReplica (one engine"
            " per replica spans all of its GPUs), and be 1 when gpusPerReplica is 0."
        ),
    )
    max_response_tokens: int = Field(
        default=512, ge=1, le=MAX_TOKENS, description="Length cap of a response, in tokens."
    )
    max_prompt_tokens: int | None = Field(
        default=None, ge=1, le=MAX_TOKENS,
        description=(
            "Length cap of a prompt in tokens (after the chat template); a longer prompt in"
            " the data fails the job with DataInvalid. The engines' max model length is"
            " maxPromptTokens + maxResponseTokens. Unset: the longest prompt of the data."
        ),
    )
    temperature: Annotated[Decimal, DecimalRange(0, 100)] = Field(
        default="1.0",
        description="Sampling temperature, in [0, 100] (far past where sampling is noise).",
    )
    top_p: Annotated[Decimal, DecimalRange(0, 1, low_open=True)] = Field(
        default="1.0", description="Nucleus sampling mass in (0, 1]."
    )

    @model_validator(mode="after")
    def _ranges(self, info: ValidationInfo) -> RolloutSpec:
        gpus, tp = self.gpus_per_replica, self.tensor_parallel_size
        if gpus and tp > gpus:
            raise ValueError("tensorParallelSize must be <= gpusPerReplica")
        if stored(info):
            # admitted before tensorParallelSize had to equal gpusPerReplica: a stored job
            # keeps running as it did (admission refuses the change; the CRD ratchets it)
            return self
        if gpus and tp != gpus:
            raise ValueError(
                f"tensorParallelSize must equal gpusPerReplica ({gpus}): each engine spans"
                f" the GPUs its replica reserves (tensorParallelSize {tp} would leave"
                f" {gpus - tp} idle)")
        if not gpus and tp != 1:
            raise ValueError(f"tensorParallelSize must be 1 when gpusPerReplica is 0 (a CPU"
                             f" engine has no tensor parallelism), not {tp}")
        return self


class TrainerSpec(PodSettings):
    image: str = Field(
        default="ghcr.io/rlpacer/trainer:0.1.0", max_length=512,
        description=(
            "Container image of the trainer (Ray head, driver, learner). resources, env and"
            " imagePullSecrets here are the learner pods'; head and driver have their own."
        ),
    )
    replicas: int = Field(
        default=1, ge=1, le=1024,
        description="Learner pods. The learner has one rank per trainer GPU (replicas x"
                    " gpusPerReplica), or replicas x cpuRanksPerReplica without GPUs.",
    )
    gpus_per_replica: int = Field(
        default=1, ge=0, le=64,
        description="GPUs per learner pod: one learner rank (process) on each.",
    )
    cpu_ranks_per_replica: int = Field(
        default=1, ge=1, le=16,
        description=(
            "Learner ranks per learner pod when gpusPerReplica is 0 (CPU ranks, gloo); with"
            " GPUs there is one rank per GPU and this must stay 1."
        ),
    )
    sharding: LearnerSharding = Field(
        default=LearnerSharding.FSDP,
        description=(
            "FSDP: parameters, gradients and AdamW state sharded over all learner ranks"
            " (bfloat16 compute over float32 master shards on GPUs); a single CPU rank has"
            " nothing to shard. Replicated: every rank holds the whole model and optimizer,"
            " gradients all-reduced (a model must fit on one GPU)."
        ),
    )
    micro_batch_tokens: int = Field(
        default=16384, ge=0, le=16 * MAX_TOKENS,
        description=(
            "Padded tokens (sequences x the longest one) per forward/backward pass on one"
            " rank: each optimizer step's batch is split into micro-batches of at most this"
            " many and their gradients summed, so a step's activation memory is bounded"
            " whatever the group size and response lengths (a sequence longer than the"
            " budget is a micro-batch of its own). 0: one pass per optimizer step."
        ),
    )
    activation_checkpointing: bool = Field(
        default=True,
        description=(
            "Recompute each decoder layer's activations in the backward pass instead of"
            " keeping them: about a third more learner compute for activation memory of one"
            " layer plus each layer's input (without it no Qwen2.5 size fits 80 GB GPUs at"
            " the default microBatchTokens; docs/learner-fit.md)."
        ),
    )
    stream_training: bool | None = Field(
        default=None,
        description=(
            "Train each group as it finishes: while a step's rollout still generates, the"
            " learner makes the passes that need only the weights the step starts from (the"
            " first mini-batch's forward and backward, the later ones' no-grad passes, the"
            " reference model's) on the groups already complete and scored, so less of the"
            " training is left after the last response. The update is the one taken on the"
            " whole batch (float summation order aside). Pays where the learner has its own"
            " GPUs; on a CPU-only machine it competes with the engines for the cores. Unset:"
            " off."
        ),
    )

    @model_validator(mode="after")
    def _ranks(self) -> TrainerSpec:
        if self.gpus_per_replica and self.cpu_ranks_per_replica != 1:
            raise ValueError("cpuRanksPerReplica applies only without GPUs (gpusPerReplica:"
                             " 0); with GPUs the learner has one rank per GPU")
        return self


class GroupControlSpec(APIModel):
    mode: GroupControlMode = Field(
        default=GroupControlMode.SAGC,
        description="SAGC (straggler-aware group-size control) or Fixed (always `initial`).",
    )
    candidates: list[GroupSize] = Field(
        default_factory=lambda: [4, 8, 16], min_length=1, max_length=16,
        description="Allowed group sizes, strictly increasing.",
    )
    initial: int = Field(
        default=8, ge=1, le=MAX_GROUP_SIZE,
        description="First group size (the only one when mode is Fixed).",
    )
    target_straggler_rate: Annotated[Decimal, DecimalRange(0, 1, True, True)] = Field(
        default="0.2",
        description="delta, the straggler SLO: long-run rate of straggler steps, in (0, 1).",
    )
    straggler_ratio: Annotated[Decimal, DecimalRange(1, MAX_TOKENS, low_open=True)] = Field(
        default="4",
        description=(
            "tau: a step whose max/median response length exceeds it is a straggler step,"
            " in (1, 1048576] (no ratio of lengths can exceed the largest length cap)."
            " Pick it near the workload's typical ratio, or the constraint never binds."
        ),
    )
    forgetting: Annotated[Decimal, DecimalRange(0, 1, low_open=True)] = Field(
        default="0.95", description="Posterior forgetting factor in (0, 1]."
    )
    dual_step_size: Annotated[Decimal, DecimalRange(0, 100)] = Field(
        default="0.05",
        description=("Dual ascent step size, in [0, 100] (a step of lambdaMax's scale already"
                     " moves the multiplier end to end)."),
    )
    lambda_max: Annotated[Decimal, DecimalRange(0, 1000, low_open=True)] = Field(
        default="10",
        description=("Upper bound of the multiplier, in (0, 1000] (it prices a straggler"
                     " probability against a cost near 1: 1000 already forbids any risk)."),
    )
    local_search_radius: int = Field(
        default=1, ge=0, le=16, description="How many candidate positions G may move per step."
    )
    window_steps: int = Field(
        default=50, ge=1, le=10_000, description="Window of the reported straggler rate."
    )
    objective: GroupControlObjective = Field(
        default=GroupControlObjective.PER_STEP,
        description=(
            "What SAGC maximises under the straggler SLO. PerStep (the default, the paper's):"
            " log2(G) per step, so it keeps the largest G the SLO allows. PerSecond: log2(G)"
            " per second of a step's wall clock (rollout, reward, training, sync, as each"
            " step reports them; a size not yet measured is priced from the nearest measured"
            " one in proportion to G), so it keeps the size whose log2(G) costs least: for"
            " tasks where what a step teaches depends little on G. Mode Fixed ignores it."
        ),
    )
    seed: int = Field(default=0, ge=0, le=MAX_SEED, description="Seed of Thompson sampling.")

    @field_validator("candidates")
    @classmethod
    def _sorted_unique(cls, v: list[int]) -> list[int]:
        if any(b <= a for a, b in itertools.pairwise(v)):
            raise ValueError("candidates must be strictly increasing, e.g. [4, 8, 16]")
        return v

    @model_validator(mode="after")
    def _ranges(self) -> GroupControlSpec:
        if self.initial not in self.candidates:
            raise ValueError(
                f"initial ({self.initial}) must be one of candidates {self.candidates}"
            )
        return self

    def sagc_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``rlpacer.control.sagc.SAGCConfig`` (the API layer does not
        import the control layer)."""
        return {
            "candidates": tuple(self.candidates),
            "delta": decimal(self.target_straggler_rate),
            "tau": decimal(self.straggler_ratio),
            "forgetting": decimal(self.forgetting),
            "dual_step": decimal(self.dual_step_size),
            "lambda_max": decimal(self.lambda_max),
            "radius": self.local_search_radius,
            "initial": self.initial,
            "seed": self.seed,
            "objective": ("second" if self.objective is GroupControlObjective.PER_SECOND
                          else "step"),
        }


class LongRoundSpec(APIModel):
    rollout_replicas: int = Field(
        default=1, ge=1, le=1024,
        description=(
            "Rollout replicas during a long round (>= rollout.replicas); scaled back after."
        ),
    )
    scale_up_timeout_seconds: int = Field(
        default=300, ge=1, le=86_400,
        description=(
            "How long a long round waits for extra replicas before it runs on what is ready."
        ),
    )
    scale_up_lead_seconds: int = Field(
        default=0, ge=0, le=86_400,
        description=(
            "Early scale-up: how far ahead of a coming long round the driver asks for its"
            " extra replicas (the planner forecasts the round from its filling queue), so"
            " that their pods are ready and their engines hold the weights when it starts;"
            " the short rounds in between use the replicas that have joined, and they are"
            " kept while the next long round is forecast within the lead. This value is used"
            " until a scale-up has been measured, then the measured time from the request to"
            " the added engines serving. 0 (the default): no early scale-up; the replicas"
            " are asked at the report before the long round, which waits for them."
        ),
    )
    max_deferred_rounds: int = Field(
        default=0, ge=0, le=64,
        description=(
            "While a long round's extra replicas are not ready (Kueue has not admitted them, a"
            " burst pool is busy, or their pods are starting), the driver runs up to this many"
            " short rounds in its place instead of waiting, each from the epoch's fresh"
            " prompts; the long round's prompts stay queued and train exactly once, in the"
            " long round that follows. Each such round restarts scaleUpTimeoutSeconds; past"
            " the last, the long round waits as without this. No effect at an epoch's end"
            " (no fresh prompt left: the long round waits). 0 (the default): the long round"
            " waits."
        ),
    )
    queue_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=QUEUE_NAME_PATTERN,
        description=(
            "Kueue LocalQueue the long round's extra rollout replicas are asked from (a"
            " Workload of their own, admitted before the rollout StatefulSet grows), e.g. one"
            " whose ClusterQueue borrows from a burst pool shared by jobs; default"
            " scheduling.queueName. Needs scheduling.queueName: the job's own pods are"
            " admitted there."
        ),
    )
    join_mid_round: bool | None = Field(
        default=None,
        description=(
            "A long round whose extra replicas are not all serving starts at once on the"
            " replicas that are, instead of waiting for them (scaleUpTimeoutSeconds); each"
            " added engine starts as its pod becomes ready and, once it holds the round's"
            " weights, takes a share of the round's unfinished requests, the ones already"
            " generating with their tokens so far (continued from them, not generated"
            " again). Unset or false: the long round waits for its replicas and splits its"
            " requests once, at its start."
        ),
    )
    release_when_fits: bool | None = Field(
        default=None,
        description=(
            "Give a long round's added replicas back as soon as its unfinished requests fit"
            " on the rollout's own replicas at the load each began the round with (and the"
            " next round is not another long one): the added engines' unfinished requests"
            " move there with their tokens, the engines are shut down, and the operator"
            " scales the rollout back at once, instead of at the step's report (after the"
            " round's tail, the rewards, the training and the weight sync). An operator"
            " without this (an older one) scales back at the report. With"
            " tensorParallelSize the wide engines stay to the round's end (they are there"
            " for its tail) and are given back then, before the rewards, the training and"
            " the weight sync, when the next round is short. Unset or false: at the report."
        ),
    )
    tensor_parallel_size: int | None = Field(
        default=None, ge=1, le=64,
        description=(
            "Wider engines for long rounds: each of the long round's extra replicas"
            " (rolloutReplicas - rollout.replicas) is one engine of this tensor-parallel size"
            " on a pod of its own with as many GPUs (StatefulSet <job>-rollout-wide, its"
            " ordinals following the rollout's; the rollout's resources, image and"
            " scheduling), and the driver runs the long round's queued prompts on them alone"
            " and its fill (fillPrompts) on the rollout's engines, which would otherwise"
            " wait through the round (if no wide engine is ready in time, all of it on the"
            " rollout's); short rounds run on the rollout's engines only. Needs rolloutReplicas >"
            " rollout.replicas; must be 1 when rollout.gpusPerReplica is 0 (a CPU engine"
            " has no tensor parallelism; the pods and the routing are the same). Unset: the"
            " extras are engines like the rollout's and a long round runs on all of them."
        ),
    )
    prompts: int | None = Field(
        default=None, ge=1, le=1_000_000,
        description=(
            "Prompts a long round waits for and runs at once (>= promptsPerStep): the"
            " deferred prompts queue until this many are there, or the epoch's fresh prompts"
            " run out (then what is queued runs). A long round lasts about as long as its"
            " longest response, which decodes at a small batch whatever the round's size, so"
            " a larger value runs fewer long rounds of about the same length: the same"
            " prompts, each trained once an epoch, in less rollout time; a value at least the"
            " epoch's deferred prompts runs one long round an epoch, at its end. The learner"
            " trains such a round in as many optimizer updates as its prompts would take in"
            " steps of promptsPerStep (ceil(prompts / promptsPerStep) x the algorithm's"
            " mini-batches), so updates per prompt do not change. Unset: promptsPerStep."
        ),
    )
    fill_prompts: int | None = Field(
        default=None, ge=0, le=1_000_000,
        description=(
            "Fresh prompts a long round also launches beside its queued ones (groupSize"
            " responses each), to be generated in the engine capacity the round's tail leaves"
            " idle: a long round lasts about as long as its longest response, while most of"
            " its responses end early. The round still ends when its queued prompts' groups"
            " are done; a fill prompt whose group has completed by then trains in the same"
            " step, one that has not is aborted and queued for a later long round (as a short"
            " round defers its slowest). Each prompt still trains once an epoch. The learner"
            " counts fill prompts in the round's optimizer updates as it counts the queued"
            " ones (ceil(launched prompts / promptsPerStep) x the algorithm's mini-batches)."
            " With tensorParallelSize the fill runs on the rollout's own engines beside the"
            " wide ones. No effect at an epoch's end (no fresh prompt left). Unset or 0: a"
            " long round runs its queued prompts only."
        ),
    )
    min_yield_ratio: Annotated[Decimal, DecimalRange(0, 100)] = Field(
        default="0.25",
        description=(
            "A due long round runs only when its measured yield (informative groups, whose"
            " rewards are not all equal, per token of its critical path, the longest response"
            " of each round) is at least this fraction of the short rounds'; otherwise its"
            " prompts are retired for the epoch (not generated, not trained; offered again"
            " next epoch) and no step is spent on them. The first"
            " long round always runs, and after 4 retired in a row the next runs to"
            " re-measure. 0: every due long round runs."
        ),
    )


class LengthPriorSpec(APIModel):
    """A per-prompt response-length prior, learned from each prompt's earlier epochs (never
    from its text), and what it is used for. Each use is off unless set; the prior's
    calibration is reported either way."""

    route: bool = Field(
        default=False,
        description=(
            "Send a fresh prompt that was seen in an earlier epoch and whose predicted length"
            " ranks at or above routeQuantile of all prompts straight to a long round, instead"
            " of racing it in an over-provisioned short round (at most as many a round as the"
            " race would defer)."
        ),
    )
    route_quantile: Annotated[Decimal, DecimalRange(0.5, 1)] = Field(
        default="0.8",
        description="The predicted-length rank, in [0.5, 1], from which route sends prompts.",
    )
    dispatch: bool = Field(
        default=False,
        description=(
            "Send a round's requests to the rollout engines by predicted length, the longest"
            " first, each to the engine with the fewest predicted tokens outstanding (off: the"
            " fewest requests outstanding)."
        ),
    )
    half_life_groups: int | None = Field(
        default=None, ge=1, le=100_000_000,
        description=(
            "Forget: a trained group's lengths weigh half as much once this many more groups"
            " have been trained, so the prior follows lengths that drift as the policy learns"
            " (the population's level within about this many groups; each prompt's own"
            " evidence, kept as its offset from that level, across epochs: a few epochs of"
            " groups keeps a prompt's rank and follows a change in its length). Unset: every"
            " group weighs the same."
        ),
    )
    context: bool = Field(
        default=False,
        description=(
            "Give SAGC the next round's predicted straggler probability at each candidate"
            " group size (from the prompts it will launch), on the step report: SAGC then"
            " keeps a posterior per candidate for rounds predicted riskier than their recent"
            " median and one for the rest, and draws from the one the round falls in. Works"
            " with or without tail batching; no effect in groupControl.mode Fixed."
        ),
    )


class TailBatchingSpec(APIModel):
    enabled: bool = Field(default=True, description="Defer long-tail prompts to long rounds.")
    activation: TailBatchingActivation = Field(
        default=TailBatchingActivation.ADAPTIVE,
        description=(
            "When short rounds are over-provisioned (and so defer prompts to long rounds)."
            " Adaptive: only while the measured lengths of plain short rounds straggle"
            " (max > groupControl.stragglerRatio x median in 2 of the last 4), switched off"
            " again by plain probe rounds that do not; a workload without a long tail runs"
            " plain synchronous rounds. Always: every short round."
        ),
    )
    prompt_overprovision: Annotated[Decimal, DecimalRange(1, 16)] = Field(
        default="1.25",
        description=(
            "eta: a short round launches ceil(eta * promptsPerStep) prompts, in [1, 16] (more"
            " would be mostly aborted work; the bound keeps the counts a step report is"
            " checked against finite)."
        ),
    )
    extra_responses_per_prompt: int = Field(
        default=1, ge=0, le=64,
        description=(
            "Responses launched beyond G per prompt in a short round; a prompt's group is its"
            " first G to finish. 0: no selection inside a group (a group that holds a long"
            " response keeps it, or its prompt is deferred)."
        ),
    )
    keep_near_cap: Annotated[Decimal, DecimalRange(0, 1, high_open=True)] | None = Field(
        default=None,
        description=(
            "f in [0, 1): when the response that completes an over-provisioned short round's"
            " promptsPerStep-th group is at least (1 - f) x rollout.maxResponseTokens long,"
            " the round has waited for its tail already: it defers nothing, waits for every"
            " launched prompt's group (each ends within f of the cap) and trains them all."
            " 0: only when that response was cut at the cap. Unset: every over-provisioned"
            " round defers the prompts it has not finished."
        ),
    )
    long_round: LongRoundSpec = Field(
        default_factory=LongRoundSpec, description="Rollout capacity of long rounds."
    )
    length_prior: LengthPriorSpec | None = Field(
        default=None,
        description=(
            "Uses of the per-prompt length prior (routing, dispatch, SAGC context); unset:"
            " none (the prior"
            " is still learned and its calibration reported)."
        ),
    )


#: checkpoint.evictionGraceSeconds when unset on a job with a checkpoint claim.
DEFAULT_EVICTION_GRACE_SECONDS = 120


class CheckpointSpec(APIModel):
    volume_claim: str | None = Field(
        default=None, max_length=253,
        description=("PVC (ReadWriteMany) for checkpoints, shared by the driver and learner"
                     " pods. Unset: each pod's emptyDir; the checkpoints then go with the"
                     " driver pod (no resume across attempts, the trained model lost with it)."),
    )
    every_steps: int = Field(default=20, ge=1, le=1_000_000, description="Checkpoint interval.")
    eviction_grace_seconds: int | None = Field(
        default=None, ge=0, le=86_400,
        description=(
            "When Kueue evicts the job (a preemption, a stopped queue) or spec.suspend is set"
            " while it runs, how long its pods are kept for the driver to reach its next step"
            " report: that report is accepted and answered as the job's last, so the driver"
            " checkpoints there and stops, and the resumed attempt loses no step; then the"
            " pods are deleted (and Kueue's quota given back; at once once the driver has"
            " stopped). 0: the pods are deleted at"
            " once, and the job resumes from its last periodic checkpoint. Default: 120 with"
            " volumeClaim, 0 without; a value above 0 needs volumeClaim (no checkpoint"
            " outlives the pods without it)."
        ),
    )

    @model_validator(mode="after")
    def _grace_needs_claim(self) -> CheckpointSpec:
        if self.eviction_grace_seconds and self.volume_claim is None:
            raise ValueError(
                "checkpoint.evictionGraceSeconds needs checkpoint.volumeClaim (without a"
                " claim no checkpoint outlives the pods): set volumeClaim, or remove"
                " evictionGraceSeconds")
        return self

    @property
    def eviction_grace(self) -> int:
        """The eviction grace in effect: the field, else 120 s with a claim and 0 without."""
        if self.eviction_grace_seconds is not None:
            return self.eviction_grace_seconds
        return DEFAULT_EVICTION_GRACE_SECONDS if self.volume_claim is not None else 0


class Toleration(APIModel):
    key: str | None = Field(default=None, description="Taint key to tolerate.")
    operator: str | None = Field(default=None, description="Exists or Equal.")
    value: str | None = Field(default=None, description="Taint value.")
    effect: str | None = Field(default=None, description="NoSchedule, PreferNoSchedule, NoExecute.")
    toleration_seconds: int | None = Field(
        default=None, ge=0, le=MAX_DURATION_SECONDS,
        description="For NoExecute: seconds the pods stay bound after the taint, at most ten"
                    " years.",
    )


class SchedulingSpec(APIModel):
    priority_class_name: str | None = Field(
        default=None, max_length=253, description="Pods' priority class."
    )
    node_selector: dict[str, str] | None = Field(default=None, description="Pods' node selector.")
    tolerations: list[Toleration] | None = Field(
        default=None, max_length=32,
        description="Added to the pods (GPU taints are tolerated already).",
    )
    queue_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=QUEUE_NAME_PATTERN,
        description=(
            "Kueue LocalQueue that admits the job: the operator makes the job a Workload (one"
            " pod set per role) and runs no pod until Kueue admits it; the admitted flavors'"
            " node labels and tolerations go onto the pods; evicted, the job stops and"
            " resumes from its last checkpoint when admitted again. Needs Kueue installed."
        ),
    )


class RLTrainingJobSpec(APIModel):
    model: ModelSpec = Field(description="The policy model to train.")
    data: DataSpec = Field(description="The prompt dataset.")
    algorithm: AlgorithmSpec = Field(
        default_factory=AlgorithmSpec, description="RL algorithm (GRPO or DAPO) and its knobs."
    )
    reward: RewardSpec = Field(default_factory=RewardSpec, description="How responses are scored.")
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        description="Rollout workers (vLLM engines): image, replicas, GPUs, sampling.",
    )
    trainer: TrainerSpec = Field(
        default_factory=TrainerSpec, description="Trainer (Ray head, driver, learners)."
    )
    steps: int = Field(
        ge=1, le=MAX_STEPS,
        description=(
            "Steps to run: one per round, each ending in its policy update (a long round of"
            " more than promptsPerStep prompts, tailBatching.longRound.prompts, is one step"
            " whose update takes as many optimizer steps as its prompts' steps would)."))
    prompts_per_step: int = Field(ge=1, le=1_000_000, description="P0: prompts trained per step.")
    group_control: GroupControlSpec = Field(
        default_factory=GroupControlSpec,
        description="How the group size G is chosen each step: SAGC or Fixed.",
    )
    tail_batching: TailBatchingSpec = Field(
        default_factory=TailBatchingSpec,
        description=(
            "Tail batching: long-tail prompts deferred to long rounds with more rollout replicas."
        ),
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec, description="Where and how often to checkpoint."
    )
    driver: PodSettings | None = Field(
        default=None,
        description="The driver pod's resources, env and imagePullSecrets (image: trainer's).",
    )
    head: PodSettings | None = Field(
        default=None,
        description="The Ray head pod's resources, env and imagePullSecrets (image: trainer's).",
    )
    scheduling: SchedulingSpec = Field(
        default_factory=SchedulingSpec,
        description="Scheduling fields passed through to the pods (priority, nodes, Kueue).",
    )
    suspend: bool = Field(
        default=False, description="Suspend: delete pods, keep state; resume later."
    )
    backoff_limit: int = Field(
        default=3, ge=0, le=1000,
        description="Trainer restarts (from the last checkpoint) before Failed.",
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, le=MAX_DURATION_SECONDS,
        description="Fail the job when it runs longer than this (at most ten years).",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, le=MAX_DURATION_SECONDS,
        description="Delete the finished job (and children) after this long (at most ten years).",
    )

    @model_validator(mode="after")
    def _cross(self) -> RLTrainingJobSpec:
        tb = self.tail_batching
        if tb.long_round.queue_name is not None and self.scheduling.queue_name is None:
            raise ValueError(
                "tailBatching.longRound.queueName needs scheduling.queueName (the job's own"
                " pods are admitted through Kueue too): set scheduling.queueName, or remove"
                " tailBatching.longRound.queueName")
        if tb.enabled and tb.long_round.rollout_replicas < self.rollout.replicas:
            raise ValueError(
                "tailBatching.longRound.rolloutReplicas must be >= rollout.replicas"
                f" ({tb.long_round.rollout_replicas} < {self.rollout.replicas})"
            )
        wide = tb.long_round.tensor_parallel_size
        if wide is not None:
            if tb.long_round.rollout_replicas <= self.rollout.replicas:
                raise ValueError(
                    "tailBatching.longRound.tensorParallelSize needs"
                    " tailBatching.longRound.rolloutReplicas > rollout.replicas (the wide"
                    " engines are the long round's extra replicas;"
                    f" {tb.long_round.rollout_replicas} <= {self.rollout.replicas}): raise"
                    " rolloutReplicas, or remove tensorParallelSize")
            if not self.rollout.gpus_per_replica and wide != 1:
                raise ValueError(
                    "tailBatching.longRound.tensorParallelSize must be 1 when"
                    f" rollout.gpusPerReplica is 0 (a CPU engine has no tensor parallelism),"
                    f" not {wide}")
        lp = tb.long_round.prompts
        if lp is not None and lp < self.prompts_per_step:
            raise ValueError(
                f"tailBatching.longRound.prompts must be >= promptsPerStep ({lp} <"
                f" {self.prompts_per_step}): a long round runs at least a step's prompts;"
                " raise it, or remove it (a long round of promptsPerStep prompts)")
        op = self.algorithm.overlong_penalty
        if (op is not None and op.buffer_tokens is not None
                and op.buffer_tokens >= self.rollout.max_response_tokens):
            raise ValueError(
                "algorithm.overlongPenalty.bufferTokens must be < rollout.maxResponseTokens"
                f" ({op.buffer_tokens} >= {self.rollout.max_response_tokens})"
            )
        return self


def algorithm_knob(a: AlgorithmSpec, name: str) -> Any:
    """One knob of ``a``: its own value if set, else its preset's."""
    v = getattr(a, name)
    return PRESETS[a.name][name] if v is None else v


def wide_long_rounds(spec: RLTrainingJobSpec) -> bool:
    """Whether the job's long rounds run on wide engines of their own
    (``tailBatching.longRound.tensorParallelSize``)."""
    tb = spec.tail_batching
    return (tb.enabled and tb.long_round.tensor_parallel_size is not None
            and tb.long_round.rollout_replicas > spec.rollout.replicas)


def extra_replica_tp(spec: RLTrainingJobSpec) -> int:
    """Tensor-parallel size of a long round's extra replica's engine."""
    if wide_long_rounds(spec):
        return int(spec.tail_batching.long_round.tensor_parallel_size or 1)
    return int(spec.rollout.tensor_parallel_size)


def extra_replica_gpus(spec: RLTrainingJobSpec) -> int:
    """GPUs of a long round's extra replica (0 on CPU): a wide engine's tensor-parallel size,
    else the rollout's ``gpusPerReplica``."""
    if not spec.rollout.gpus_per_replica:
        return 0
    return extra_replica_tp(spec) if wide_long_rounds(spec) else int(
        spec.rollout.gpus_per_replica)


def effective_algorithm(spec: RLTrainingJobSpec) -> EffectiveAlgorithm:
    """The preset of ``spec.algorithm.name`` with every knob the spec sets overriding it."""
    a = spec.algorithm
    preset = PRESETS[a.name]

    def knob(name: str) -> Any:
        return algorithm_knob(a, name)

    op = a.overlong_penalty
    on = preset["overlong_penalty"] if op is None else op.enabled
    buffer = 0
    if on:
        cap = int(spec.rollout.max_response_tokens)
        buffer = (op.buffer_tokens if op is not None and op.buffer_tokens is not None
                  else cap // 5)
    return EffectiveAlgorithm(
        name=a.name,
        clip_ratio_low=knob("clip_ratio_low"),
        clip_ratio_high=knob("clip_ratio_high"),
        loss_aggregation=knob("loss_aggregation"),
        dynamic_sampling=knob("dynamic_sampling"),
        overlong_buffer_tokens=buffer,
        overlong_penalty=op.penalty if op is not None else "1.0",
        kl_coef=knob("kl_coef"),
        learning_rate=a.learning_rate,
    )


class ObjectMeta(APIModel):
    """The part of metadata rlpacer reads; the rest passes through untouched."""

    model_config = APIModel.model_config | {"extra": "allow"}
    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH,
                      pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    namespace: str = Field(default="default", max_length=63)
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class RLTrainingJob(TypedObject):
    expected_api_version: ClassVar[str] = API_VERSION
    expected_kind: ClassVar[str] = KIND

    api_version: str = Field(default=API_VERSION)
    kind: str = Field(default=KIND)
    metadata: ObjectMeta
    spec: RLTrainingJobSpec
    status: dict[str, Any] | None = None


class ManifestError(ValueError):
    """A manifest that does not validate; the message names each bad field."""


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(_camel(str(p)) if isinstance(p, str) else f"[{p}]" for p in e["loc"])
        loc = loc.replace(".[", "[")
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{prefix}{loc or '<root>'}: {msg}")
    return "\n".join(lines)


def parse_job(obj: dict[str, Any], *, stored: bool = False) -> RLTrainingJob:
    """Validate a manifest dict; raise :class:`ManifestError` naming each bad field.
    ``stored``: a job the API server already holds (a driver's config): rules newer than
    it may be are not enforced (``_base.STORED_CONTEXT``)."""
    try:
        return RLTrainingJob.model_validate(obj, context=STORED_CONTEXT if stored else None)
    except ValidationError as err:
        raise ManifestError("invalid RLTrainingJob:\n" + format_validation_error(err)) from None


def parse_spec(spec: dict[str, Any], *, stored: bool = False) -> RLTrainingJobSpec:
    """Validate a spec dict (what the admission webhook reads; ``stored`` as
    :func:`parse_job`)."""
    try:
        return RLTrainingJobSpec.model_validate(spec, context=STORED_CONTEXT if stored
                                                else None)
    except ValidationError as err:
        raise ManifestError(
            "invalid RLTrainingJob spec:\n" + format_validation_error(err, prefix="spec.")
        ) from None


def read_spec(spec: dict[str, Any]) -> tuple[RLTrainingJobSpec, list[str]]:
    """Read the spec of a *stored* job (what the operator does): fields this version does not
    know (written under a newer schema) are ignored and returned, by path; every known field
    is validated as by :func:`parse_spec` (a bad value is still a :class:`ManifestError`)."""
    try:
        model, ignored = read_stored(RLTrainingJobSpec, spec, drop_invalid=False)
    except ValidationError as err:
        raise ManifestError(
            "invalid RLTrainingJob spec:\n" + format_validation_error(err, prefix="spec.")
        ) from None
    return model, [f"spec.{p}" for p in ignored]


def _read_stored_job(doc: dict[str, Any], path: str | Path) -> RLTrainingJob:
    """A stored job's manifest (a pod's config, written by the operator): fields this
    version does not know (a newer operator's) are ignored, named in one warning; every
    known field is validated as by :func:`parse_job` with ``stored``."""
    import sys

    try:
        job, ignored = read_stored(RLTrainingJob, doc, drop_invalid=False)
    except ValidationError as err:
        raise ManifestError("invalid RLTrainingJob:\n" + format_validation_error(err)) from None
    if ignored:
        print(f"warning: {path}: fields this version does not know, ignored (written by a"
              f" newer operator?): {', '.join(ignored)}", file=sys.stderr, flush=True)
    return job


def load_manifest(path: str | Path, *, stored: bool = False) -> RLTrainingJob:
    """Read a YAML manifest (the first RLTrainingJob document in the file); ``stored`` as
    :func:`parse_job`."""
    text = Path(path).read_text()
    for doc in yaml.safe_load_all(text):
        if isinstance(doc, dict) and doc.get("kind") == KIND:
            try:
                if stored:
                    return _read_stored_job(doc, path)
                return parse_job(doc, stored=stored)
            except ManifestError as err:
                raise ManifestError(f"{path}: {err}") from None
    raise ManifestError(f"{path}: no document with kind: {KIND}")
