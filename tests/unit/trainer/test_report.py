"""``rlpacer run``'s report: the straggler SLO's verdict with the measured rate per G."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlpacer.api.protocol import RoundKind
from rlpacer.control.plan import JobController, JobControllerConfig, LengthStats, StepReportData
from rlpacer.control.sagc import SAGCConfig
from rlpacer_trainer import report

pytestmark = pytest.mark.unit


def records_and_verdict(ratio_short: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """30 steps through the real controller, every third a long round (ratio 9)."""
    jc = JobController(JobControllerConfig(sagc=SAGCConfig(tau=4.0, delta=0.25, dual_step=1.0)))
    records, prev = [], None
    for i in range(30):
        p = jc.plan()
        kind = RoundKind.LONG if i % 3 == 2 else RoundKind.SHORT
        ratio = 9.0 if kind is RoundKind.LONG else ratio_short
        cp = jc.observe(StepReportData(
            attempt=0, step=i, group_size=p.group_size, round_kind=kind,
            lengths=LengthStats(max=20.0 * ratio, median=20.0, p90=20.0 * ratio, count=8),
            next_round_kind=RoundKind.LONG if i % 3 == 1 else RoundKind.SHORT))
        prev = jc.slo_verdict(prev).state
        records.append({"step": i, "round_kind": kind.value, "group_size": p.group_size,
                        "straggler": cp.straggler, "straggler_rate": cp.straggler_rate,
                        "reward": 0.5, "len_max": 20.0 * ratio, "len_median": 20.0,
                        "lambda": cp.lambda_, "seconds_rollout": 1.0, "seconds_train": 1.0})
    return records, jc.slo_verdict(prev).to_dict()


def test_the_report_says_when_the_slo_is_infeasible_with_the_rate_per_g(tmp_path: Path) -> None:
    records, verdict = records_and_verdict(8.0)
    assert verdict["state"] == "Infeasible"
    md = report.write_report(tmp_path, records, {"straggler_slo": verdict}).read_text()
    assert "## Straggler SLO" in md
    assert ("targetStragglerRate 0.25 at stragglerRatio 4 (SAGC): **NOT MET: infeasible at"
            " this stragglerRatio**") in md
    assert "short rounds (the SLO's): 20 of 20 straggled (rate 1.00)" in md
    assert "long rounds (stragglers by design, not in the SLO): 10 of 10 straggled" in md
    for e in verdict["per_size"]:
        rate = "-" if e["rate"] is None else f"{e['rate']:.2f}"
        assert f"| {e['group_size']} | {e['observations']} | {e['stragglers']} | {rate} |" in md
    assert "no candidate G can meet targetStragglerRate 0.25" in md
    assert "straggler_slo:" not in md  # a section, not a dict dumped on one line
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["straggler_slo"]["state"] == "Infeasible"
    assert (summary["short_round_straggler_steps"], summary["long_round_straggler_steps"]) == (
        20, 10)


def test_the_report_says_met_when_short_rounds_keep_the_target(tmp_path: Path) -> None:
    records, verdict = records_and_verdict(1.5)
    md = report.write_report(tmp_path, records, {"straggler_slo": verdict}).read_text()
    assert "(SAGC): **met**" in md and "0 of 20 straggled (rate 0.00)" in md
    assert "NOT MET" not in md
    # without a verdict (e.g. a remote controller) there is no section
    md = report.write_report(tmp_path, records, {}).read_text()
    assert "Straggler SLO" not in md


def test_the_plot_has_a_label_for_every_panel_and_the_summary_counts_long_rounds(
        tmp_path: Path) -> None:
    """No empty legend (matplotlib warns "No artists with labels found" and draws none); the
    summary splits rollout seconds and informative groups by round kind and counts retired
    long-round prompts."""
    import warnings

    records, verdict = records_and_verdict(1.5)
    for i, r in enumerate(records):
        r["informative_groups"] = 0 if r["round_kind"] == "Long" else 3
        r["retired_total"] = i // 10 * 4
        if r["round_kind"] == "Long":
            r["fill_prompts"], r["fill_kept"] = 4, 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report.write_report(tmp_path, records, {"straggler_slo": verdict})
    assert (tmp_path / "report.png").stat().st_size > 10_000
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["long_round_rollout_seconds"] == 10.0 and summary["rollout_seconds"] == 30.0
    assert (summary["informative_groups_short"], summary["informative_groups_long"]) == (60, 0)
    assert summary["retired_long_round_prompts"] == 8
    n_long = sum(r["round_kind"] == "Long" for r in records)
    assert n_long and summary["long_round_fill_prompts"] == 4 * n_long
    assert summary["long_round_fill_kept"] == 3 * n_long


@pytest.mark.parametrize(("end", "n", "words"), [
    (0.70, 4096, "ended 10.0 points above it."),
    (0.50, 4096, "ended 10.0 points below it: not the same model sooner"),
    # two standard errors of the difference on 256 prompts: 8.7 points
    (0.58, 256, "ended 2.0 points below it, within the held-out set's noise (8.7 points: two"
     " standard errors on 256 prompts): one seed cannot tell"),
])
def test_the_report_compares_the_run_with_its_baseline(tmp_path: Path, end: float, n: int,
                                                       words: str) -> None:
    records, verdict = records_and_verdict(1.5)
    extra = {"straggler_slo": verdict, "wall_seconds": 50.0, "eval_accuracy_start": 0.5,
             "eval_prompts": n,
             "eval_accuracy_end": end, "run_engine_tokens": 1000,
             "baseline": {"group_size": 16, "tail_batching": False, "steps": 30,
                          "wall_seconds": 100.0, "eval_accuracy_start": 0.5,
                          "eval_accuracy_end": 0.6, "engine_tokens": 3000,
                          "rollout_seconds": 80.0, "train_seconds": 20.0}}
    md = report.write_report(tmp_path, records, extra).read_text()
    assert "## Against the baseline (fixed G=16, no tail batching)" in md
    assert "| baseline (G=16) | 100.0 s | 80.0 | 20.0 | 3000 | 50.0% -> 60.0% |" in md
    assert f"| 1000 | 50.0% -> {100 * end:.1f}% |" in md
    assert f"This run trained in **0.50x** the baseline's wall clock and {words}" in md
    assert "- baseline:" not in md  # a section, not a dict on one line


def test_the_summary_says_how_much_stream_training_streamed(tmp_path: Path) -> None:
    """Only a run that streamed has the keys; they sum its streamed steps' records."""
    records, _ = records_and_verdict(1.5)
    report.write_report(tmp_path, records, {})
    assert "streamed_samples" not in json.loads((tmp_path / "summary.json").read_text())
    for i, r in enumerate(records):
        r.update(stream_training=i % 2 == 0, learner_samples=64, learner_streamed=64 if i % 2
                 == 0 else 0, streamed_in_rollout=40 if i % 2 == 0 else 0,
                 seconds_train_streamed=0.5 if i % 2 == 0 else 0.0)
    report.write_report(tmp_path, records, {})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["stream_training_steps"], summary["streamed_samples"],
            summary["trained_samples"], summary["streamed_in_rollout"]) == (15, 960, 960, 600)
    assert summary["train_seconds_streamed"] == pytest.approx(7.5)
    assert "- streamed_in_rollout: 600" in (tmp_path / "report.md").read_text()
