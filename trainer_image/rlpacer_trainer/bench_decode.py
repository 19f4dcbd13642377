"""A rollout engine's decode step time against its batch size, checked against the simulator.

``python -m rlpacer_trainer.bench_decode [--batches 1 8 64 256] [--steps 24]`` starts one
vLLM engine on this machine (the project's tiny model, as ``rlpacer run`` starts it: one core,
float32), and for each batch size b admits b requests at once (sampled, ``ignore_eos`` so that
all b stay running), lets the prefill step pass, then times ``--steps`` engine steps: each is
one decode step emitting one token for each of the b sequences. It prints the median step
time per batch against the simulator's CPU cost model (:func:`rlpacer.sim.cost.fit_cpu_profile`:
``base + per_seq x b``, fitted to an earlier measurement), their ratio, and the least-squares
fit of this run's own points, so the simulator's CPU profile can be checked against the engine
(issue 34: "the measured time per decode step against batch size on this CPU").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def measure(batches: list[int], steps: int, *, prompt_tokens: int = 16,
            threads_bind: str = "slot:auto", stat: str = "median") -> dict[int, float]:
    """Seconds of one decode step at each batch size (one engine, tiny model): the median of
    ``steps`` timed steps, or with ``stat="min"`` the fastest (the engine's own cost, robust
    to other processes on shared cores). A warm-up batch runs first, untimed."""
    from vllm import SamplingParams

    from rlpacer_trainer import tiny
    from rlpacer_trainer.engine import EngineConfig, VLLMEngine

    longest = max(batches)
    eng = VLLMEngine(EngineConfig(
        model_path=str(tiny.resolve_source("builtin://tiny-chain")),
        max_model_len=prompt_tokens + steps + 8, max_num_seqs=longest,
        max_num_batched_tokens=max(2048, longest * (prompt_tokens + 1)),
        threads_bind=threads_bind))
    prompt = (tiny.prompt_ids("12-3:") * prompt_tokens)[:prompt_tokens]
    pick = min if stat == "min" else statistics.median

    def run(tag: str, b: int) -> float:
        ids = [f"{tag}-{i}" for i in range(b)]
        for i, rid in enumerate(ids):
            eng.engine.add_request(rid, {"prompt_token_ids": list(prompt)}, SamplingParams(
                max_tokens=steps + 4, temperature=1.0, seed=i, ignore_eos=True,
                detokenize=False))
        eng.engine.step()  # the prefill of all b (and their first tokens)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            eng.engine.step()
            times.append(time.perf_counter() - t0)
        eng.engine.abort_request(ids)
        while eng.engine.has_unfinished_requests():
            eng.engine.step()
        return float(pick(times))

    run("warm-up", 8)  # untimed: an engine's first steps are slower
    if stat != "min":
        return {b: run(f"b{b}", b) for b in batches}
    # the fastest: batches interleaved over rounds, so that a burst of other work on the
    # cores slows one round of every batch, not every step of one batch
    best = {b: float("inf") for b in batches}
    for r in range(3):
        for b in batches:
            best[b] = min(best[b], run(f"r{r}-b{b}", b))
    return best


def fit(points: dict[int, float]) -> tuple[float, float]:
    """Least squares ``base + per_seq x b`` of measured step times."""
    from rlpacer.sim.cost import fit_cpu_profile

    p = fit_cpu_profile(points)
    return p.base_s, p.per_seq_s


def report(points: dict[int, float]) -> list[dict[str, Any]]:
    from rlpacer.sim.cost import fit_cpu_profile

    model = fit_cpu_profile()
    return [{"batch": b, "measured_s": t, "model_s": model.step_s(b, 0.0),
             "ratio": t / model.step_s(b, 0.0)} for b, t in sorted(points.items())]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlpacer_trainer.bench_decode",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per batch")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    points = measure(args.batches, args.steps)
    rows = report(points)
    base, per_seq = fit(points)
    print("batch   measured ms/step   simulator's CPU model ms/step   measured/model")
    for r in rows:
        print(f"{r['batch']:>5}   {r['measured_s'] * 1e3:>16.2f}   {r['model_s'] * 1e3:>29.2f}"
              f"   {r['ratio']:.2f}")
    print(f"this run's fit: {base * 1e3:.2f} ms + {per_seq * 1e3:.4f} ms x batch")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "fit": [base, per_seq]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
