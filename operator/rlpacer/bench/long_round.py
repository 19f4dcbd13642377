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

``--early LEAD`` compares instead the long round's wait for capacity with and without the early
scale-up (``tailBatching.longRound.scaleUpLeadSeconds``): both jobs defer one prompt a short
round, so the long round is step ``--prompts`` (default steps: one more); ``elastic`` asks for
rollout-1 at the report before it (lead 0), ``early`` with the lead (the report after step 0
forecasts it). It prints each long round's ``seconds_capacity_wait`` (the wait for the scale-up
and the added engine's start) and the lead measured (the ask to the engine serving). The long
round's work may differ between the two (the early engine serves short rounds too, so other
prompts may be deferred): the wait is what is compared.

``--mid-round`` compares a long round that waits for its added replica (``elastic``) with one
that starts at once and takes the replica when it joins (``midround``,
``tailBatching.longRound.joinMidRound``): each long round's wait for capacity, its rollout, and
their sum, the ratio midround/elastic of the sum, and the requests moved to the joining
engine with their tokens. ``--step-sleep S`` makes every engine step S seconds longer (the
testing setting ``RLPACER_TEST_ENGINE_STEP_SLEEP_S``), so that the tiny job's long round lasts
longer than an engine's start, as long rounds do on GPUs.
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
EARLY_MODES = ("elastic", "early")
MID_MODES = ("elastic", "midround")


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
        "capacity_wait_s": round(r.get("seconds_capacity_wait", r.get("seconds_join", 0)), 3),
        "lead_s": r.get("scale_up_lead_s"),
        "responses": sum(int(e["responses"]) for e in engines), "tokens": tokens,
        "len_max": r["len_max"], "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "joined_mid_round": r.get("joined_mid_round", []),
        "moved_requests": r.get("moved_requests", 0), "moved_tokens": r.get("moved_tokens", 0),
        "engines": [{"replica": e["replica"], "host": e["hostname"], "cores": e.get("cores"),
                     "responses": e["responses"], "tokens": e["tokens"],
                     "busy_s": e.get("busy_s"),
                     "tokens_per_busy_s": (round(e["tokens"] / e["busy_s"], 2)
                                           if e.get("busy_s") else None)}
                    for e in engines],
    }


def compare_early(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The long round's wait for capacity, early against elastic (medians of the rounds)."""
    med = {m: {k: statistics.median(x[k] for x in runs[m])
               for k in ("capacity_wait_s", "wall_s")} for m in EARLY_MODES}
    return {
        "capacity_wait_s": {m: med[m]["capacity_wait_s"] for m in EARLY_MODES},
        "wait_saved_s": round(med["elastic"]["capacity_wait_s"]
                              - med["early"]["capacity_wait_s"], 3),
        "lead_measured_s": [x["lead_s"] for x in runs["early"]],
        "median": med,
    }


def compare_mid(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The long round's wait for capacity and rollout, midround against elastic (medians of
    the rounds), and the ratio of their sums."""
    med = {m: {k: statistics.median(x[k] for x in runs[m])
               for k in ("capacity_wait_s", "wall_s")} for m in MID_MODES}
    total = {m: round(med[m]["capacity_wait_s"] + med[m]["wall_s"], 3) for m in MID_MODES}
    return {
        "wait_plus_rollout_s": total,
        "ratio_midround_over_elastic": round(total["midround"] / total["elastic"], 3),
        "moved_requests": [x["moved_requests"] for x in runs["midround"]],
        "moved_tokens": [x["moved_tokens"] for x in runs["midround"]],
        "joined_mid_round": [x["joined_mid_round"] for x in runs["midround"]],
        "median": med,
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
    early = args.early is not None
    if early and args.early < 1:
        print("error: --early: the lead must be at least 1 second", file=sys.stderr)
        return 2
    mid = bool(getattr(args, "mid_round", False))
    if early and mid:
        print("error: --early and --mid-round compare different things: give one",
              file=sys.stderr)
        return 2
    modes = EARLY_MODES if early else MID_MODES if mid else MODES
    steps = args.steps if args.steps is not None else (args.prompts + 1 if early else 2)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for i in range(args.rounds):
        order = modes if i % 2 == 0 else modes[::-1]  # alternate: drift hits both alike
        for mode in order:
            t0 = time.monotonic()
            print(f"round {i + 1}/{args.rounds}: {mode} ...", file=sys.stderr, flush=True)
            try:
                lead = None if not early else (0 if mode == "elastic" else args.early)
                res = run_long_round(out_dir / f"{mode}-{i}", mode, steps=steps,
                                     prompts=args.prompts, max_tokens=args.max_tokens,
                                     lead_s=lead, step_sleep_s=args.step_sleep)
            except PlayedJobFailed as err:
                print(f"error: the {mode} job failed: {err}", file=sys.stderr)
                return 1
            fig = long_round(res.records)
            fig["job_s"] = round(time.monotonic() - t0, 1)
            runs[mode].append(fig)
            print(f"  long round: {fig['wall_s']:.2f}s after waiting"
                  f" {fig['capacity_wait_s']:.2f}s for capacity, {fig['tokens']} tokens,"
                  f" {fig['tokens_per_s']} tokens/s, engines "
                  + ", ".join(f"{e['host']}:{e['tokens']}" for e in fig["engines"]),
                  file=sys.stderr, flush=True)
    if early:
        print(json.dumps({"runs": runs, **compare_early(runs), "out": str(out_dir)}, indent=1))
        return 0
    if mid:
        print(json.dumps({"runs": runs, **compare_mid(runs), "out": str(out_dir)}, indent=1))
        return 0
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
    p.add_argument("--steps", type=int, default=None,
                   help="steps per job (default 2; with --early, --prompts + 1)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (default 4)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="maxResponseTokens (default: the tiny example's)")
    p.add_argument("--out", default=None, help="folder for the jobs' logs and records")
    p.add_argument("--early", type=int, default=None, metavar="LEAD_S",
                   help="compare the long round's wait for capacity with the early scale-up"
                        " at this lead (seconds) against none, on the same schedule")
    p.add_argument("--mid-round", action="store_true",
                   help="compare a long round that waits for its added replica with one that"
                        " starts at once and takes it mid-round (joinMidRound)")
    p.add_argument("--step-sleep", type=float, default=0.0, metavar="S",
                   help="make every engine step S seconds longer (slow decoding, so that a"
                        " long round outlasts an engine's start; default 0)")
    p.set_defaults(func=run)
