"""``rlpacer fit``: the learner's memory per GPU; docs/learner-fit.md's table is its output."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from rlpacer.cli import main

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "learner-fit.md"
MODEL = ROOT / "trainer_image" / "rlpacer_trainer" / "assets" / "wordproblems-qwen2"


def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def test_the_docs_table_is_the_commands_output() -> None:
    text = DOC.read_text()
    command = re.search(r"^(rlpacer fit .*--table)$", text, re.M)
    assert command, "docs/learner-fit.md shows no `rlpacer fit ... --table` command"
    table = re.search(r"<!-- rlpacer fit table -->\n(.*?)\n<!-- end rlpacer fit table -->",
                      text, re.S)
    assert table, "docs/learner-fit.md has no generated table between its markers"
    code, out = _run(shlex.split(command.group(1))[1:])
    assert code == 0
    assert table.group(1).strip() == out.strip(), (
        "docs/learner-fit.md's table differs from the command's output: run the command and"
        " paste its output between the markers")


def test_the_table_says_what_fits() -> None:
    code, out = _run(["fit", "--model", "qwen2.5-7b", "--gpus", "8", "--gpu-memory-gib", "79.6",
                      "--table"])
    assert code == 0
    rows = out.strip().splitlines()
    assert rows[0] == "| model | activationCheckpointing | 8 GPUs x 79.6 GiB |"
    assert rows[2].startswith("| qwen2.5-7b | false | no (")
    assert rows[3].startswith("| qwen2.5-7b | true | fits (")


def test_a_config_json_and_a_breakdown() -> None:
    code, out = _run(["fit", "--model", str(MODEL / "config.json"), "--gpus", "1", "4",
                      "--precision", "fp32", "--activation-checkpointing", "on",
                      "--gpu-memory-gib", "2"])
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 2 and all("fits in 2 GiB" in ln for ln in lines)
    assert "1 rank sharded (FSDP), fp32" in lines[0] and "4 ranks" in lines[1]
    assert _run(["fit", "--model", "nope", "--gpus", "1"])[0] == 2
