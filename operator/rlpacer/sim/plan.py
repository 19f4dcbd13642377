"""``rlpacer plan``: capacity and straggler-SLO advice for a platform team, from a trace.

Given a response-length trace (a job's own ``trace.jsonl`` or a shipped one), a model and a
cluster (GPUs per node, nodes), it simulates the trace (``rlpacer bench``'s simulator and the
production planner and controllers) and prints what to put in the job and in the namespace's
RLTrainingPolicy:

* **A feasible straggler SLO.** For each straggler ratio tau in ``--taus``, the straggler rate
  ``p(G)`` that plain synchronous rounds at each candidate G give on this trace (the share of
  steps whose longest response exceeds tau x the median). An SLO (tau, delta) is feasible
  when some candidate G keeps ``p(G) <= delta``, and it *binds* (SAGC has a choice to make)
  when ``p(smallest G) <= delta < p(largest G)``. The advice is the smallest tau at which
  the SLO binds for ``--delta``; a ``--policy-tau`` (the tau the team has in mind) whose SLO
  no G can meet is called out.
* **Rollout capacity.** The model's GPUs per rollout engine (its tensor parallelism) and the
  cluster's GPUs left after the trainer (``--trainer-gpus``) give the most rollout replicas;
  each option (a quarter, half and all of them for short rounds; long rounds on the same, or
  scaled up to all of them) is simulated with SAGC + tail batching, and against fixed G=16 on
  the same replicas: wall clock, rollout GPU-hours and GPU-hours of the whole job.
* **The long round's size.** The advised option again with long rounds of 1, 2 and 4 steps'
  prompts and of all an epoch defers (``tailBatching.longRound.prompts``): fewer, larger
  long rounds (each lasts about as long as its longest response). The fastest is advised.

The cost model scales the simulator's 14B roofline (``rlpacer.sim.cost``) to the model: its
weights and KV bytes per token from the published Qwen2.5 configurations, decode on H100 80 GB
with the given tensor parallelism; the learner's time per trained token with the parameters
over the trainer's GPUs (the default scenario's is a 14B model's on about 8), the weight sync's
with the parameters. It is an estimate, not a measurement: use it to compare options, and check
the chosen one on the cluster (its step records and trace).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from typing import Any

from rlpacer.api.trace import Trace, TraceError
from rlpacer.control.sagc import GroupControlMode
from rlpacer.sim.bench import Policy, PolicyRun, run_policy
from rlpacer.sim.cost import CostProfile, gpu_profile
from rlpacer.sim.trace import TraceWorkload, load_trace, trace_scenario
from rlpacer.sim.workload import scenario

H100_BYTES = 80e9


#: ``rlpacer plan`` also tries each long-round size with this many steps' fresh prompts
#: beside its queued ones (``tailBatching.longRound.fillPrompts``)
FILL_STEPS = 8


@dataclass(frozen=True)
class Model:
    name: str
    params_b: float
    layers: int
    kv_heads: int
    head_dim: int
    tp: int
    """GPUs per rollout engine (tensor parallelism) by default."""

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16


# Qwen2.5 configurations (config.json of each published model).
MODELS: dict[str, Model] = {
    m.name: m for m in (
        Model("qwen2.5-7b", 7.6, 28, 4, 128, 1),
        Model("qwen2.5-14b", 14.8, 48, 8, 128, 2),
        Model("qwen2.5-32b", 32.8, 64, 8, 128, 4),
        Model("qwen2.5-72b", 72.7, 80, 8, 128, 8),
    )
}


def model_profile(model: Model, tp: int) -> CostProfile:
    """The 14B TP2 roofline (``rlpacer.sim.cost.gpu_profile``) scaled to ``model`` on ``tp``
    H100s: weight streaming, per-sequence compute and prefill with parameters per GPU, KV reads
    with KV bytes per token per GPU; the KV cache is what 90% of the GPUs' memory holds after
    the weights and 2 GB of activations per GPU."""
    ref, ref_model = gpu_profile(), MODELS["qwen2.5-14b"]
    per_gpu = (model.params_b / tp) / (ref_model.params_b / ref_model.tp)
    kv = (model.kv_bytes_per_token / tp) / (ref_model.kv_bytes_per_token / ref_model.tp)
    free = tp * (0.9 * H100_BYTES - 2e9) - 2.0 * model.params_b * 1e9
    if free <= 0:
        raise ValueError(f"{model.name} does not fit on {tp} H100 80 GB with room for a KV"
                         f" cache: give it more GPUs per engine (--tp)")
    return replace(
        ref,
        name=f"{model.name}-tp{tp}",
        base_s=ref.base_s * per_gpu,
        per_seq_s=ref.per_seq_s * per_gpu,
        per_kv_token_s=ref.per_kv_token_s * kv,
        kv_capacity_tokens=int(free / model.kv_bytes_per_token),
        prefill_s_per_token=ref.prefill_s_per_token * per_gpu,
        source=f"14B TP2 roofline scaled to {model.name} on {tp} H100 80 GB",
    )


def straggler_rates(
    runs: dict[int, PolicyRun], taus: list[float], kind: str | None = None
) -> dict[float, dict[int, float]]:
    """p(G) per tau from fixed-G runs: the share of steps (of round ``kind`` only, when
    given) whose longest kept response exceeds tau x their median."""
    out: dict[float, dict[int, float]] = {}
    for tau in taus:
        row = {}
        for g, r in runs.items():
            steps = [(m, med) for m, med, k in zip(r.max_len, r.median_len, r.kind, strict=True)
                     if kind is None or k == kind]
            row[g] = sum(m > tau * med for m, med in steps) / max(1, len(steps))
        out[tau] = row
    return out


def advise_tau(rates: dict[float, dict[int, float]], delta: float) -> float | None:
    """The smallest tau at which the SLO binds: p(smallest G) <= delta < p(largest G)."""
    for tau in sorted(rates):
        p = rates[tau]
        gs = sorted(p)
        if p[gs[0]] <= delta < p[gs[-1]]:
            return tau
    return None


def make_plan(
    trace: Trace, model: Model, *, nodes: int, gpus_per_node: int, trainer_gpus: int | None,
    tp: int | None, delta: float, taus: list[float], policy_tau: float | None, steps: int,
    seed: int, max_slowdown: float = 1.1,
) -> dict[str, Any]:
    tp = tp or model.tp
    total = nodes * gpus_per_node
    if trainer_gpus is None:
        trainer_gpus = max(1, total // 2)  # the learner: half the GPUs
    if not 1 <= trainer_gpus < total:
        raise ValueError(f"--trainer-gpus must be in [1, {total - 1}] ({total} GPUs in all,"
                         f" some left for rollout), got {trainer_gpus}")
    rollout_gpus = total - trainer_gpus
    max_engines = rollout_gpus // tp
    if max_engines < 1:
        raise ValueError(f"no rollout engine fits: {total} GPUs, {trainer_gpus} for the trainer,"
                         f" {tp} per engine; add nodes or lower --trainer-gpus")
    prof = model_profile(model, tp)
    base = replace(scenario("default"), cost_profile="gpu", gpus_per_engine=tp)
    scn, epochs = trace_scenario(base, trace, steps)
    # the default scenario's learner and weight-sync costs are a 14B model's on about 8 GPUs
    # (0.05 s per 1,000 trained tokens is 6 x 14.8e9 x 1,000 FLOP at ~40% of 8 H100s): scaled
    # with the parameters, and the learner's also with the trainer's GPUs
    size = model.params_b / MODELS["qwen2.5-14b"].params_b
    learn = size * 8.0 / trainer_gpus
    scn = replace(scn, profile_override=prof, train_s_per_ktok=scn.train_s_per_ktok * learn,
                  train_fixed_s=scn.train_fixed_s * learn, sync_s=scn.sync_s * size)
    wl = TraceWorkload(trace, epochs, seed)
    cands = scn.candidates
    mid = max(1, max_engines // 2)

    def sim(name: str, mode: GroupControlMode, g: int | None, tail: bool, short: int,
            long: int, tau: float) -> PolicyRun:
        s = replace(scn, engines=short, long_round_engines=long, tau=tau)
        return run_policy(s, Policy(name, mode, g, tail), seed, wl)

    plain = {g: sim(f"fixed{g}", GroupControlMode.FIXED, g, False, mid, mid, scn.tau)
             for g in cands}
    rates = straggler_rates(plain, taus)
    plain_tau = advise_tau(rates, delta)
    # With tail batching SAGC sees short rounds only, whose race cuts the tail: their own
    # p(G) per tau, from tail batching at each fixed G; the job's tau is chosen there.
    raced = {g: sim(f"tail{g}", GroupControlMode.FIXED, g, True, mid, mid, scn.tau)
             for g in cands}
    short_rates = straggler_rates(raced, taus, kind="Short")
    tau = advise_tau(short_rates, delta)
    feasible = {t: min(p.values()) <= delta for t, p in rates.items()}
    options = []
    shorts = sorted({max(1, max_engines // 4), mid, max_engines})
    for short in shorts:
        longs = sorted({short, max_engines})
        baseline = sim("fixed16", GroupControlMode.FIXED, 16, False, short, short, scn.tau)
        base_wall = float(sum(baseline.step_s))
        for long in longs:
            run = run_policy(
                replace(scn, engines=short, long_round_engines=long,
                        tail_tau=tau or scn.tail_tau),
                Policy("sagc_tail", GroupControlMode.SAGC, None, True), seed, wl)
            st = run.setups()
            kind = "elastic" if long > short else "small"
            wall = st[kind]["wall_clock_s"]
            rollout_gpu_h = st[kind]["rollout_gpu_s"] / 3600
            options.append({
                "rollout_replicas": short, "long_round_replicas": long,
                "wall_clock_h": wall / 3600, "rollout_gpu_h": rollout_gpu_h,
                "job_gpu_h": rollout_gpu_h + trainer_gpus * wall / 3600,
                "fixed16_wall_clock_h": base_wall / 3600,
                "fixed16_job_gpu_h": (short * tp + trainer_gpus) * base_wall / 3600,
                "speedup_vs_fixed16": base_wall / wall,
                "mean_group_size": float(sum(run.group_size) / len(run.group_size)),
                "long_rounds": run.kind.count("Long"),
                "step_s_p95": float(sorted(run.step_s)[int(0.95 * (len(run.step_s) - 1))]),
            })
    fastest = min(o["wall_clock_h"] for o in options)
    near = [o for o in options if o["wall_clock_h"] <= max_slowdown * fastest]
    best = min(near, key=lambda o: (o["job_gpu_h"], o["wall_clock_h"]))
    # the long round's size, on the advised replicas: 1, 2, 4 steps' prompts, and every
    # prompt of an epoch (so one long round an epoch, of what it deferred), each without and
    # with 8 steps' fresh prompts beside them (filled long rounds)
    p0 = scn.prompts_per_step
    sizes = sorted({min(k * p0, wl.num_prompts) for k in (1, 2, 4)} | {max(p0, wl.num_prompts)})
    fills = (0, FILL_STEPS * p0)
    short, long = best["rollout_replicas"], best["long_round_replicas"]
    base_wall = best["fixed16_wall_clock_h"] * 3600
    long_rounds = []
    for size, fill in ((s, f) for s in sizes for f in fills):
        run = run_policy(
            replace(scn, engines=short, long_round_engines=long, tail_tau=tau or scn.tail_tau,
                    long_round_prompts=size, long_round_fill=fill),
            Policy("sagc_tail", GroupControlMode.SAGC, None, True), seed, wl)
        kind = "elastic" if long > short else "small"
        wall = run.setups()[kind]["wall_clock_s"]
        long_rounds.append({
            "prompts": size, "fill": fill, "long_rounds": run.kind.count("Long"),
            "wall_clock_h": wall / 3600, "speedup_vs_fixed16": base_wall / wall,
            "step_s_p95": float(sorted(run.step_s)[int(0.95 * (len(run.step_s) - 1))]),
        })
    size_best = min(long_rounds, key=lambda o: (o["wall_clock_h"], o["prompts"], o["fill"]))
    return {
        "trace": trace.name, "model": model.name, "tp": tp, "nodes": nodes,
        "gpus_per_node": gpus_per_node, "trainer_gpus": trainer_gpus,
        "rollout_gpus": rollout_gpus, "max_rollout_replicas": max_engines,
        "prompts_per_step": scn.prompts_per_step, "steps": len(plain[cands[-1]].step_s),
        "delta": delta, "straggler_rates": _str_keys(rates),
        "short_round_straggler_rates": _str_keys(short_rates),
        "feasible": {f"{t:g}": ok for t, ok in feasible.items()},
        "advised_tau": tau, "advised_tau_without_tail_batching": plain_tau,
        "max_slowdown": max_slowdown,
        "policy_tau": policy_tau,
        "policy_tau_feasible": (None if policy_tau is None else _feasible_at(plain, policy_tau,
                                                                             delta)),
        "options": options, "advised": best,
        "long_round_sizes": long_rounds, "advised_long_round": size_best,
        "cost_profile": prof.source,
    }


def _str_keys(rates: dict[float, dict[int, float]]) -> dict[str, dict[str, float]]:
    return {f"{t:g}": {str(g): v for g, v in p.items()} for t, p in rates.items()}


def _feasible_at(plain: dict[int, PolicyRun], tau: float, delta: float) -> bool:
    return min(straggler_rates(plain, [tau])[tau].values()) <= delta


def _rate_table(title: str, table: dict[str, dict[str, float]], delta: float) -> list[str]:
    gs = sorted(int(g) for g in next(iter(table.values())))
    lines = [title, f"{'tau':>6}  " + "".join(f"{f'p({g})':>8}" for g in gs) + "  SLO"]
    for t, row in table.items():
        vals = [row[str(g)] for g in gs]
        if min(vals) > delta:
            verdict = "infeasible: no G meets it"
        elif vals[0] <= delta < vals[-1]:
            verdict = "binds (SAGC chooses G)"
        else:
            verdict = "met at every G (does not bind)"
        lines.append(f"{float(t):>6g}  " + "".join(f"{v:>8.2f}" for v in vals) + f"  {verdict}")
    return lines


def format_plan(p: dict[str, Any]) -> str:
    lines = [
        f"rlpacer plan: {p['model']} (TP {p['tp']}), {p['nodes']} x {p['gpus_per_node']} GPUs"
        f" ({p['trainer_gpus']} for the trainer, {p['rollout_gpus']} for rollout: at most"
        f" {p['max_rollout_replicas']} replicas); trace {p['trace']};"
        f" {p['steps']} steps x {p['prompts_per_step']} prompts",
        f"cost model: {p['cost_profile']} (an estimate)",
        "",
        *_rate_table(f"straggler rate p(G) per tau, plain rounds (no tail batching; delta"
                     f" {p['delta']:g}):", p["straggler_rates"], p["delta"]),
        "",
        *_rate_table("the same, short rounds of tail batching (what SAGC sees when tail"
                     " batching is on):", p["short_round_straggler_rates"], p["delta"]),
    ]
    tau = p["advised_tau"]
    lines.append("")
    if tau is None:
        lines.append(f"no tau in the list makes the SLO bind on short rounds at delta"
                     f" {p['delta']:g}: widen --taus or change --delta")
    else:
        lines.append(f"advised (tail batching on): groupControl.stragglerRatio {tau:g},"
                     f" targetStragglerRate {p['delta']:g}: the smallest tau at which the SLO"
                     " binds on short rounds")
    if p["advised_tau_without_tail_batching"] is not None:
        lines.append(f"(a job without tail batching: stragglerRatio"
                     f" {p['advised_tau_without_tail_batching']:g})")
    if p["policy_tau"] is not None and not p["policy_tau_feasible"]:
        lines.append(f"WARNING: an SLO at tau {p['policy_tau']:g} and delta {p['delta']:g} is"
                     " infeasible on this trace's plain rounds: every candidate G breaks it")
    lines += ["", "rollout options (SAGC + tail batching; fixed G=16 without tail batching on"
              " the same short-round replicas):",
              f"{'replicas':>9}{'long':>6}{'wall':>9}{'vs fixed16':>12}{'rollout GPU-h':>15}"
              f"{'job GPU-h':>11}{'fixed16 job GPU-h':>19}{'mean G':>8}{'p95 step':>10}"]
    for o in p["options"]:
        mark = "  <- advised" if o is p["advised"] else ""
        lines.append(
            f"{o['rollout_replicas']:>9}{o['long_round_replicas']:>6}{o['wall_clock_h']:>8.2f}h"
            f"{o['speedup_vs_fixed16']:>11.2f}x{o['rollout_gpu_h']:>15.1f}{o['job_gpu_h']:>11.1f}"
            f"{o['fixed16_job_gpu_h']:>19.1f}{o['mean_group_size']:>8.2f}"
            f"{o['step_s_p95']:>9.0f}s{mark}"
        )
    lines.append(f"(advised: the fewest job GPU-hours within {p['max_slowdown']:g}x the fastest"
                 " option's wall clock; job GPU-hours count the trainer's GPUs all run)")
    a, lr = p["advised"], p["advised_long_round"]
    lines += ["", f"long-round size on the advised replicas ({a['rollout_replicas']},"
              f" {a['long_round_replicas']} for long rounds; tailBatching.longRound.prompts,"
              " fillPrompts):",
              f"{'prompts':>9}{'fill':>6}{'long rounds':>13}{'wall':>9}{'vs fixed16':>12}"
              f"{'p95 step':>10}"]
    for o in p["long_round_sizes"]:
        mark = "  <- advised" if o is lr else ""
        lines.append(f"{o['prompts']:>9}{o.get('fill', 0):>6}{o['long_rounds']:>13}"
                     f"{o['wall_clock_h']:>8.2f}h{o['speedup_vs_fixed16']:>11.2f}x"
                     f"{o['step_s_p95']:>9.0f}s{mark}")
    peak = p["trainer_gpus"] + a["long_round_replicas"] * p["tp"]
    size = (f", prompts: {lr['prompts']}" if lr["prompts"] != p["prompts_per_step"] else "")
    if lr.get("fill"):
        size += f", fillPrompts: {lr['fill']}"
    lines += ["", "job (RLTrainingJob spec):",
              f"  rollout: {{replicas: {a['rollout_replicas']}, gpusPerReplica: {p['tp']},"
              f" tensorParallelSize: {p['tp']}}}",
              f"  tailBatching: {{enabled: true, longRound: {{rolloutReplicas:"
              f" {a['long_round_replicas']}{size}}}}}"]
    if tau is not None:
        lines.append(f"  groupControl: {{mode: SAGC, stragglerRatio: \"{tau:g}\","
                     f" targetStragglerRate: \"{p['delta']:g}\"}}")
    lines += ["namespace policy (RLTrainingPolicy spec):",
              f"  stragglerSLO: {{maxTargetStragglerRate: \"{p['delta']:g}\"}}",
              f"  stepTimeSLO: {{maxSeconds: {math.ceil(1.5 * lr['step_s_p95'])}}}"
              "   # 1.5x the simulated p95 step",
              f"  longRounds: {{maxRolloutReplicas: {a['long_round_replicas']}, maxGPUs: {peak}}}"]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        trace = load_trace(args.trace)
    except TraceError as err:
        print(f"error: --trace: {err}", file=sys.stderr)
        return 2
    model = MODELS[args.model]
    for flag, v, low in (("--nodes", args.nodes, 1), ("--gpus-per-node", args.gpus_per_node, 1),
                         ("--steps", args.steps, 1)):
        if v < low:
            print(f"error: {flag} must be >= {low}, got {v}", file=sys.stderr)
            return 2
    if not 0.0 < args.delta < 1.0:
        print(f"error: --delta must be in (0, 1), got {args.delta}", file=sys.stderr)
        return 2
    if args.max_slowdown < 1.0:
        print("error: --max-slowdown must be >= 1", file=sys.stderr)
        return 2
    if any(t < 1.0 for t in args.taus):
        print("error: --taus must all be >= 1 (max > tau x median)", file=sys.stderr)
        return 2
    try:
        plan = make_plan(trace, model, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                         trainer_gpus=args.trainer_gpus, tp=args.tp, delta=args.delta,
                         taus=sorted(args.taus), policy_tau=args.policy_tau, steps=args.steps,
                         seed=args.seed, max_slowdown=args.max_slowdown)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(plan, fh, indent=2)
            fh.write("\n")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="capacity and straggler-SLO advice for a job and its namespace, from a trace",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", required=True, metavar="FILE",
                   help="a job's trace.jsonl or a veRL length trace (traces/*.jsonl)")
    p.add_argument("--model", default="qwen2.5-14b", choices=sorted(MODELS))
    p.add_argument("--tp", type=int, default=None,
                   help="GPUs per rollout engine (default: the model's: 7b 1, 14b 2, 32b 4, 72b 8)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--trainer-gpus", type=int, default=None,
                   help="GPUs the trainer holds (default: half of them)")
    p.add_argument("--delta", type=float, default=0.2, help="the straggler target (default 0.2)")
    p.add_argument("--taus", type=float, nargs="+", default=[1.5, 2, 3, 4, 8, 16, 32],
                   help="straggler ratios to evaluate")
    p.add_argument("--max-slowdown", type=float, default=1.1,
                   help="the advised option is the cheapest within this factor of the fastest")
    p.add_argument("--policy-tau", type=float, default=None,
                   help="a tau the team has in mind: called out when its SLO is infeasible")
    p.add_argument("--steps", type=int, default=200, help="fixed-G=16 steps to simulate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the plan as JSON")
    p.set_defaults(func=main)
