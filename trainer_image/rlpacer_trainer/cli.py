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
    p.add_argument("--baseline", type=int, default=None, metavar="G",
                   help="then train the same manifest again with a fixed group size G and no"
                   " tail batching (same steps, data, seed and warm start; into OUT/baseline)"
                   " and compare training wall clock and held-out accuracy in the report")
    p.set_defaults(func=cmd_run)

    b = subparsers.add_parser(
        "bench-train", help="time to accuracy: fixed G, SAGC, tail batching, both (real RL)",
        description="Trains the same manifest once per arm and seed, from the same warm start"
        " and on the same prompts, evaluating a fixed held-out set every few steps (timed"
        " apart from training); prints, per arm, the training wall clock it needs to reach the"
        " baseline arm's final accuracy and its accuracy at the baseline's wall clock, paired"
        " across seeds, and plots accuracy against training wall clock (docs/benchmarks.md).")
    b.add_argument("manifest", type=Path, nargs="?", default=Path("examples/tiny-local.yaml"))
    b.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), metavar="ARM",
                   help="fixed<N> (fixed G, no tail batching), tb<N> (fixed G, tail batching),"
                   " sagc (no tail batching), sagc_tb (the product), each with an optional"
                   " -mb<K>: the learner's mini-batches (optimizer steps) per step, default 2;"
                   " a tb<N> or sagc_tb arm also -fill<F> (its long rounds also launch F"
                   " fresh prompts, tailBatching.longRound.fillPrompts), then -extra<K> (K"
                   " responses beyond G per prompt in a short round,"
                   " tailBatching.extraResponsesPerPrompt); a sagc or sagc_tb"
                   " arm also a last -persec (SAGC maximises log2(G) per second of a step,"
                   " groupControl.objective PerSecond);"
                   " trl<N>: TRL's GRPOTrainer at G=N on the same job, for comparison (pip"
                   " install 'rlpacer[trl]'; docs/benchmarks.md); default: %(default)s")
    b.add_argument("--baseline", default="fixed16", help="the arm the others are measured"
                   " against (its final accuracy is the target); default: %(default)s")
    b.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    b.add_argument("--steps", type=int, default=None, help="override spec.steps")
    b.add_argument("--eval-every", type=int, default=5, metavar="K",
                   help="evaluate every K steps (and at the end)")
    b.add_argument("--eval-prompts", type=int, default=None, metavar="N",
                   help="held-out prompts: the builtin task's count (256 unset), or the first N"
                   " of the manifest's held-out file (all of it unset)")
    b.add_argument("--equal-wall-clock", action="store_true",
                   help="every other arm trains until its training wall clock reaches the"
                   " baseline's (same seed; checked at each evaluation, at most"
                   f" {EQUAL_WALL_MAX_STEPS}x the steps), not for the same number of steps: its"
                   " accuracy at the baseline's wall clock is then a measured point")
    b.add_argument("--target-evals", type=int, default=1, metavar="K",
                   help="the target is the mean of the baseline's last K evaluations, per seed"
                   " (1: its final accuracy; a K spanning where it has levelled off is steadier"
                   " than one evaluation); default: %(default)s")
    b.add_argument("--target-gain", type=float, default=1.0, metavar="F",
                   help="the target is the warm start plus F of the baseline's gain to it"
                   " (0 < F <= 1; 0.9 puts it on the rise of the curve, not its plateau);"
                   " default: %(default)s")
    b.add_argument("--rescore", type=Path, default=None, metavar="DIR",
                   help="train nothing: summarise the run recorded in DIR/bench-train.jsonl"
                   " again, with --baseline, --target-evals and --target-gain")
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
    baseline = None
    if args.baseline is not None:
        if args.no_eval or args.resume:
            print("error: --baseline compares held-out accuracy from the warm start: it cannot"
                  " be combined with --no-eval or --resume")
            return 2
        try:
            baseline = RunConfig.load(
                args.manifest, fixed_group_size=args.baseline, tail_batching=False,
                steps=args.steps, seed=args.seed, eval_prompts=args.eval_prompts)
        except (ManifestError, ConfigError) as err:
            print(f"error: --baseline {args.baseline}: {err}")
            return 2
        if not baseline.eval_problems():
            print(f"error: --baseline needs a held-out set ({args.manifest} has none:"
                  " spec.data.evalSource or evalFraction)")
            return 2
    from rlpacer_trainer import contract, fit

    try:
        # the learner's memory per rank (every rank on this host), before any engine starts
        fit.check_run(cfg, local=True)
        return run_local(cfg, resume=args.resume, evaluate=not args.no_eval,
                         baseline=baseline)
    except ConfigError as err:  # found at start, e.g. a user reward the workers cannot import
        print(f"error: {err}")
        return 2
    except Exception as err:
        unfit = fit.does_not_fit(err)  # here, or a learner rank's own check through Ray
        if unfit is None:
            raise
        print(f"error: {unfit}")
        return contract.EXIT_LEARNER_DOES_NOT_FIT


def run_local(cfg: Any, *, resume: bool = False, evaluate: bool = True,
              baseline: Any = None) -> int:
    """Runs ``cfg`` locally; with ``baseline`` (a RunConfig of the same manifest, fixed G and
    no tail batching) then trains that from the same warm start on the same engines and adds
    the comparison to the report."""
    from rlpacer_trainer import report, runtime

    out: Path = cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    print(f"rlpacer run: {cfg.job.metadata.name} -> {out}  (starting Ray and the vLLM engine)")
    algorithm = cfg.algorithm.to_wire()  # the preset with the manifest's overrides
    print("algorithm: " + ", ".join(f"{k} {v}" for k, v in algorithm.items()))
    runtime.init_ray()
    t_start = time.perf_counter()
    # the engines and the learner load the model at once; each figure is from the start
    engines, learners, up = runtime.start_job(cfg)
    engine_start_s = up["engines"]  # engine start with the model's load
    metrics = report.MetricsWriter(out / "metrics.jsonl")
    bar = None
    slo: list[Any] = [None]  # the last straggler-SLO verdict (its hysteresis starts there)

    def on_step(rec: dict[str, Any]) -> None:
        verdict = _slo_verdict(drv.controller, slo[0])
        if verdict is not None:
            slo[0] = verdict
            rec["straggler_slo"] = verdict.state.value
            rec["long_round_straggler_rate"] = verdict.long_rate
        metrics.write(rec)
        assert bar is not None
        bar.update(1)
        bar.set_postfix(reward=f"{rec['reward']:.2f}", G=rec["group_size"],
                        round=rec["round_kind"], stragglers=f"{rec['straggler_rate']:.2f}",
                        slo="?" if verdict is None else verdict.brief())

    drv = runtime.build_driver(cfg, engines, checkpoint_dir=out / "checkpoints", on_step=on_step,
                               learners=learners)
    if not resume:
        (out / "trace.jsonl").unlink(missing_ok=True)  # a new run starts a new trace
    drv.record_trace(out / "trace.jsonl")
    # from the same start: the learners up (they load the model beside the engines), and the
    # whole start-up (the driver built, the first weight sync done)
    learner_start_s = up["learners"]
    start_s = time.perf_counter() - t_start
    if resume and drv.load_checkpoint():
        print(f"resumed at step {drv.step}")
    (out / "topology.json").write_text(json.dumps(drv.topology(), indent=1))
    extra: dict[str, Any] = {"algorithm": algorithm,
                             "seconds_engine_start": round(engine_start_s, 2),
                             "seconds_learner_start": round(learner_start_s, 2),
                             "seconds_start": round(start_s, 2)}
    evalset = cfg.eval_problems()
    evaluate = evaluate and bool(evalset)  # a file run without a held-out set: no evaluation
    if evaluate:
        extra["eval_prompts"] = len(evalset)
        extra["eval_accuracy_start"] = drv.evaluate(evalset)
    bar = _progress(cfg.total_steps, drv.step)
    s0 = [e.stats() for e in engines]
    t0 = time.perf_counter()
    drv.run()
    extra["wall_seconds"] = time.perf_counter() - t0
    extra["run_engine_tokens"] = _tokens_since(engines, s0)
    bar.close()
    if drv.checkpoint_dir is not None:
        drv.save_checkpoint()
    if evaluate:
        extra["eval_accuracy_end"] = drv.evaluate(evalset)
    final = _slo_verdict(drv.controller, slo[0])
    if final is not None:
        extra["straggler_slo"] = final.to_dict()
    extra["length_prior"] = drv.prior.calibration()
    extra["routed_prompts"] = drv.routed_total
    ctx = _context_summary(drv.controller) if cfg.length_context else None
    if ctx is not None:
        extra["sagc_context"] = ctx
    metrics.close()
    drv.close()
    if baseline is not None and evaluate:
        _kill_actors(learners)  # its CPU and memory go to the baseline's learner
        extra["baseline"] = _run_baseline(baseline, engines, evalset, out / "baseline")
    path = report.write_report(out, drv.records, extra)
    print(json.dumps(extra, indent=1))
    if final is not None:
        print(f"straggler SLO: {final.state.value}: {final.message()}")
    print(f"report: {path}")
    return 0


def _tokens_since(engines: list[Any], before: list[Any]) -> int:
    """Tokens the engines generated since their ``stats()`` were ``before``."""
    return sum(e.stats().tokens - b.tokens for e, b in zip(engines, before, strict=True))


def _kill_actors(learners: Any) -> None:
    import ray

    for a in getattr(learners, "actors", []):
        ray.kill(a)


def _run_baseline(cfg: Any, engines: list[Any], evalset: Any, out: Path) -> dict[str, Any]:
    """The baseline arm of ``rlpacer run --baseline``: the same steps from the same warm start
    on the same engines (reset to the warm start's weights), its training wall clock timed as
    the run's (steps only, evaluations apart). Its records go to ``out/metrics.jsonl``."""
    from rlpacer_trainer import report, runtime

    out.mkdir(parents=True, exist_ok=True)
    fixed = cfg.fixed_group_size
    print(f"baseline: fixed G={fixed}, no tail batching, {cfg.total_steps} steps -> {out}")
    learners = runtime.start_learners(cfg)
    metrics = report.MetricsWriter(out / "metrics.jsonl")
    bar = _progress(cfg.total_steps)

    def on_step(rec: dict[str, Any]) -> None:
        metrics.write(rec)
        bar.update(1)
        bar.set_postfix(reward=f"{rec['reward']:.2f}", G=rec["group_size"])

    drv = runtime.build_driver(cfg, engines, on_step=on_step, learners=learners)
    (out / "trace.jsonl").unlink(missing_ok=True)
    drv.record_trace(out / "trace.jsonl")
    try:
        start = drv.evaluate(evalset)
        s0 = [e.stats() for e in engines]
        t0 = time.perf_counter()
        drv.run()
        wall = time.perf_counter() - t0
        bar.close()
        tokens = _tokens_since(engines, s0)
        end = drv.evaluate(evalset)
    finally:
        metrics.close()
        drv.close()
        _kill_actors(learners)
    recs = drv.records
    return {"group_size": fixed, "tail_batching": False, "steps": len(recs),
            "wall_seconds": wall, "eval_accuracy_start": start, "eval_accuracy_end": end,
            "engine_tokens": tokens,
            "rollout_seconds": sum(r["seconds_rollout"] for r in recs),
            "train_seconds": sum(r["seconds_train"] for r in recs),
            "metrics": str(out / "metrics.jsonl")}


def _context_summary(controller: Any) -> dict[str, Any] | None:
    """``tailBatching.lengthPrior.context`` (local runs): SAGC's decisions drawn in context and
    the realised straggler rate of the rounds predicted at or below / above their recent mean
    (equal rates: the prediction knew nothing)."""
    ctl: Any = getattr(getattr(controller, "jc", None), "controller", None)
    if ctl is None or not hasattr(ctl, "context_counts"):
        return None
    (ln, ls), (hn, hs) = ctl.context_counts()
    return {"decisions": ctl.context_decisions,
            "predicted_low": {"steps": ln, "stragglers": ls},
            "predicted_high": {"steps": hn, "stragglers": hs}}


def _slo_verdict(controller: Any, previous: Any) -> Any:
    """The in-process controller's straggler-SLO verdict (None for another controller)."""
    from rlpacer.control.plan import JobController

    jc = getattr(controller, "jc", None)
    if not isinstance(jc, JobController):
        return None
    return jc.slo_verdict(previous=None if previous is None else previous.state)


#: ``rlpacer bench-train``'s arms: (fixed group size or None for SAGC, tail batching)
DEFAULT_ARMS = ("fixed16", "fixed8", "sagc", "tb8", "sagc_tb")
#: ``--equal-wall-clock``: an arm trains at most this many times the steps
EQUAL_WALL_MAX_STEPS = 4


def _split_count(name: str, tag: str, letter: str, unit: str) -> tuple[str, int | None]:
    """An arm's name without its optional ``-<tag><N>`` suffix, and N (None: not there)."""
    if f"-{tag}" not in name:
        return name, None
    base, n = name.rsplit(f"-{tag}", 1)
    if not n.isdigit():
        raise ValueError(f"unknown arm {name!r}: -{tag}<{letter}> needs {letter} >= 0 ({unit})")
    return base, int(n)


def split_fill(name: str) -> tuple[str, int | None]:
    """An arm's name without its optional ``-fill<F>`` suffix (tail batching's long rounds
    also launch F fresh prompts: ``tailBatching.longRound.fillPrompts``), and F (None:
    the manifest's)."""
    return _split_count(name, "fill", "F", "fresh prompts")


def split_extra(name: str) -> tuple[str, int | None]:
    """An arm's name without its optional ``-extra<K>`` suffix (a short round launches K
    responses beyond G per prompt: ``tailBatching.extraResponsesPerPrompt``), and K (None:
    the manifest's)."""
    return _split_count(name, "extra", "K", "responses")


def split_objective(name: str) -> tuple[str, str | None]:
    """An arm's name without its optional ``-persec`` suffix (SAGC maximises log2(G) per
    second of a step: ``groupControl.objective: PerSecond``), and the objective it sets
    (None: the manifest's)."""
    if name.endswith("-persec"):
        return name.removesuffix("-persec"), "second"
    return name, None


def parse_arm(name: str) -> tuple[int | None, bool, int | None]:
    """An arm's (fixed group size, tail batching, the learner's mini-batches per step):
    fixed<N>, tb<N>, sagc, sagc_tb, each with an optional ``-mb<K>`` (K mini-batches, each an
    optimizer step; None: the run's default)."""
    base, mb = name, None
    if "-mb" in name:
        base, k = name.rsplit("-mb", 1)
        if not (k.isdigit() and int(k) >= 1):
            raise ValueError(f"unknown arm {name!r}: -mb<K> needs K >= 1 (mini-batches)")
        mb = int(k)
    if base == "sagc":
        return None, False, mb
    if base == "sagc_tb":
        return None, True, mb
    for prefix, tb in (("fixed", False), ("tb", True)):
        if base.startswith(prefix) and base[len(prefix):].isdigit() and int(base[len(prefix):]):
            return int(base[len(prefix):]), tb, mb
    raise ValueError(f"unknown arm {name!r}: use fixed<N>, tb<N>, sagc or sagc_tb (N >= 1),"
                     " optionally with -mb<K>")


def cmd_bench_train(args: argparse.Namespace) -> int:
    from rlpacer.api.job import ManifestError
    from rlpacer_trainer import runtime, trl_arm, tta
    from rlpacer_trainer.config import ConfigError, RunConfig

    target_evals = int(getattr(args, "target_evals", 1))
    if target_evals < 1:
        print(f"error: --target-evals {target_evals}: must be >= 1 (1: the baseline's final"
              " accuracy; K: the mean of its last K evaluations)")
        return 2
    gain = float(getattr(args, "target_gain", 1.0))
    if not 0.0 < gain <= 1.0:
        print(f"error: --target-gain {gain}: must be in (0, 1] (1: the baseline's accuracy"
              " itself; 0.9: the warm start plus 90% of the baseline's gain)")
        return 2
    if getattr(args, "rescore", None) is not None:
        return _rescore(args.rescore, args.baseline, target_evals, gain)
    try:
        trl_arms = {a: g for a in dict.fromkeys(args.arms) if (g := trl_arm.parse(a))}
        if args.baseline in trl_arms:
            raise ValueError(f"--baseline {args.baseline}: a trl<N> arm cannot be the"
                             " baseline (name one of rlpacer's arms)")
        objectives = {a: split_objective(a) for a in dict.fromkeys(args.arms)
                      if a not in trl_arms}
        extras = {a: split_extra(objectives[a][0]) for a in objectives}
        arms = {a: (trl_arms[a], False, None) if a in trl_arms
                else parse_arm(split_fill(extras[a][0])[0]) for a in dict.fromkeys(args.arms)}
        fills = {a: split_fill(extras[a][0])[1] for a in arms if a not in trl_arms}
        for a, (_, objective) in objectives.items():
            if objective is not None and arms[a][0] is not None:
                raise ValueError(f"arm {a!r}: -persec sets SAGC's objective; use it on sagc"
                                 " or sagc_tb (a fixed G has nothing to choose)")
        for a, (_, k) in extras.items():
            if k is not None and not arms[a][1]:
                raise ValueError(f"arm {a!r}: -extra<K> sets tail batching's extra responses"
                                 " per prompt; use it on tb<N> or sagc_tb")
        for a, f in fills.items():
            if f is not None and not arms[a][1]:
                raise ValueError(f"arm {a!r}: -fill<F> fills tail batching's long rounds;"
                                 " use it on tb<N> or sagc_tb")
        if args.baseline not in arms:
            raise ValueError(f"--baseline {args.baseline} is not one of --arms {list(arms)}")
        # the baseline first: with --equal-wall-clock the others train to its wall clock
        arms = {args.baseline: arms[args.baseline],
                **{a: v for a, v in arms.items() if a != args.baseline}}
        if args.eval_every < 1:
            raise ValueError("--eval-every must be >= 1")
        kw: dict[str, Any] = {"steps": args.steps}
        if args.eval_prompts is not None:
            kw["eval_prompts"] = args.eval_prompts
        base = RunConfig.load(args.manifest, **kw)
        if trl_arms:
            trl_arm.check(base)
    except (ValueError, ManifestError, ConfigError, FileNotFoundError) as err:
        print(f"error: {err}")
        return 2
    evalset = base.eval_problems()
    if args.eval_prompts is not None:
        evalset = evalset[: args.eval_prompts]
    if not evalset:
        print(f"error: {args.manifest} has no held-out set (spec.data.evalSource or"
              " evalFraction): time to accuracy needs one")
        return 2

    runtime.init_ray()
    engines = runtime.start_engines(base, count=int(base.spec.rollout.replicas))
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    curves: dict[str, dict[int, list[dict[str, Any]]]] = {a: {} for a in arms}
    start_acc: float | None = None  # the warm start's (every arm and seed starts there)
    equal = bool(getattr(args, "equal_wall_clock", False))
    for seed in args.seeds:
        budget: float | None = None  # the baseline's training wall clock (--equal-wall-clock)
        for arm, (fixed, tb, mb) in arms.items():
            arm_kw = dict(kw)
            if mb is not None:
                arm_kw["mini_batches"] = mb
            if fills.get(arm) is not None:
                arm_kw["long_round_fill"] = fills[arm]
            if arm in extras and extras[arm][1] is not None:
                arm_kw["extra_responses"] = extras[arm][1]
            if arm in objectives and objectives[arm][1] is not None:
                arm_kw["sagc_objective"] = objectives[arm][1]
            if equal and budget is not None:
                arm_kw["steps"] = EQUAL_WALL_MAX_STEPS * base.total_steps
            cfg = RunConfig.load(args.manifest, seed=seed, fixed_group_size=fixed,
                                 tail_batching=tb, **arm_kw)
            if arm in trl_arms:
                assert start_acc is not None  # the baseline ran first
                row = _trl_row(cfg, engines, evalset, arm=arm, seed=seed, budget=budget,
                               steps=arm_kw["steps"] or cfg.total_steps,
                               eval_every=args.eval_every, start_acc=start_acc,
                               out=args.out / f"{arm}-seed{seed}")
                curves[arm][seed] = row["curve"]
                rows.append(row)
                with (args.out / "bench-train.jsonl").open("a") as f:
                    f.write(json.dumps(row) + "\n")
                continue
            learners = runtime.start_learners(cfg)
            drv = runtime.build_driver(cfg, engines, learners=learners)
            if start_acc is None:
                start_acc = drv.evaluate(evalset)
            curve = [{"train_s": 0.0, "step": 0, "accuracy": start_acc}]
            s0 = [e.stats() for e in engines]
            train_s = eval_s = 0.0
            while drv.step < cfg.total_steps and (budget is None or train_s < budget):
                before = drv.step
                t0 = time.perf_counter()
                drv.run(steps=args.eval_every)
                train_s += time.perf_counter() - t0
                if drv.step == before:
                    break  # the data ran out (every epoch trained)
                t0 = time.perf_counter()
                acc = drv.evaluate(evalset)
                eval_s += time.perf_counter() - t0
                curve.append({"train_s": train_s, "step": drv.step, "accuracy": acc})
                print(f"{arm} seed {seed}: step {drv.step} train {train_s:.1f} s"
                      f" accuracy {acc:.3f}", flush=True)
            tokens = _tokens_since(engines, s0)
            recs = drv.records
            if equal and arm == args.baseline:
                budget = train_s
            row = {
                "arm": arm, "seed": seed, "train_s": train_s, "eval_s": eval_s,
                "stopped_at": ("wall_clock" if budget is not None and arm != args.baseline
                               and train_s >= budget else "steps"),
                "steps": len(recs), "curve": curve,
                "final_accuracy": curve[-1]["accuracy"],
                "tokens": tokens,
                "rollout_s": sum(r["seconds_rollout"] for r in recs),
                "train_step_s": sum(r["seconds_train"] for r in recs),
                "long_rounds": sum(r["round_kind"] == "Long" for r in recs),
                "short_straggler_steps": sum(bool(r.get("straggler")) for r in recs
                                             if r["round_kind"] == "Short"),
                "trained_samples": sum(int(r.get("learner_samples", 0)) for r in recs),
                "group_sizes": sorted({r["group_size"] for r in recs}),
                "per_round_kind": tta.seconds_per_informative_group(recs),
                # each step as it ran: what a controller chose, what it cost, what it saw
                "by_step": [{"g": r["group_size"], "kind": r["round_kind"],
                             "rollout_s": round(r["seconds_rollout"], 3),
                             "s": round(r["seconds_rollout"] + r["seconds_reward"]
                                        + r["seconds_train"] + r["seconds_sync"], 3),
                             "mean": r["len_mean"], "med": r["len_median"], "p90": r["len_p90"],
                             "max": r["len_max"], "n": r["kept"],
                             "raced": r.get("overprovisioned"),
                             "near_cap": r.get("rounds_kept_near_cap"),
                             "informative": r.get("informative_groups")} for r in recs],
            }
            drv.close()
            _kill_actors(learners)
            curves[arm][seed] = curve
            rows.append(row)
            with (args.out / "bench-train.jsonl").open("a" if len(rows) > 1 else "w") as f:
                f.write(json.dumps(row) + "\n")
    result = tta.summarize(curves, args.baseline, target_evals, gain)
    result.update(manifest=str(args.manifest), seeds=args.seeds, eval_prompts=len(evalset),
                  eval_every=args.eval_every, start_accuracy=start_acc,
                  equal_wall_clock=equal,
                  mean={a: {k: statistics.mean(r[k] for r in rows if r["arm"] == a)
                            for k in ("train_s", "final_accuracy", "tokens", "rollout_s",
                                      "train_step_s", "long_rounds", "trained_samples")}
                        for a in arms})
    (args.out / "bench-train.json").write_text(json.dumps(result, indent=1) + "\n")
    plot_path = plot_time_to_accuracy(curves, args.out / "time-to-accuracy.png",
                                      title=f"{args.manifest.name}: held-out accuracy"
                                      f" ({len(evalset)} prompts)")
    print(format_tta(result))
    print(f"results: {args.out / 'bench-train.json'}  plot: {plot_path}")
    return 0


def _rescore(run: Path, baseline: str, target_evals: int, gain: float) -> int:
    """``bench-train --rescore DIR``: the table of a recorded run, from its rows' curves."""
    from rlpacer_trainer import tta

    path = run if run.suffix == ".jsonl" else run / "bench-train.jsonl"
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        print(f"error: --rescore {run}: no {path} (the folder a bench-train run wrote, its --out)")
        return 2
    except json.JSONDecodeError as err:
        print(f"error: --rescore {run}: {path} is not one JSON row a line ({err})")
        return 2
    curves: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for k, row in enumerate(rows, 1):
        try:
            curves.setdefault(str(row["arm"]), {})[int(row["seed"])] = row["curve"]
        except (KeyError, TypeError, ValueError) as err:
            print(f"error: --rescore {run}: row {k} of {path} lacks its arm, seed or curve"
                  f" ({err!r}): not a bench-train.jsonl")
            return 2
    if baseline not in curves:
        print(f"error: --baseline {baseline}: {path} has no such arm (it has"
              f" {', '.join(curves)})")
        return 2
    base_seeds = set(curves[baseline])
    # a run cut short: only the seeds the baseline finished, and arms with all of them
    curves = {a: {s: c for s, c in by.items() if s in base_seeds} for a, by in curves.items()}
    partial = {a: sorted(base_seeds - set(by)) for a, by in curves.items()
               if set(by) != base_seeds}
    for a, missing in partial.items():
        print(f"left out: {a} (no curve for seed {', '.join(map(str, missing))}, which"
              f" {baseline} has)")
    curves = {a: by for a, by in curves.items() if a not in partial}
    try:
        result = tta.summarize(curves, baseline, target_evals, gain)
    except ValueError as err:
        print(f"error: --rescore {run}: {err}")
        return 2
    print(format_tta(result))
    return 0


def _trl_row(cfg: Any, engines: list[Any], evalset: Any, *, arm: str, seed: int,
             budget: float | None, steps: int, eval_every: int, start_acc: float,
             out: Path) -> dict[str, Any]:
    """One seed of a ``trl<N>`` arm (:mod:`rlpacer_trainer.trl_arm`) as a bench-train row;
    a driver with no learner of its own in use scores its weights on the same engines."""
    from rlpacer_trainer import runtime, trl_arm

    drv = runtime.build_driver(cfg, engines)
    try:
        got = trl_arm.run(cfg, drv, evalset, group_size=int(cfg.fixed_group_size),
                          steps=steps, eval_every=eval_every, budget=budget,
                          start_accuracy=start_acc, out_dir=out, label=f"{arm} seed {seed}")
    finally:
        drv.close()
    curve = got["curve"]
    return {"arm": arm, "seed": seed, "train_s": got["train_s"], "eval_s": got["eval_s"],
            "stopped_at": ("wall_clock" if budget is not None and got["train_s"] >= budget
                           else "steps"),
            "steps": got["steps"], "curve": curve, "final_accuracy": curve[-1]["accuracy"],
            "tokens": got["tokens"], "rollout_s": got["rollout_s"],
            "train_step_s": got["train_s"] - got["rollout_s"], "long_rounds": 0,
            "short_straggler_steps": 0,
            "trained_samples": got["steps"] * int(cfg.spec.prompts_per_step)
            * int(cfg.fixed_group_size),
            "group_sizes": [int(cfg.fixed_group_size)], "per_round_kind": {},
            "trainer": f"trl {got['trl_version']}", "start_policy": got["start_policy"]}


def format_tta(result: dict[str, Any]) -> str:
    """The bench's table: per arm, time to the baseline's target (its final accuracy unless
    --target-evals or --target-gain says otherwise) and accuracy at the baseline's wall clock
    (paired across seeds, 95% intervals), and the ratio per seed."""
    b = result["baseline"]
    k = int(result.get("target_evals", 1))
    what = (f"{b}'s final accuracy" if k == 1
            else f"the mean of {b}'s last {k} evaluations")
    gain = float(result.get("gain_fraction", 1.0))
    if gain < 1.0:
        what = f"the warm start plus {100 * gain:g}% of {b}'s gain to {what}"
    lines = [f"time to accuracy against {b} (target: {what}, per seed)",
             f"{'arm':<10} {'reached':>7} {'time / ' + b:>22} {'acc delta at ' + b + ' wall':>28}"
             f" {'final acc':>9} {'train s':>8}  time / {b} per seed"]
    gains = result.get("baseline_gain", {})
    if gains and all(g <= 0 for g in gains.values()):
        lines.insert(1, f"warning: {b} did not improve on the warm start (gain per seed:"
                     f" {', '.join(f'{100 * g:+.1f} pt' for g in gains.values())}): its target"
                     " is the warm start's accuracy; train longer or use a task where RL learns")
    for arm, s in result["arms"].items():
        r = s["ratio_to_baseline"]
        ratio = "-" if r is None else f"{r['geomean']:.2f}x [{r['low']:.2f}, {r['high']:.2f}]"
        d = s["delta_at_baseline_wall"]
        delta = f"{100 * d['mean']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}] pt"
        per_seed = " ".join("-" if v["ratio_to_baseline"] is None
                            else f"{v['ratio_to_baseline']:.2f}"
                            for v in s.get("per_seed", {}).values())
        lines.append(f"{arm:<10} {s['reached_target']:>7} {ratio:>22} {delta:>28}"
                     f" {s['final_accuracy_mean']:>9.3f} {s['train_s_mean']:>8.1f}  {per_seed}")
    return "\n".join(lines)


def plot_time_to_accuracy(curves: dict[str, dict[int, list[dict[str, Any]]]], out: Path,
                          title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for k, (arm, by_seed) in enumerate(curves.items()):
        colour = f"C{k}"
        for j, (_seed, curve) in enumerate(sorted(by_seed.items())):
            ax.plot([p["train_s"] for p in curve], [p["accuracy"] for p in curve],
                    color=colour, marker="o", ms=3, alpha=0.8,
                    label=arm if j == 0 else None)
    ax.set_xlabel("training wall clock (s; evaluations excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
