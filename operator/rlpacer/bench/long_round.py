"""``rlpacer bench-long-round``: the same long round on 1 and on 2 rollout replicas.

Runs the tiny job on played hosts (:mod:`rlpacer.testing.played_job`: every pod a process on
a host of its own, a played operator over the real plan logic) twice per round, in
alternating order: ``single`` (the long round on rollout-0 alone: a fixed pool sized for short
rounds) and ``elastic`` (the operator scales to 2 replicas for the long round; rollout-1's pod
is created, its engine joins at the learner's weights and generates part of the round, and
the pod is deleted after it). Step 0 runs on rollout-0 alone in both, with the same seeds, so
the same prompts are deferred and the long round is the same work in both: the bench checks
that its responses and tokens match.

It prints, per mode, the long round's rollout wall clock (``seconds_rollout``: from its first
request to its last answer), each engine's tokens, busy seconds and tokens/s, and the time to
start the added engine (``seconds_join``); then the ratios elastic/single of the long round's
wall clock and aggregate tokens/s, measured in the same run. Needs root (network namespaces)
and vLLM; about 4 minutes per job on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("single", "elastic")


def long_round(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The long round's figures from a job's metrics records (the first long round)."""
    longs = [r for r in records if r["round_kind"] == "Long"]
    if not longs:
        raise ValueError(f"no long round in steps {[r['round_kind'] for r in records]}")
    r = longs[0]
    engines = sorted(r["engines"], key=lambda e: e["replica"])
    wall = float(r["seconds_rollout"])
    tokens = sum(int(e["tokens"]) for e in engines)
    return {
        "step": r["step"], "wall_s": round(wall, 3), "join_s": round(r.get("seconds_join", 0), 3),
        "responses": sum(int(e["responses"]) for e in engines), "tokens": tokens,
        "len_max": r["len_max"], "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "engines": [{"replica": e["replica"], "host": e["hostname"], "cores": e.get("cores"),
                     "responses": e["responses"], "tokens": e["tokens"],
                     "busy_s": e.get("busy_s"),
                     "tokens_per_busy_s": (round(e["tokens"] / e["busy_s"], 2)
                                           if e.get("busy_s") else None)}
                    for e in engines],
    }


def compare(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Ratios elastic/single over the medians of the rounds, and whether the work matched."""
    med = {m: {k: statistics.median(x[k] for x in runs[m]) for k in ("wall_s", "tokens_per_s")}
           for m in MODES}
    same = len({(x["responses"], x["tokens"]) for m in MODES for x in runs[m]}) == 1
    return {
        "wall_ratio_elastic_over_single": round(med["elastic"]["wall_s"]
                                                / med["single"]["wall_s"], 3),
        "tokens_per_s_ratio_elastic_over_single": round(
            med["elastic"]["tokens_per_s"] / med["single"]["tokens_per_s"], 3),
        "same_work_in_every_run": same,
        "median": med,
    }


def run(args: argparse.Namespace) -> int:
    from rlpacer.testing.played_job import PlayedJobFailed, run_long_round

    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="rlpacer-blr-"))
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for i in range(args.rounds):
        order = MODES if i % 2 == 0 else MODES[::-1]  # alternate: drift hits both alike
        for mode in order:
            t0 = time.monotonic()
            print(f"round {i + 1}/{args.rounds}: {mode} ...", file=sys.stderr, flush=True)
            try:
                res = run_long_round(out_dir / f"{mode}-{i}", mode, steps=args.steps,
                                     prompts=args.prompts, max_tokens=args.max_tokens)
            except PlayedJobFailed as err:
                print(f"error: the {mode} job failed: {err}", file=sys.stderr)
                return 1
            fig = long_round(res.records)
            fig["job_s"] = round(time.monotonic() - t0, 1)
            runs[mode].append(fig)
            print(f"  long round: {fig['wall_s']:.2f}s, {fig['tokens']} tokens,"
                  f" {fig['tokens_per_s']} tokens/s, engines "
                  + ", ".join(f"{e['host']}:{e['tokens']}" for e in fig["engines"]),
                  file=sys.stderr, flush=True)
    result = {"runs": runs, **compare(runs), "out": str(out_dir)}
    print(json.dumps(result, indent=1))
    if not result["same_work_in_every_run"]:
        print("warning: the long round's work differed between runs (see responses/tokens):"
              " the ratios compare different work", file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench-long-round",
        help="the same long round on 1 and on 2 rollout replicas (played hosts; root, vLLM)",
        description=__doc__)
    p.add_argument("--rounds", type=int, default=1,
                   help="pairs of jobs (single, elastic), alternating order (default 1)")
    p.add_argument("--steps", type=int, default=2, help="steps per job (default 2)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (default 4)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="maxResponseTokens (default: the tiny example's)")
    p.add_argument("--out", default=None, help="folder for the jobs' logs and records")
    p.set_defaults(func=run)
