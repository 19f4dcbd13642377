"""``rlpacer bench-train`` as users run it: two arms from one warm start on real vLLM and a
Ray learner, a held-out evaluation every step timed apart from training, and the
time-to-accuracy summary computed from the curves it recorded. With ``--equal-wall-clock``
the other arm trains on to the baseline's training wall clock."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlpacer_trainer import contract as c
from rlpacer_trainer import tta

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_bench_train_records_accuracy_against_training_wall_clock(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != c.ENV_RAY_ADDRESS}
    out = tmp_path / "bench"
    proc = subprocess.run(
        [str(BIN / "rlpacer"), "bench-train", "examples/tiny-local.yaml", "--arms", "fixed16",
         "sagc_tb", "--seeds", "0", "--steps", "3", "--eval-every", "1", "--eval-prompts", "48",
         "--equal-wall-clock", "--out", str(out)],
        cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["arm"]: r for r in map(json.loads, (out / "bench-train.jsonl").read_text()
                                     .splitlines())}
    assert set(rows) == {"fixed16", "sagc_tb"}
    base_wall = rows["fixed16"]["train_s"]
    for arm, row in rows.items():
        curve = row["curve"]
        steps = [p["step"] for p in curve]
        if arm == "fixed16":
            assert steps == [0, 1, 2, 3] and row["stopped_at"] == "steps"
        else:  # on to the baseline's wall clock: stopped at the first evaluation past it
            assert steps == list(range(len(curve))) and steps[-1] <= 4 * 3
            if row["stopped_at"] == "steps":
                # the cap (four times the baseline's steps) came first: in a CI run beside
                # the side process sagc_tb's twelve steps took 52 s, less than fixed16's three
                assert steps[-1] == 4 * 3 and curve[-1]["train_s"] < base_wall, row
            else:
                assert row["stopped_at"] == "wall_clock", row
                assert curve[-2]["train_s"] < base_wall <= curve[-1]["train_s"]
        # one warm start for every arm; the clock only moves while training
        assert curve[0] == {"train_s": 0.0, "step": 0, "accuracy": rows["fixed16"]["curve"][0]
                            ["accuracy"]}
        assert all(b["train_s"] > a["train_s"] for a, b in itertools.pairwise(curve))
        # the training clock holds the steps' rollout and learner time, not the evaluations
        assert row["train_s"] >= row["rollout_s"] + row["train_step_s"]
        assert row["eval_s"] > 0 and row["train_s"] == pytest.approx(curve[-1]["train_s"])
        assert row["per_round_kind"]["Short"]["rounds"] >= 1
    assert rows["fixed16"]["group_sizes"] == [16] and rows["fixed16"]["long_rounds"] == 0
    # SAGC starts at the example's initial G (8). Whether that buys it more steps in the
    # baseline's wall clock depends on the machine's load (in a CI run beside the side process
    # it moved to G=16 at step 2 and its three steps took 15.5 s against fixed16's 13.0 s), so
    # the steps are not asserted: the stop at the baseline's wall clock is, above
    assert min(rows["sagc_tb"]["group_sizes"]) < 16
    assert rows["sagc_tb"]["steps"] == len(rows["sagc_tb"]["curve"]) - 1
    res = json.loads((out / "bench-train.json").read_text())
    want = tta.summarize({a: {0: r["curve"]} for a, r in rows.items()}, "fixed16")
    assert res["arms"] == want["arms"] and res["eval_prompts"] == 48
    assert res["equal_wall_clock"] is True
    assert (out / "time-to-accuracy.png").stat().st_size > 10_000
    assert "time to accuracy against fixed16" in proc.stdout
