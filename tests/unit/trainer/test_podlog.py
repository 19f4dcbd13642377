"""Progress lines into a pod's own log (rlpacer_trainer.podlog)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlpacer_trainer import podlog

pytestmark = pytest.mark.unit


def test_lines_go_to_the_named_file_only_in_a_pod(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "pod.log"
    monkeypatch.delenv(podlog.ENV_POD_LOG, raising=False)
    podlog.pod_log("outside a pod")  # nothing set: nothing written, no error
    assert not log.exists()
    monkeypatch.setenv(podlog.ENV_POD_LOG, str(log))
    podlog.pod_log("learner rank 0: update 1")
    podlog.pod_log("learner rank 0: update 2")
    lines = log.read_text().splitlines()
    assert [ln.split(" ", 2)[2] for ln in lines] == ["learner rank 0: update 1",
                                                      "learner rank 0: update 2"]
    monkeypatch.setenv(podlog.ENV_POD_LOG, str(tmp_path / "no" / "such" / "dir"))
    podlog.pod_log("lost, and no error")  # a log line never fails the work it describes


def test_a_child_process_writes_into_its_parents_stdout(tmp_path: Path) -> None:
    """What a pod's entrypoint sets (its own fd 1) reaches its log from a grandchild, as from
    a Ray worker under `ray start`."""
    out = tmp_path / "stdout"
    child = ("import os, subprocess, sys; from rlpacer_trainer import podlog; "
             "env = {**os.environ, podlog.ENV_POD_LOG: podlog.own_stdout()}; "
             "subprocess.run([sys.executable, '-c', 'from rlpacer_trainer.podlog import pod_log;"
             " pod_log(\"engine replica 1: generated 3 responses\")'], env=env, check=True)")
    with open(out, "w") as f:
        subprocess.run([sys.executable, "-c", child], stdout=f, check=True,
                       env={**os.environ})
    assert out.read_text().strip().endswith("engine replica 1: generated 3 responses")
