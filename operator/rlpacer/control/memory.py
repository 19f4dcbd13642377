"""The learner's memory per rank, estimated before it starts (pure: no torch, no I/O).

From a Hugging Face model config (``config.json`` as a mapping) and the learner's layout,
:func:`estimate` gives the bytes one learner rank needs at the peak of a training step:
weights, gradients, optimizer state, activations and a fixed framework overhead. The trainer
(``rlpacer_trainer.fit``) compares it with the memory the rank has and fails the job with these
numbers instead of an out-of-memory error at step 0; ``rlpacer fit`` prints it for a platform
team (docs/learner-fit.md).

Assumptions (an estimate, not a measurement; each figure is per rank, ``W`` the world size
when sharded and 1 when not, ``P`` the model's parameters):

* **Parameters** of a Qwen2/Llama decoder: embeddings ``V x h``, an untied ``lm_head``
  ``V x h`` (none when ``tie_word_embeddings``), a final RMSNorm ``h``; per layer q/k/v
  projections with biases (as Qwen2 has; ``attention_bias: false`` in the config, as Llama,
  drops them), an o projection without bias, a SwiGLU MLP (gate, up, down: ``3 x h x i``)
  and two RMSNorms. ``head_dim`` is the config's, else ``h / num_attention_heads``.
* **Precision** ``bf16-mixed`` (a GPU learner): float32 master weights, float32 gradients and
  AdamW's two float32 moments, all sharded (``4 + 4 + 8`` bytes per parameter over W); the
  forward/backward gathers bfloat16 parameters one FSDP unit at a time: the root unit
  (embeddings, final norm, untied ``lm_head``) and two decoder layers (the one computing and
  the one prefetched) are in flight at once, and one unit's unsharded bfloat16 gradient before
  its reduce-scatter. Activations are bfloat16. ``fp32`` (a CPU learner): everything float32,
  the gathered parameters and gradients too.
* **Not sharded** (``sharding: Replicated``): every rank holds all of it (W = 1 above) and
  nothing is gathered; under ``bf16-mixed`` autocast keeps a bfloat16 copy of every weight it
  cast for the step (``2 x P`` bytes).
* **Reference model** (KL on): frozen, in the compute dtype (bfloat16 on GPU, float32 on CPU),
  sharded like the policy; no gradients or optimizer state. Its forward runs apart from the
  policy's backward, so it adds no activations.
* **Activations** of one micro-batch of ``T`` tokens (``microBatchTokens``: padded tokens per
  forward/backward on one rank). Per token and layer, without checkpointing, a decoder layer
  keeps for its backward: its input, the two norms' outputs, the residual after attention,
  q, k, v, the rotated q and k, the attention output (``5h + 3 q_dim + 3 kv_dim``), the MLP's
  gate, up, activation and product (``4i``), in the compute dtype, plus the two RMSNorms'
  float32 inputs (``2 x 4h`` bytes); attention itself is a fused kernel (no ``T x T`` scores
  kept). With activation checkpointing only each layer's input is kept, and one layer's
  activations are rebuilt at a time during the backward. The logits are float32
  (``T x V x 4`` bytes) times :data:`LOGITS_COPIES` (the logits, their log-softmax and its
  gradient). ``microBatchTokens: 0`` (one pass per optimizer step) bounds nothing: the
  activations and logits are then not counted.
* **Overhead**: :data:`OVERHEAD_BYTES` for the framework (CUDA context, NCCL/gloo buffers,
  the allocator's fragmentation, the interpreter and its libraries).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from rlpacer.control.errors import ConfigError

GIB = 1 << 30


class Precision(StrEnum):
    BF16_MIXED = "bf16-mixed"
    FP32 = "fp32"


#: copies of the float32 logits alive at the peak: the logits, their log-softmax, its gradient
LOGITS_COPIES = 3
#: fixed framework overhead per rank
OVERHEAD_BYTES: dict[Precision, int] = {Precision.BF16_MIXED: 3 * GIB, Precision.FP32: 1 * GIB}


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a decoder's ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    attention_bias: bool = True

    @classmethod
    def from_config(cls, conf: Mapping[str, Any]) -> ModelShape:
        """From a Hugging Face ``config.json`` (a Qwen2/Llama layout); a missing or
        non-positive size raises :class:`ConfigError` naming the key."""
        def size(key: str, default: int | None = None) -> int:
            v = conf.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"config.json: {key}",
                                  f"{v!r}: expected a positive integer (a decoder's size)")
            return v

        heads = size("num_attention_heads")
        head_dim = conf.get("head_dim")
        bias = conf.get("attention_bias")
        if bias is None:  # Qwen2 has q/k/v biases and no such key; Llama says false
            bias = conf.get("model_type") != "llama"
        return cls(
            vocab_size=size("vocab_size"),
            hidden_size=size("hidden_size"),
            intermediate_size=size("intermediate_size"),
            num_hidden_layers=size("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=size("num_key_value_heads", heads),
            tie_word_embeddings=bool(conf.get("tie_word_embeddings", False)),
            head_dim=size("head_dim") if head_dim is not None else None,
            attention_bias=bool(bias),
        )

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.dim_per_head

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.dim_per_head

    @property
    def layer_params(self) -> int:
        """One decoder layer's parameters."""
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        return attn + 3 * h * self.intermediate_size + 2 * h

    @property
    def root_params(self) -> int:
        """Outside the layers: embeddings, final norm, untied ``lm_head``."""
        emb = self.vocab_size * self.hidden_size
        return emb * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @property
    def params(self) -> int:
        return self.root_params + self.num_hidden_layers * self.layer_params


#: Qwen2.5 (the published ``config.json`` of each size; ``rlpacer.sim.plan.MODELS`` has the
#: same layers, KV heads and head_dim for its roofline)
QWEN25: dict[str, ModelShape] = {
    "qwen2.5-0.5b": ModelShape(151936, 896, 4864, 24, 14, 2, tie_word_embeddings=True),
    "qwen2.5-1.5b": ModelShape(151936, 1536, 8960, 28, 12, 2, tie_word_embeddings=True),
    "qwen2.5-3b": ModelShape(151936, 2048, 11008, 36, 16, 2, tie_word_embeddings=True),
    "qwen2.5-7b": ModelShape(152064, 3584, 18944, 28, 28, 4),
    "qwen2.5-14b": ModelShape(152064, 5120, 13824, 48, 40, 8),
    "qwen2.5-32b": ModelShape(152064, 5120, 27648, 64, 40, 8),
    "qwen2.5-72b": ModelShape(152064, 8192, 29568, 80, 64, 8),
}


@dataclass(frozen=True)
class LearnerLayout:
    """How the learner runs: ranks, precision, sharding, micro-batch, checkpointing, KL."""

    world: int = 1
    precision: Precision = Precision.BF16_MIXED
    sharded: bool = True
    micro_batch_tokens: int = 16384
    activation_checkpointing: bool = False
    kl: bool = False

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ConfigError("world", f"{self.world}: a learner has at least one rank")
        if self.micro_batch_tokens < 0:
            raise ConfigError("microBatchTokens", f"{self.micro_batch_tokens}: must be >= 0")


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes at the peak of a training step, by kind."""

    shape: ModelShape
    layout: LearnerLayout
    weights: int
    gradients: int
    optimizer: int
    reference: int
    activations: int
    logits: int
    overhead: int

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.reference
                + self.activations + self.logits + self.overhead)

    def parts(self) -> dict[str, int]:
        return {"weights": self.weights, "gradients": self.gradients,
                "optimizer": self.optimizer, "reference": self.reference,
                "activations": self.activations, "logits": self.logits,
                "overhead": self.overhead}

    def describe(self) -> str:
        """One line: the total, the breakdown and the layout it was computed for."""
        lay = self.layout
        parts = ", ".join(f"{k} {gib(v)}" for k, v in self.parts().items()
                          if v or k != "reference")
        p = self.shape.params
        size = f"{p / 1e9:.2f}B" if p >= 1e9 else f"{p / 1e6:.1f}M"
        how = (f"{size} parameters, {lay.world} rank"
               f"{'s' if lay.world != 1 else ''}"
               f" {'sharded (FSDP)' if lay.sharded else 'replicated'}, {lay.precision.value},"
               f" microBatchTokens {lay.micro_batch_tokens or '0 (unbounded: not counted)'},"
               " activationCheckpointing"
               f" {'on' if lay.activation_checkpointing else 'off'}, KL"
               f" {'on' if lay.kl else 'off'}")
        return f"{gib(self.total)} per rank ({parts}; {how})"


def gib(n: float) -> str:
    """Bytes in GiB (MiB under 1 GiB, bytes under 1 MiB), one decimal."""
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{int(n)} bytes"


def estimate(shape: ModelShape, layout: LearnerLayout) -> MemoryEstimate:
    """The per-rank bytes of ``shape`` trained as ``layout`` says (module docstring)."""
    p = shape.params
    w = layout.world if layout.sharded else 1
    mixed = layout.precision == Precision.BF16_MIXED
    compute = 2 if mixed else 4  # bytes of a gathered parameter, a gradient, an activation

    def shard(n: int) -> int:
        return math.ceil(n / w)

    unit = max(shape.root_params, shape.layer_params)
    if layout.sharded and layout.world > 1:
        in_flight = compute * (shape.root_params + 2 * shape.layer_params)
        grad_in_flight = compute * unit
    else:
        in_flight = 2 * p if mixed else 0  # autocast's bfloat16 copies
        grad_in_flight = 0
    weights = 4 * shard(p) + in_flight
    gradients = 4 * shard(p) + grad_in_flight
    optimizer = 8 * shard(p)
    reference = compute * shard(p) if layout.kl else 0

    t, h, i = layout.micro_batch_tokens, shape.hidden_size, shape.intermediate_size
    per_layer = (compute * (5 * h + 3 * shape.q_dim + 3 * shape.kv_dim + 4 * i)
                 + 2 * 4 * h)  # bytes per token
    layers = shape.num_hidden_layers
    if layout.activation_checkpointing:
        activations = t * (layers * compute * h + per_layer)
    else:
        activations = t * layers * per_layer
    logits = t * shape.vocab_size * 4 * LOGITS_COPIES
    return MemoryEstimate(shape=shape, layout=layout, weights=weights, gradients=gradients,
                          optimizer=optimizer, reference=reference, activations=activations,
                          logits=logits, overhead=OVERHEAD_BYTES[layout.precision])
