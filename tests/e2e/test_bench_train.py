"""``rlpacer bench-train`` as users run it: two arms from one warm start on real vLLM and a
Ray learner, a held-out evaluation every step timed apart from training, and the
time-to-accuracy summary computed from the curves it recorded. With ``--equal-wall-clock``
the other arm trains on to the baseline's training wall clock."""

from __future__ import annotations

import itertools
import json
import math
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
        # each step as it ran, in order: the sizes the arm chose and what each step cost
        by_step = row["by_step"]
        assert len(by_step) == row["steps"]
        assert sorted({s["g"] for s in by_step}) == row["group_sizes"]
        assert sum(s["kind"] == "Long" for s in by_step) == row["long_rounds"]
        assert math.fsum(s["rollout_s"] for s in by_step) == pytest.approx(
            row["rollout_s"], abs=0.01 * len(by_step))
        assert all(s["s"] >= s["rollout_s"] > 0 and 0 < s["med"] <= s["p90"] <= s["max"]
                   and 0 < s["mean"] <= s["max"] and s["n"] > 0 for s in by_step)
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


def test_the_trl_arm_trains_with_trl_and_is_scored_on_the_same_engines(tmp_path: Path) -> None:
    """``trl16`` beside ``fixed16`` on the word-problem example: TRL's GRPOTrainer trains the
    same warm start (every step moves the weights), and each evaluation scores the weights it
    holds at that step on the job's own vLLM engines (they report its fingerprint, or the arm
    fails), with the clock stopped."""
    import yaml

    from rlpacer_trainer import wordproblems

    doc = yaml.safe_load((ROOT / "examples" / "wordproblems-local.yaml").read_text())
    spec = doc["spec"]
    spec["model"]["source"] = str(ROOT / spec["model"]["source"])
    spec["data"]["source"] = str(wordproblems.write(tmp_path / "train.jsonl", 256, seed=0))
    spec["data"]["evalSource"] = str(wordproblems.write(tmp_path / "held.jsonl", 64, seed=99))
    spec["promptsPerStep"] = 8
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    env = {k: v for k, v in os.environ.items() if k != c.ENV_RAY_ADDRESS}
    out = tmp_path / "bench"
    proc = subprocess.run(
        [str(BIN / "rlpacer"), "bench-train", str(tmp_path / "job.yaml"), "--arms", "fixed16",
         "trl16", "--seeds", "0", "--steps", "2", "--eval-every", "1", "--out", str(out)],
        cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["arm"]: r for r in map(json.loads, (out / "bench-train.jsonl").read_text()
                                     .splitlines())}
    trl = rows["trl16"]
    assert trl["trainer"] == "trl 1.16.0" and trl["steps"] == 2
    curve = trl["curve"]
    assert [p["step"] for p in curve] == [0, 1, 2]
    # the same warm start as fixed16's, scored once for both
    assert curve[0] == rows["fixed16"]["curve"][0]
    # TRL moved the weights at every step, and the engines held each step's when scored
    policies = [trl["start_policy"]] + [p["policy"] for p in curve[1:]]
    assert len(set(policies)) == 3, policies
    assert all(b["train_s"] > a["train_s"] for a, b in itertools.pairwise(curve))
    assert trl["eval_s"] > 0 and trl["train_s"] == pytest.approx(curve[-1]["train_s"])
    # it generated its own responses (8 prompts x 16 a step) and trained on them
    assert trl["tokens"] >= 2 * 8 * 16 and 0 < trl["rollout_s"] < trl["train_s"]
    assert trl["group_sizes"] == [16] and trl["trained_samples"] == 2 * 8 * 16
    res = json.loads((out / "bench-train.json").read_text())
    assert set(res["arms"]) == {"fixed16", "trl16"}
    assert "trl16" in proc.stdout
