"""``rlpacer bench-accuracy`` as users run it, short: the shipped warm start is sometimes right
on unseen word problems, ``rlpacer run`` trains it from its path with the MathAnswer reward
for 48 steps (SAGC per second, as the example ships: mostly G=4) and held-out greedy accuracy
rises (by at least 3 points on 256 problems; measured: see docs/benchmarks.md, "RL on a
user's model"), and the checkpoint's Hugging Face directory,
which differs from the warm start, loads in vLLM and transformers and scores exactly what the
run scored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlpacer_trainer import contract as c

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 48


def test_bench_accuracy_trains_the_user_model_and_its_checkpoint_scores_the_same(
        tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop(c.ENV_RAY_ADDRESS, None)
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "rlpacer.cli", "bench-accuracy", "--seeds", "0",
         "--steps", str(STEPS),
         "--train-count", "1024", "--eval-count", "256", "--check-sample", "32",
         "--min-gain", "0.03", "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads((out / "bench-accuracy.json").read_text())
    (row,) = res["rows"]
    # the warm start (the shipped model, loaded through its path) is sometimes right: RL has
    # signal and room; an untrained model scores 0
    assert 0.15 <= row["start"] <= 0.7, row
    assert row["steps"] == STEPS and res["heldout"] == 256
    # RL taught it: the trained checkpoint answers more held-out problems than the warm start
    assert row["end"] >= row["start"] + 0.03 and res["met"], (row["start"], row["end"])
    assert row["engine_start_s"] > 0 and row["learner_start_s"] > 0 and row["first_step_s"] > 0
    metrics = [json.loads(x) for x in (out / "seed-0" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(0.0 < m["reward"] < 1.0 for m in metrics)  # groups with signal, scored by MathAnswer
    # the last checkpoint, as it is: vLLM scores the held-out set exactly as the run's engine
    # did at the end, and transformers' greedy answers are vLLM's
    assert row["checkpoint"] == f"seed-0/checkpoints/step-{STEPS:06d}/model"
    assert row["vllm_accuracy"] == row["end"] and row["checkpoint_scores_the_same"]
    assert row["transformers_same_answers"] == "32/32"
    ckpt = out / "seed-0" / "checkpoints" / f"step-{STEPS:06d}" / "model"
    assert (ckpt / "tokenizer.json").is_file()
    warm = ROOT / "trainer_image" / "rlpacer_trainer" / "assets" / "wordproblems-qwen2"
    assert (ckpt / "model.safetensors").read_bytes() != (warm / "model.safetensors").read_bytes()
    held = [json.loads(x) for x in (out / "data" / "heldout.jsonl").read_text().splitlines()]
    train = {json.loads(x)["question"] for x in
             (out / "data" / "train.jsonl").read_text().splitlines()}
    assert len(held) == 256 and not train & {h["question"] for h in held}
