"""``rlpacer run`` refuses a learner that does not fit before any engine starts: with
``RLPACER_LEARNER_MEMORY_BYTES`` (the testing setting: the bytes one learner rank has) set
tiny, it exits with ``EXIT_LEARNER_DOES_NOT_FIT`` and one error line with the numbers and the
fixes, no traceback, in seconds (no Ray, no vLLM)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlpacer_trainer import contract as c

pytestmark = [pytest.mark.e2e]
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_rlpacer_run_refuses_a_learner_that_does_not_fit(tmp_path: Path) -> None:
    env = {**os.environ, "RLPACER_LEARNER_MEMORY_BYTES": "1000000", "PYTHONUNBUFFERED": "1"}
    env.pop(c.ENV_RAY_ADDRESS, None)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(BIN / "rlpacer"), "run", str(ROOT / "examples" / "tiny-local.yaml"), "--steps",
         "1", "--no-eval", "--out", str(tmp_path / "run")],
        env=env, capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == c.EXIT_LEARNER_DOES_NOT_FIT, out
    assert "Traceback" not in out
    line = next(ln for ln in out.splitlines() if ln.startswith("error: "))
    assert line.startswith("error: learner does not fit: ")
    assert "exceeds 1000000 bytes per rank (RLPACER_LEARNER_MEMORY_BYTES)" in line
    assert "spec.trainer.microBatchTokens" in line and "activationCheckpointing" in line
    assert "starting Ray" not in out and not (tmp_path / "run").exists()  # nothing started
    assert took < 120, f"took {took:.0f} s"
