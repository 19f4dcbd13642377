"""``rlpacer run`` and ``rlpacer bench-train`` (registered by ``rlpacer.cli``).

``register`` stays light: torch, Ray and vLLM are imported inside the commands.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run", help="run an RLTrainingJob manifest locally (tiny model, CPU, vLLM + Ray)",
        description="Runs the same RL loop, controller and planner a cluster runs, in one"
        " process tree: progress bar, metrics JSONL and a report with plots.")
    p.add_argument("manifest", type=Path, help="RLTrainingJob manifest (YAML)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default runs/<name>)")
    p.add_argument("--fixed-group-size", type=int, default=None, metavar="N",
                   help="run with a fixed group size N instead of the manifest's groupControl")
    p.add_argument("--no-tail-batching", action="store_true",
                   help="plain synchronous batches (tailBatching.enabled=false)")
    p.add_argument("--steps", type=int, default=None, help="override spec.steps")
    p.add_argument("--seed", type=int, default=None, help="override spec.data.seed")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluations")
    p.add_argument("--eval-prompts", type=int, default=256)
    p.set_defaults(func=cmd_run)

    b = subparsers.add_parser(
        "bench-train", help="fixed G=16 vs SAGC + tail batching on the tiny task (real RL)",
        description="Trains the same manifest with fixed G (no tail batching) and with SAGC +"
        " tail batching, for several seeds, on the same prompts; prints wall clock, held-out"
        " accuracy, tokens generated, engine busy fraction and the ratios.")
    b.add_argument("manifest", type=Path, nargs="?", default=Path("examples/tiny-local.yaml"))
    b.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    b.add_argument("--steps", type=int, default=None)
    b.add_argument("--baseline-group-size", type=int, default=16)
    b.add_argument("--tolerance", type=float, default=0.03,
                   help="'equal accuracy' = within this of the baseline's mean (absolute)")
    b.add_argument("--eval-prompts", type=int, default=256)
    b.add_argument("--out", type=Path, default=Path("runs/bench-train"))
    b.set_defaults(func=cmd_bench_train)


def _progress(total: int, initial: int = 0) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


def cmd_run(args: argparse.Namespace) -> int:
    from rlpacer.api.job import ManifestError
    from rlpacer_trainer.config import ConfigError, RunConfig

    try:
        cfg = RunConfig.load(
            args.manifest, fixed_group_size=args.fixed_group_size,
            tail_batching=False if args.no_tail_batching else None, steps=args.steps,
            seed=args.seed, eval_prompts=args.eval_prompts)
    except (ManifestError, ConfigError, FileNotFoundError) as err:
        print(f"error: {err}")
        return 2
    cfg.out_dir = args.out or Path("runs") / cfg.job.metadata.name
    try:
        return run_local(cfg, resume=args.resume, evaluate=not args.no_eval)
    except ConfigError as err:  # found at start, e.g. a user reward the workers cannot import
        print(f"error: {err}")
        return 2


def run_local(cfg: Any, *, resume: bool = False, evaluate: bool = True) -> int:
    from rlpacer_trainer import report, runtime

    out: Path = cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    print(f"rlpacer run: {cfg.job.metadata.name} -> {out}  (starting Ray and the vLLM engine)")
    algorithm = cfg.algorithm.to_wire()  # the preset with the manifest's overrides
    print("algorithm: " + ", ".join(f"{k} {v}" for k, v in algorithm.items()))
    runtime.init_ray()
    t_start = time.perf_counter()
    engines = runtime.start_engines(cfg, count=int(cfg.spec.rollout.replicas))
    engine_start_s = time.perf_counter() - t_start  # engine start with the model's load
    metrics = report.MetricsWriter(out / "metrics.jsonl")
    bar = None

    def on_step(rec: dict[str, Any]) -> None:
        metrics.write(rec)
        assert bar is not None
        bar.update(1)
        bar.set_postfix(reward=f"{rec['reward']:.2f}", G=rec["group_size"],
                        round=rec["round_kind"], stragglers=f"{rec['straggler_rate']:.2f}")

    t_start = time.perf_counter()
    learners = runtime.start_learners(cfg)
    drv = runtime.build_driver(cfg, engines, checkpoint_dir=out / "checkpoints", on_step=on_step,
                               learners=learners)
    learner_start_s = time.perf_counter() - t_start  # learner and driver, the model's load
    if resume and drv.load_checkpoint():
        print(f"resumed at step {drv.step}")
    (out / "topology.json").write_text(json.dumps(drv.topology(), indent=1))
    extra: dict[str, Any] = {"algorithm": algorithm,
                             "seconds_engine_start": round(engine_start_s, 2),
                             "seconds_learner_start": round(learner_start_s, 2)}
    evalset = cfg.eval_problems()
    evaluate = evaluate and bool(evalset)  # a file run without a held-out set: no evaluation
    if evaluate:
        extra["eval_accuracy_start"] = drv.evaluate(evalset)
    bar = _progress(cfg.total_steps, drv.step)
    t0 = time.perf_counter()
    drv.run()
    extra["wall_seconds"] = time.perf_counter() - t0
    bar.close()
    if drv.checkpoint_dir is not None:
        drv.save_checkpoint()
    if evaluate:
        extra["eval_accuracy_end"] = drv.evaluate(evalset)
    metrics.close()
    drv.close()
    path = report.write_report(out, drv.records, extra)
    print(json.dumps(extra, indent=1))
    print(f"report: {path}")
    return 0


def cmd_bench_train(args: argparse.Namespace) -> int:
    from rlpacer_trainer import runtime
    from rlpacer_trainer.config import RunConfig

    arms = {
        f"fixed{args.baseline_group_size}": dict(fixed_group_size=args.baseline_group_size,
                                                 tail_batching=False),
        "sagc_tail": dict(fixed_group_size=None, tail_batching=True),
    }
    base = RunConfig.load(args.manifest, steps=args.steps, eval_prompts=args.eval_prompts)
    runtime.init_ray()
    engines = runtime.start_engines(base, count=int(base.spec.rollout.replicas))
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    evalset = base.eval_problems()
    for seed in args.seeds:
        for arm, kw in arms.items():
            cfg = RunConfig.load(args.manifest, steps=args.steps, seed=seed,
                                 eval_prompts=args.eval_prompts, **kw)
            drv = runtime.build_driver(cfg, engines)
            s0 = [e.stats() for e in engines]
            t0 = time.perf_counter()
            drv.run()
            wall = time.perf_counter() - t0
            s1 = [e.stats() for e in engines]
            busy = sum(b.busy_seconds - a.busy_seconds for a, b in zip(s0, s1, strict=True))
            row = {
                "arm": arm, "seed": seed, "wall_s": wall,
                "eval_accuracy": drv.evaluate(evalset),
                "tokens": sum(b.tokens - a.tokens for a, b in zip(s0, s1, strict=True)),
                "engine_busy_fraction": busy / (wall * len(engines)),
                "rollout_s": sum(r["seconds_rollout"] for r in drv.records),
                "train_s": sum(r["seconds_train"] for r in drv.records),
                "long_rounds": sum(r["round_kind"] == "Long" for r in drv.records),
                "straggler_steps": sum(bool(r.get("straggler")) for r in drv.records),
                "group_sizes": sorted({r["group_size"] for r in drv.records}),
                "steps": len(drv.records),
            }
            drv.close()
            rows.append(row)
            print(json.dumps(row), flush=True)
    (args.out / "bench-train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    names = list(arms)
    mean = {a: {k: statistics.mean(r[k] for r in rows if r["arm"] == a)
                for k in ("wall_s", "eval_accuracy", "tokens", "engine_busy_fraction")}
            for a in names}
    b, t = mean[names[0]], mean[names[1]]
    result = {
        "means": mean,
        "speedup_wall": b["wall_s"] / t["wall_s"],
        "token_ratio": t["tokens"] / b["tokens"],
        "accuracy_delta": t["eval_accuracy"] - b["eval_accuracy"],
        "equal_or_better_accuracy": t["eval_accuracy"] >= b["eval_accuracy"] - args.tolerance,
        "tolerance": args.tolerance,
        "seeds": args.seeds,
    }
    (args.out / "bench-train.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0
