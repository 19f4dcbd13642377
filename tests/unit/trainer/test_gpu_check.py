"""The GPU check's learner part, dry-run on the CPU (bfloat16 autocast on the CPU): it must
keep working where it can be run, so that a GPU session only has to point it at CUDA."""

from __future__ import annotations

import json

import pytest

from rlpacer_trainer import gpu_check

pytestmark = pytest.mark.unit


def test_gpu_check_dry_run_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--device", "cpu", "--publish-params", "2e7",
                           "--sharded-params", "1e7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "GPU CHECK OK"
    checks = {d["check"]: d for d in map(json.loads, lines[:-1])}
    bf16 = checks["learner_bf16"]
    # autocast really ran in bfloat16 (the gradients differ from float32), and stayed close
    assert 0 < bf16["grad_max_rel_err"] < 0.2 and bf16["grad_min_cosine"] > 0.98
    assert checks["checkpoint"]["equal_after_next_update"] is True
    stream = checks["stream_training"]
    assert stream["rel_diff_to_update"] <= 2 * stream["bf16_vs_fp32_rel"] + 0.01
    assert len(stream["finish_s"]) == len(stream["whole_step_s"]) == 2
    pub = checks["weight_publish"]
    assert pub["bytes"] >= 2 * pub["params"]  # bfloat16: two bytes a parameter, plus names
    sharded = checks["sharded_learner"]
    # two gloo ranks: the sharded learner's loss is the unsharded one's, one model gathered
    assert sharded["world"] == 2 and sharded["fingerprints_equal"] is True
    assert abs(sharded["loss"] - sharded["loss_fp32_unsharded"]) < 1e-4
