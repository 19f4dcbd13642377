"""Time to accuracy: the analysis behind ``rlpacer bench-train`` (pure: no torch, no I/O).

A *curve* is one arm's run for one seed: evaluation points ``(train_s, step, accuracy)`` in
order, the first at step 0 (the warm start), ``train_s`` the training wall clock up to that
point with the evaluations themselves left out (an evaluation costs no arm anything).

Definitions (docs/benchmarks.md, "Time to accuracy"):

* **target**: the baseline arm's (fixed G=16, no tail batching) final accuracy, per seed;
  with ``target_evals`` K > 1, the mean of its last K evaluations (its level where it has
  levelled off, steadier than one evaluation of a curve that peaked and drifted); with
  ``gain_fraction`` F < 1, the warm start plus F of the gain to that (a target below the
  plateau, as time-to-quality benchmarks set theirs: where every arm levels off at about the
  baseline's accuracy, the first crossing of the plateau itself is decided by noise).
* **time to target** of an arm: the training wall clock at which its accuracy first reaches
  the target, linearly interpolated between the two evaluations around the crossing (the
  baseline's own time is its first crossing too, at or before its end). ``None``: never
  reached within the run.
* **accuracy at the baseline's wall clock**: the accuracy of the last evaluation at or before
  the baseline's total training wall clock (the model one would hold if the arm stopped then),
  reported against the baseline's level (its final accuracy, or the mean of its last
  ``target_evals`` evaluations), whatever ``gain_fraction`` sets the target to.
* Across seeds, ratios are paired per seed and summarised by their geometric mean with a 95%
  Student-t interval on the log ratios; accuracy deltas by their mean with a 95% t interval.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Point",
    "accuracy_at",
    "interval",
    "log_ratio_interval",
    "seconds_per_informative_group",
    "summarize",
    "target_of",
    "time_to",
]

# Two-sided 95% Student-t quantiles t(0.975, df) for df = 1..30 (no scipy in the image).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


@dataclass(frozen=True)
class Point:
    train_s: float
    step: int
    accuracy: float


def _points(curve: Sequence[Point | Mapping[str, Any]]) -> list[Point]:
    out = [p if isinstance(p, Point) else Point(float(p["train_s"]), int(p["step"]),
                                                 float(p["accuracy"])) for p in curve]
    if not out:
        raise ValueError("a curve needs at least one evaluation (the warm start's)")
    if any(b.train_s < a.train_s for a, b in itertools.pairwise(out)):
        raise ValueError("a curve's training wall clock must not decrease")
    return out


def time_to(curve: Sequence[Point | Mapping[str, Any]], target: float) -> float | None:
    """Training seconds at which ``curve`` first reaches ``target`` (interpolated)."""
    pts = _points(curve)
    if pts[0].accuracy >= target:
        return pts[0].train_s
    for a, b in itertools.pairwise(pts):
        if b.accuracy >= target:
            frac = (target - a.accuracy) / (b.accuracy - a.accuracy)
            return a.train_s + frac * (b.train_s - a.train_s)
    return None


def accuracy_at(curve: Sequence[Point | Mapping[str, Any]], seconds: float) -> float:
    """Accuracy of the last evaluation at or before ``seconds`` of training."""
    pts = _points(curve)
    acc = pts[0].accuracy
    for p in pts:
        if p.train_s <= seconds + 1e-9:
            acc = p.accuracy
        else:
            break
    return acc


def interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its 95% Student-t interval (low = high = mean for one
    value: no spread to estimate)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = math.fsum(values) / n
    if n == 1:
        return mean, mean, mean
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = _T975[min(n - 1, len(_T975)) - 1] * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def log_ratio_interval(ratios: Sequence[float]) -> tuple[float, float, float]:
    """(geometric mean, low, high) of positive ratios: a t interval on their logarithms."""
    if any(r <= 0 for r in ratios):
        raise ValueError(f"ratios must be positive, got {list(ratios)}")
    m, lo, hi = interval([math.log(r) for r in ratios])
    return math.exp(m), math.exp(lo), math.exp(hi)


def seconds_per_informative_group(records: Sequence[Mapping[str, Any]]
                                  ) -> dict[str, dict[str, float | None]]:
    """Per round kind (Short, Long): rollout seconds, informative groups (kept groups whose
    rewards are not all equal: the ones that train) and rollout seconds per informative group
    (``None`` when the kind produced none). Records without ``informative_groups`` (written
    before the field existed) are skipped."""
    out: dict[str, dict[str, float | None]] = {}
    for kind in ("Short", "Long"):
        recs = [r for r in records if r.get("round_kind") == kind
                and r.get("informative_groups") is not None]
        secs = math.fsum(float(r["seconds_rollout"]) for r in recs)
        groups = sum(int(r["informative_groups"]) for r in recs)
        out[kind] = {"rounds": float(len(recs)), "rollout_s": secs,
                     "informative_groups": float(groups),
                     "rollout_s_per_informative_group": secs / groups if groups else None}
    return out


def target_of(curve: Sequence[Point | Mapping[str, Any]], target_evals: int = 1,
              gain_fraction: float = 1.0) -> float:
    """The target a baseline ``curve`` sets: its level, the mean of its last ``target_evals``
    evaluations (the warm start counts only where there is no other; 1: its final accuracy),
    or with ``gain_fraction`` F < 1 the warm start plus F of its gain to that level (a target
    on the rise of the curve, not on its plateau, where a first crossing is a coin toss). The
    curve reaches it: its highest evaluation of those is at or above their mean."""
    if target_evals < 1:
        raise ValueError(f"target_evals must be >= 1 (got {target_evals}): 1 is the baseline's"
                         " final accuracy, K the mean of its last K evaluations")
    if not 0.0 < gain_fraction <= 1.0:
        raise ValueError(f"gain_fraction must be in (0, 1] (got {gain_fraction}): 1 is the"
                         " baseline's level itself, 0.9 the warm start plus 90% of its gain")
    pts = _points(curve)
    if not pts:
        raise ValueError("the baseline's curve has no evaluation")
    tail = pts[1:][-target_evals:] or pts[-1:]
    # the mean can exceed the highest by a rounding ulp: the curve must reach its own target
    level = min(math.fsum(p.accuracy for p in tail) / len(tail), max(p.accuracy for p in tail))
    if gain_fraction == 1.0 or level <= pts[0].accuracy:
        return level
    return min(level, pts[0].accuracy + gain_fraction * (level - pts[0].accuracy))


def summarize(curves: Mapping[str, Mapping[int, Sequence[Point | Mapping[str, Any]]]],
              baseline: str, target_evals: int = 1,
              gain_fraction: float = 1.0) -> dict[str, Any]:
    """Per arm and seed: time to the baseline's target (:func:`target_of`: its final accuracy,
    the mean of its last ``target_evals`` evaluations, ``gain_fraction`` of its gain to that)
    and accuracy at the baseline's wall
    clock; per arm across seeds (paired by seed): their ratio and delta to the target, with
    intervals. ``curves[arm][seed]`` is a curve; every arm needs the baseline's seeds."""
    if baseline not in curves:
        raise ValueError(f"the baseline arm {baseline!r} has no curves")
    base = {s: _points(c) for s, c in curves[baseline].items()}
    targets = {s: target_of(c, target_evals, gain_fraction) for s, c in base.items()}
    # accuracy at the baseline's wall clock is judged against its level (its final accuracy,
    # or the mean of its last evaluations), not against a target set below it
    levels = {s: target_of(c, target_evals) for s, c in base.items()}
    out: dict[str, Any] = {
        "baseline": baseline, "target_evals": target_evals, "gain_fraction": gain_fraction,
        "arms": {},
        # the baseline's gain over the warm start, per seed: at 0 its target is the warm
        # start's accuracy, which every arm "reaches" at 0 s (nothing to compare)
        "baseline_gain": {str(s): c[-1].accuracy - c[0].accuracy for s, c in sorted(base.items())},
    }
    for arm, by_seed in curves.items():
        rows: dict[int, dict[str, Any]] = {}
        for seed, curve in by_seed.items():
            if seed not in base:
                raise ValueError(f"arm {arm!r} has seed {seed}, the baseline has none")
            pts = _points(curve)
            b = base[seed]
            target = targets[seed]
            b_time = time_to(b, target)
            assert b_time is not None  # a curve reaches its own target (target_of)
            t = time_to(pts, target)
            acc_at = accuracy_at(pts, b[-1].train_s)
            rows[seed] = {
                "target": target, "seconds_to_target": t,
                "baseline_seconds_to_target": b_time,
                "ratio_to_baseline": (t / b_time if t is not None and b_time > 0 else None),
                "accuracy_at_baseline_wall": acc_at,
                "baseline_level": levels[seed],
                "delta_at_baseline_wall": acc_at - levels[seed],
                "final_accuracy": pts[-1].accuracy, "train_s": pts[-1].train_s,
                "start_accuracy": pts[0].accuracy,
            }
        ratios = [r["ratio_to_baseline"] for r in rows.values()]
        reached = [x for x in ratios if x is not None]
        deltas = [r["delta_at_baseline_wall"] for r in rows.values()]
        summary: dict[str, Any] = {
            "per_seed": {str(k): v for k, v in sorted(rows.items())},
            "reached_target": f"{len(reached)}/{len(ratios)}",
            "delta_at_baseline_wall": dict(zip(("mean", "low", "high"), interval(deltas),
                                               strict=True)),
            "train_s_mean": math.fsum(r["train_s"] for r in rows.values()) / len(rows),
            "final_accuracy_mean": math.fsum(r["final_accuracy"] for r in rows.values())
            / len(rows),
        }
        if reached and len(reached) == len(ratios) and all(x > 0 for x in reached):
            summary["ratio_to_baseline"] = dict(zip(("geomean", "low", "high"),
                                                    log_ratio_interval(reached), strict=True))
        else:
            summary["ratio_to_baseline"] = None  # some seed never reached the target
        out["arms"][arm] = summary
    return out
