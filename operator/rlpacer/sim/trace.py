"""Trace replay: the bench's response lengths from a recorded trace (``rlpacer bench --trace``).

The trace's prompt groups are the dataset (one prompt per group, in the planner's shuffled
order, as many epochs as the run needs); everything else (the cluster, decode speed, the
non-rollout step costs, the controllers' settings) comes from the scenario, as in a
parametric run. Response ``j`` of a prompt's launches in an epoch (the bench counts a prompt's
draws across its short and long rounds, as for a parametric workload):

* epoch 0, ``j`` below the recorded group size: the recorded length ``j`` itself, so a run
  at the recorded G replays the recorded groups exactly, and a smaller G takes the first G
  of them (a group's responses are exchangeable: sampled independently from one prompt);
* otherwise (more responses than were recorded, e.g. G=16 from groups of 8, the extra
  responses of an over-provisioned short round, a deferred prompt's long round, and every
  later epoch): a **smoothed bootstrap** of the prompt's own recorded lengths, in log space,
  variance-preserving (Silverman): ``y = m + (y_k - m + h z) / sqrt(1 + h^2 / s^2)`` with
  ``y_k`` the log of a recorded length drawn uniformly, ``m`` and ``s`` the mean and standard
  deviation of the group's log lengths, ``h = 1.06 s n^(-1/5)`` and ``z`` standard normal,
  clipped to [1, the longest recorded length] (or the recorded job's cap). It keeps the
  prompt's level and spread (a prompt that ran long runs long again) and, unlike a plain
  bootstrap, lets the longest of 16 draws exceed the longest of 8 recorded; it cannot invent a
  tail heavier than the group showed.

The draws are fixed by the seed per (epoch, prompt) before any policy runs (common random
numbers: every policy sees the same responses). Prompt length: the trace's median prompt
tokens (the simulator has one prompt length). The length drift over training that the
parametric workload models is whatever the trace recorded (its steps are shuffled together).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from rlpacer.api.trace import Trace, TraceError, read_trace
from rlpacer.control.length_prior import QUANTILES, LengthPrior
from rlpacer.sim.workload import Scenario

_POOL = 64  # draws per (epoch, prompt): more than any policy launches per prompt


def load_trace(path: str | Path) -> Trace:
    """Reads a trace file (a recorded rlpacer trace or a veRL trace); errors name the line."""
    p = Path(path)
    try:
        with p.open(encoding="utf-8") as fh:
            return read_trace(fh, str(p))
    except OSError as err:
        raise TraceError(f"{p}: cannot read the trace: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{p}: not a UTF-8 text file (a trace is JSON lines)") from None


class TraceWorkload:
    """Response lengths replayed from a trace (module docstring)."""

    def __init__(self, trace: Trace, epochs: int, seed: int) -> None:
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        self.trace = trace
        self.num_prompts = len(trace.groups)
        self.epochs = epochs
        longest = max(max(g.lengths) for g in trace.groups if g.lengths)
        self.cap = trace.max_tokens or longest
        n = self.num_prompts
        width = max(len(g.lengths) for g in trace.groups)
        rec = np.zeros((n, width), dtype=np.int64)  # recorded lengths (0: none)
        size = np.zeros(n, dtype=np.int64)
        for i, g in enumerate(trace.groups):
            rec[i, : len(g.lengths)] = g.lengths
            size[i] = len(g.lengths)
        self.recorded, self.size = rec, size
        # Per-prompt smoothed-bootstrap parameters (log space); a group with no length (all
        # censored) borrows the population's, a group of one keeps its length (s = 0).
        logs = [np.log(np.asarray(g.lengths, dtype=np.float64)) for g in trace.groups]
        every = np.concatenate([x for x in logs if x.size]) if any(x.size for x in logs) else None
        if every is None:
            raise TraceError(f"{trace.name}: no recorded length to replay")
        self.m = np.array([x.mean() if x.size else every.mean() for x in logs])
        self.s = np.array([x.std() if x.size > 1 else 0.0 for x in logs])
        self.pool = np.zeros((epochs, n, _POOL), dtype=np.int64)
        rng = np.random.Generator(np.random.PCG64([seed, 0x7ACE]))
        for i, x in enumerate(logs):
            src = x if x.size else every
            s = float(self.s[i])
            h = 1.06 * s * len(src) ** -0.2 if s > 0 else 0.0
            k = rng.integers(0, len(src), size=(epochs, _POOL))
            z = rng.standard_normal(size=(epochs, _POOL))
            shrink = 1.0 / math.sqrt(1.0 + (h * h) / (s * s)) if s > 0 else 1.0
            y = self.m[i] + (src[k] - self.m[i] + h * z) * shrink
            self.pool[:, i, :] = np.clip(np.rint(np.exp(y)), 1, self.cap)
            self.pool[0, i, : size[i]] = rec[i, : size[i]]  # epoch 0 replays what was recorded

    def lengths_many(
        self, prompts: list[int], firsts: list[int], count: int, progress: float, epoch: int = 0
    ) -> list[list[int]]:
        """Lengths of responses ``first .. first+count-1`` of each prompt in ``epoch``."""
        del progress  # a trace carries its own drift
        p = np.asarray(prompts, dtype=np.int64)[:, None]
        idx = (np.asarray(firsts, dtype=np.int64)[:, None] + np.arange(count)) % _POOL
        out: list[list[int]] = self.pool[epoch % self.epochs, p, idx].tolist()
        return out


def trace_scenario(base: Scenario, trace: Trace, steps: int) -> tuple[Scenario, int]:
    """The scenario of a replay and its epoch count: ``base``'s cluster and costs with the
    trace's prompt length and cap, enough epochs of the trace for ``steps`` baseline steps."""
    epochs = max(1, math.ceil(steps * base.prompts_per_step / len(trace.groups)))
    prompt_tokens = int(np.median([g.prompt_tokens for g in trace.groups]))
    longest = max(max(g.lengths) for g in trace.groups if g.lengths)
    lengths = np.concatenate([np.asarray(g.lengths) for g in trace.groups if g.lengths])
    scn = replace(
        base,
        name=f"trace:{Path(trace.name).name}",
        description=f"{trace.kind} trace {trace.name}: {len(trace.groups)} prompt groups x"
        f" {epochs} epochs on scenario {base.name}'s cluster and costs",
        prompt_len=max(1, prompt_tokens),
        median_tokens=float(np.median(lengths)),
        drift=0.0,
        cap=int(trace.max_tokens or longest),
        steps=steps,
    )
    return scn, epochs


def split_half_calibration(trace: Trace) -> dict[str, object]:
    """How well a prompt's own responses predict its others, on the recorded groups alone:
    the length prior sees each group's first half, then is checked on its second half (the
    "seen" row and the level skill), so nothing comes from the replay's resampling. An upper
    bound for a prior across epochs, where the policy also changes between a prompt's visits."""
    prior = LengthPrior(len(trace.groups))
    for i, g in enumerate(trace.groups):
        half = len(g.lengths) // 2
        if half:
            prior.observe(i, g.lengths[:half])
    for i, g in enumerate(trace.groups):
        half = len(g.lengths) // 2
        if half:
            prior.observe(i, g.lengths[half:])
    return prior.calibration()


def recorded_order_calibration(trace: Trace, half_life: float | None = None) -> dict[str, Any]:
    """The length prior as the recorded job learned it: each trained group, in the order the
    job trained them (epoch, step), observed as the driver observes it (finished lengths, the
    rest censored), after its finished lengths are checked against the prediction made
    without it. With ``half_life`` the prior forgets (rlpacer.control.length_prior), so the
    same trace says what forgetting would have predicted. The prior's calibration, and per
    epoch the coverage of prompts seen before (finished responses only). Recorded rlpacer
    traces only: a veRL trace has no prompt ids or order."""
    if trace.kind != "rlpacer":
        raise TraceError(f"{trace.name}: a {trace.kind} trace has no prompt ids or training"
                         " order (record one with rlpacer run or a cluster job)")
    ids = [g.prompt for g in trace.groups]
    prompts = int(trace.meta.get("prompts") or 0)
    prompts = max([prompts, *(int(p) + 1 for p in ids if p is not None)])
    prior = LengthPrior(prompts, half_life=half_life)
    # per epoch: responses at or below the predicted p10, p50, p90, and responses judged
    by_epoch: dict[int, list[int]] = {}
    for g in trace.groups:
        assert g.prompt is not None and g.epoch is not None  # rlpacer traces carry both
        if g.lengths and prior.groups and prior.predict(g.prompt).seen:
            row = by_epoch.setdefault(g.epoch, [0, 0, 0, 0])
            qs = [prior.quantile(g.prompt, q) for q in QUANTILES]
            for i, qv in enumerate(qs):
                row[i] += sum(x <= qv for x in g.lengths)
            row[3] += len(g.lengths)
        if g.lengths:
            prior.observe(g.prompt, g.lengths, censored=g.censored)
    return {
        "half_life": half_life,
        "calibration": prior.calibration(),
        "seen_by_epoch": {
            str(ep): {"responses": n, **{f"below_p{int(q * 100)}": b / n
                                         for q, b in zip(QUANTILES, row[:3], strict=True)}}
            for ep, (*row, n) in sorted(by_epoch.items()) if n},
    }
