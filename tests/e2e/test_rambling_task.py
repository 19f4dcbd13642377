"""The task with a tail (``examples/wordproblems-ramble-local.yaml``) as users run it: the
shipped rambling warm start, ``rlpacer run`` with vLLM, plain rounds of G=16 so that every
response's length is in the trace. The tail is real: in the first step a good share of the
responses run to the cap (measured 2026-12-06: 102 of 512, median 45 tokens), and after the
first update, when the median has fallen to a short answer's length, the longest still run
several times it (128 against 18 tokens). RL has much to gain and gains it: a truncated response
scores 0, the model learns to stop (2 responses at the cap at the sixth step), and held-out
greedy accuracy rises by at least 15 points in 6 steps (measured 19.5% -> 53.5% on 256
problems). What the product's arms make of it is ``rlpacer bench-train``'s to measure
(docs/benchmarks.md#the-task-with-a-tail)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlpacer_trainer import contract as c
from rlpacer_trainer import wordproblems

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "wordproblems-ramble-local.yaml"
BIN = Path(sys.executable).parent


def test_the_rambling_warm_start_has_a_tail_and_rl_teaches_it_to_stop(tmp_path: Path) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    cap = int(spec["rollout"]["maxResponseTokens"])
    spec["model"]["source"] = str(ROOT / spec["model"]["source"])
    spec["data"]["source"] = str(wordproblems.write(tmp_path / "train.jsonl", 2048, seed=0))
    spec["data"]["evalSource"] = str(wordproblems.write(tmp_path / "held.jsonl", 256, seed=99))
    manifest = tmp_path / "ramble.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop(c.ENV_RAY_ADDRESS, None)
    out = tmp_path / "run"
    proc = subprocess.run(
        [str(BIN / "rlpacer"), "run", str(manifest), "--steps", "6", "--out", str(out),
         "--fixed-group-size", "16", "--no-tail-batching"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "trace.jsonl").read_text().splitlines()[1:]]
    by_step = {s: [r["length"] for r in rows if r["step"] == s] for s in range(6)}
    assert all(len(v) == 16 * int(spec["promptsPerStep"]) and None not in v
               for v in by_step.values())  # plain rounds: every response ran to its end
    first, last = by_step[0], by_step[5]
    at_cap = [sum(n >= cap for n in by_step[s]) for s in range(6)]
    # the tail: in the first step responses run to the cap, and not a stray few (the
    # rambling kinds are 2 of the 5); once the first update has shortened most of them, the
    # longest still run at least 4x the median
    assert max(first) == cap and at_cap[0] >= 0.05 * len(first), at_cap
    ratios = [max(by_step[s]) / statistics.median(by_step[s]) for s in (1, 2)]
    assert max(ratios) >= 4.0, (ratios, at_cap)
    # RL teaches it to stop: far fewer responses run to the cap after 5 updates
    assert at_cap[5] <= 0.5 * at_cap[0] and statistics.mean(last) < statistics.mean(first), at_cap
    # and held-out greedy accuracy rises by much (greedy rambles to the cap on those kinds)
    summary = json.loads((out / "summary.json").read_text())
    start, end = summary["eval_accuracy_start"], summary["eval_accuracy_end"]
    assert start <= 0.35 and end >= start + 0.15, (start, end)
