"""Metrics (JSONL) and the run report: plots of reward, max/median length, group size,
lambda, straggler events and long rounds, plus a short summary.

The summary counts straggler steps of short rounds (the straggler SLO's) and of long rounds
(stragglers by design) apart; with the controller's verdict (``extra["straggler_slo"]``, a
``StragglerSLOVerdict.to_dict()``) the report says whether the SLO was met, with the
measured rate per G (:func:`slo_lines`)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.f = path.open("a")

    def write(self, rec: dict[str, Any]) -> None:
        self.f.write(json.dumps(rec, sort_keys=True) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(records: Sequence[dict[str, Any]], out: Path, title: str = "rlpacer run") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    longs = [r["step"] for r in records if r["round_kind"] == "Long"]
    strag = [r["step"] for r in records if r.get("straggler")]
    fig, ax = plt.subplots(5, 1, figsize=(9, 13), sharex=True)
    ax[0].plot(steps, [r["reward"] for r in records], label="mean reward (kept responses)")
    ax[0].set_ylabel("reward")
    ax[1].plot(steps, [r["len_max"] for r in records], label="max")
    ax[1].plot(steps, [r["len_median"] for r in records], label="median")
    ax[1].set_ylabel("response tokens")
    ax[1].set_yscale("log")
    ax[2].step(steps, [r["group_size"] for r in records], where="post", label="group size G")
    ax[2].set_ylabel("group size G")
    ax[3].plot(steps, [r["lambda"] for r in records], label="lambda")
    ax[3].plot(steps, [r["straggler_rate"] for r in records],
               label="straggler rate (short rounds)")
    ax[3].scatter(strag, [0.0] * len(strag), marker="|", color="red", s=200,
                  label="straggler step")
    ax[3].set_ylabel("SAGC")
    ax[4].bar(steps, [r["seconds_rollout"] for r in records], label="rollout")
    ax[4].bar(steps, [r["seconds_train"] for r in records],
              bottom=[r["seconds_rollout"] for r in records], label="train")
    ax[4].set_ylabel("seconds")
    ax[4].set_xlabel("step")
    for a in ax:
        for s in longs:
            a.axvspan(s - 0.5, s + 0.5, color="orange", alpha=0.2, lw=0)
        a.legend(loc="best", fontsize=8)
    ax[0].set_title(f"{title}  (shaded: long rounds)")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def summarize(records: Sequence[dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
    n = len(records)
    last = records[-1] if records else {}
    return {
        "steps": n,
        "long_rounds": sum(r["round_kind"] == "Long" for r in records),
        "straggler_steps": sum(bool(r.get("straggler")) for r in records),
        "short_round_straggler_steps": sum(
            bool(r.get("straggler")) for r in records if r["round_kind"] != "Long"),
        "long_round_straggler_steps": sum(
            bool(r.get("straggler")) for r in records if r["round_kind"] == "Long"),
        "mean_reward_first5": sum(r["reward"] for r in records[:5]) / max(1, min(5, n)),
        "mean_reward_last5": sum(r["reward"] for r in records[-5:]) / max(1, min(5, n)),
        "group_sizes": sorted({r["group_size"] for r in records}),
        "engine_tokens": last.get("engine_tokens", 0),
        "rollout_seconds": sum(r["seconds_rollout"] for r in records),
        "long_round_rollout_seconds": sum(
            r["seconds_rollout"] for r in records if r["round_kind"] == "Long"),
        # groups that train (rewards not all equal) per round kind, and the long rounds'
        # prompts retired for not paying (tailBatching.longRound.minYieldRatio)
        "informative_groups_short": sum(
            r.get("informative_groups", 0) for r in records if r["round_kind"] != "Long"),
        "informative_groups_long": sum(
            r.get("informative_groups", 0) for r in records if r["round_kind"] == "Long"),
        "retired_long_round_prompts": last.get("retired_total", 0),
        # tailBatching.longRound.fillPrompts: fresh prompts the long rounds launched, and
        # those trained in them (the rest were queued)
        "long_round_fill_prompts": sum(r.get("fill_prompts", 0) for r in records),
        "long_round_fill_kept": sum(r.get("fill_kept", 0) for r in records),
        "train_seconds": sum(r["seconds_train"] for r in records),
        **_stream_summary(records),
        **extra,
    }


def _stream_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """trainer.streamTraining's share (nothing when no step streamed): the samples whose
    passes ran before the step's finish, those handed over while a round still generated, and
    the learner's seconds on them (``train_seconds`` is then what followed the rollouts)."""
    streamed = [r for r in records if r.get("stream_training")]
    if not streamed:
        return {}
    return {
        "stream_training_steps": len(streamed),
        "streamed_samples": int(sum(r.get("learner_streamed", 0) for r in streamed)),
        "trained_samples": int(sum(r.get("learner_samples", 0) for r in streamed)),
        "streamed_in_rollout": int(sum(r.get("streamed_in_rollout", 0) for r in streamed)),
        "train_seconds_streamed": sum(r.get("seconds_train_streamed", 0.0) for r in streamed),
    }


def slo_lines(verdict: dict[str, Any]) -> list[str]:
    """The report's straggler-SLO section from a ``StragglerSLOVerdict.to_dict()``."""
    state = verdict["state"]
    word = {"Met": "met", "Exceeded": "NOT MET (exceeded)",
            "Infeasible": "NOT MET: infeasible at this stragglerRatio",
            "Unknown": "not judged (too few short rounds)"}.get(state, state)
    lines = ["## Straggler SLO", "",
             f"targetStragglerRate {verdict['target']:g} at stragglerRatio {verdict['tau']:g}"
             f" ({verdict['mode']}): **{word}**.", "",
             f"- short rounds (the SLO's): {verdict['short_stragglers']} of"
             f" {verdict['short_rounds']} straggled (rate {verdict['rate']:.2f})"]
    if verdict["long_rounds"]:
        lines.append(f"- long rounds (stragglers by design, not in the SLO):"
                     f" {verdict['long_stragglers']} of {verdict['long_rounds']} straggled")
    lines += ["", "| G | short rounds | stragglers | rate | P(p > target) |",
              "| --- | --- | --- | --- | --- |"]
    for e in verdict["per_size"]:
        rate = "-" if e["rate"] is None else f"{e['rate']:.2f}"
        lines.append(f"| {e['group_size']} | {e['observations']} | {e['stragglers']} | {rate}"
                     f" | {e['p_above_target']:.2f} |")
    lines += ["", verdict["message"]]
    return lines


def baseline_lines(summary: dict[str, Any]) -> list[str]:
    """The report's comparison with ``rlpacer run --baseline G``: the same steps, data, seed
    and warm start at a fixed G without tail batching (``summary["baseline"]``)."""
    b = summary["baseline"]
    run_s, base_s = float(summary["wall_seconds"]), float(b["wall_seconds"])
    acc0, acc1 = summary.get("eval_accuracy_start"), summary.get("eval_accuracy_end")
    bacc1 = b["eval_accuracy_end"]
    sizes = summary.get("group_sizes") or []
    g = f"G {sizes[0]}-{sizes[-1]}" if len(sizes) > 1 else (
        f"G={sizes[0]}" if sizes else "G ?")

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    lines = [f"## Against the baseline (fixed G={b['group_size']}, no tail batching)", "",
             "The same steps, data, seed and warm start; training wall clock is the steps'"
             " (held-out evaluations apart).", "",
             "| run | training wall clock | rollout s | learner s | engine tokens |"
             " held-out accuracy |", "| --- | --- | --- | --- | --- | --- |",
             f"| this run ({g}, long rounds: {summary.get('long_rounds', 0)}) | {run_s:.1f} s"
             f" | {summary.get('rollout_seconds', 0.0):.1f}"
             f" | {summary.get('train_seconds', 0.0):.1f}"
             f" | {summary.get('run_engine_tokens', '-')} | {pct(acc0)} -> {pct(acc1)} |",
             f"| baseline (G={b['group_size']}) | {base_s:.1f} s | {b['rollout_seconds']:.1f}"
             f" | {b['train_seconds']:.1f} | {b['engine_tokens']}"
             f" | {pct(b['eval_accuracy_start'])} -> {pct(bacc1)} |", ""]
    if acc1 is not None and base_s > 0:
        a, b1 = float(acc1), float(bacc1)
        delta = 100 * (a - b1)
        side = "above" if delta > 0 else "below" if delta < 0 else "level with"
        head = (f"This run trained in **{run_s / base_s:.2f}x** the baseline's wall clock and"
                f" ended {abs(delta):.1f} points {side} it")
        n = int(summary.get("eval_prompts") or 0)
        # two standard errors of the difference of two accuracies on n held-out prompts
        noise = 200 * math.sqrt((a * (1 - a) + b1 * (1 - b1)) / n) if n else 0.0
        if n and abs(delta) <= noise:
            lines.append(f"{head}, within the held-out set's noise ({noise:.1f} points: two"
                         f" standard errors on {n} prompts): one seed cannot tell the two"
                         " models apart (docs/benchmarks.md: seeds and time to accuracy).")
        elif delta >= 0:
            lines.append(f"{head}.")
        else:
            lines.append(f"{head}: not the same model sooner (docs/benchmarks.md: seeds and"
                         " time to accuracy).")
    return lines


def prior_lines(cal: dict[str, Any]) -> list[str]:
    """report.md's section on the per-prompt length prior: predicted against realised."""
    out = ["## Length prior (per prompt, learned from earlier epochs)", "",
           "Share of responses at or below the prior's predicted 10th / 50th / 90th percentile"
           " of their prompt's length (calibrated: 0.10 / 0.50 / 0.90):", ""]
    for kind, what in (("seen", "prompts seen before"), ("unseen", "prompts never seen")):
        row = cal.get(kind) or {}
        n = row.get("responses") or 0
        if n:
            out.append(f"- {what}: {row['below_p10']:.2f} / {row['below_p50']:.2f} /"
                       f" {row['below_p90']:.2f} ({n} responses)")
        else:
            out.append(f"- {what}: no response yet")
    skill = cal.get("level_skill")
    pop = cal.get("population") or {}
    out.append(f"- level skill (1 - error / variance of a group's mean log length, prompts seen"
               f" before): {'n/a' if skill is None else f'{skill:.2f}'}"
               f" over {cal.get('level_skill_groups', 0)} groups; the within-group share of the"
               f" length variance: {pop.get('within_share', float('nan')):.2f}")
    return out


def write_report(out_dir: Path, records: Sequence[dict[str, Any]], extra: dict[str, Any]) -> Path:
    summary = summarize(records, extra)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    png = plot(records, out_dir / "report.png") if records else None
    lines = ["# rlpacer run report", ""]
    lines += [f"- {k}: {v}" for k, v in summary.items()
              if k not in ("straggler_slo", "baseline", "length_prior")]
    if isinstance(summary.get("baseline"), dict) and "wall_seconds" in summary:
        lines += ["", *baseline_lines(summary)]
    if isinstance(summary.get("straggler_slo"), dict):
        lines += ["", *slo_lines(summary["straggler_slo"])]
    if isinstance(summary.get("length_prior"), dict):
        lines += ["", *prior_lines(summary["length_prior"])]
    if png is not None:
        lines += ["", f"![run]({png.name})"]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    return out_dir / "report.md"
