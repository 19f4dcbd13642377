"""Reward-pool throughput with and without a hung reward (the issue's figure).

    python -m rlpacer_trainer.reward_bench [--calls 3000] [--workers 2 4] [--work-ms 0 2 10]

Each arm starts a pool (its start-up is reported, not timed), warms it up, then submits
``--calls`` scoring calls of the ``MathAnswer`` reward on a GSM8K-style response, plus
``--work-ms`` of CPU per call (a costlier reward). The ``hung`` arm first submits one call that
sleeps forever. Throughput is the ordinary calls per second until the last of them finishes;
the hung call is cut at ``--timeout`` (its worker killed and replaced) and the arm's wall time
(``wall_s``) includes waiting for that. Each pair of arms runs ``--repeat`` times; medians.
The ratio ``hung / clean`` is what a hang costs: with ``W`` workers and spare cores one of
them is lost until the timeout, so about ``(W - 1) / W`` when the calls are CPU-bound and
finish first, never zero.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from rlpacer_trainer.reward_fns import math_answer
from rlpacer_trainer.rewards import RewardCall, RewardPool

HANG = "<hang>"
RESPONSE = ("Natalia sold 48 clips in April. In May she sold half as many: 48/2 = 24 clips. "
            "Altogether she sold 48 + 24 = 72 clips, so the answer is \\boxed{72}.")


def reward(response: str, answer: str, prompt: str = "", **meta: Any) -> float:
    """MathAnswer, plus ``meta["work_ms"]`` of CPU; the response ``<hang>`` never returns."""
    if response == HANG:
        time.sleep(1e9)
    end = time.perf_counter() + float(meta.get("work_ms", 0.0)) / 1000.0
    while time.perf_counter() < end:
        pass
    return math_answer(response, answer, prompt)


def run(calls: int, workers: int, *, hung: bool, work_ms: float = 0.0,
        timeout_s: float = 10.0) -> dict[str, Any]:
    meta = {"work_ms": work_ms}
    with RewardPool("rlpacer_trainer.reward_bench:reward", timeout_s=timeout_s, workers=workers,
                    failure_score=-1.0) as pool:
        start_s = pool.start_s
        for i in range(4 * workers):  # warm-up: every worker has run a call
            pool.submit(("warm", i), RewardCall(RESPONSE, "72", meta=meta))
        pool.collect()
        base = pool.stats.calls
        t0 = time.perf_counter()
        if hung:
            pool.submit("hung", RewardCall(HANG, "72"))
        for i in range(calls):
            pool.submit(i, RewardCall(RESPONSE, "72", meta=meta))
        while pool.stats.calls - base < calls:  # the hung one ends last (at its timeout)
            time.sleep(0.001)
        t_calls = time.perf_counter() - t0
        out, _ = pool.collect()
        wall = time.perf_counter() - t0
        s = pool.stats
    ok = sum(out[i] == 1.0 for i in range(calls))
    if ok != calls or (hung and out["hung"] != -1.0):
        raise RuntimeError(f"wrong scores: {ok}/{calls} right, hung: {out.get('hung')}")
    return {"workers": workers, "work_ms": work_ms, "hung": hung, "calls": calls,
            "calls_per_s": calls / t_calls, "calls_s": t_calls, "wall_s": wall,
            "timeouts": s.timeouts, "start_s": start_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--work-ms", type=float, nargs="+", default=[0.0, 2.0, 10.0])
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--repeat", type=int, default=3, help="pairs of arms; medians reported")
    args = ap.parse_args(argv)
    for w in args.workers:
        for ms in args.work_ms:
            # about a second of clean work per arm, so a hang overlaps all of it
            n = args.calls if ms == 0 else max(50, min(args.calls, int(1000 * w / ms)))
            clean, hung = [], []
            for _ in range(args.repeat):
                clean.append(run(n, w, hung=False, work_ms=ms, timeout_s=args.timeout))
                hung.append(run(n, w, hung=True, work_ms=ms, timeout_s=args.timeout))
            c = statistics.median(r["calls_per_s"] for r in clean)
            h = statistics.median(r["calls_per_s"] for r in hung)
            print(json.dumps({
                "workers": w, "work_ms": ms, "calls": n, "repeat": args.repeat,
                "clean_calls_per_s": round(c, 1), "hung_calls_per_s": round(h, 1),
                "ratio": round(h / c, 3),
                "hung_wall_s": round(statistics.median(r["wall_s"] for r in hung), 2),
                "hung_timeouts": sum(r["timeouts"] for r in hung),
                "pool_start_s": round(statistics.median(r["start_s"] for r in clean), 3),
            }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
