"""``rlpacer bench-pool``: K RL jobs sharing a cluster's burst pool for their long rounds.

Each job runs SAGC + tail batching (``sagc_tail``, rlpacer.sim.bench): short rounds on its own
``engines`` rollout replicas (``rollout.replicas``), and now and then a long round, for which
the operator asks for ``long_round_engines - engines`` extra replicas. Its schedule (rounds,
prompts, G, kept responses, the non-rollout seconds) is computed once with the production
:class:`~rlpacer.control.plan.JobController` and
:class:`~rlpacer.control.tail_batching.TailBatchingPlanner`, as ``run_policy`` does; a long
round keeps every response, so its schedule does not depend on timing, and the round is
re-simulated (rlpacer.sim.rollout, on a copy of the planner taken at its start) with the
replicas and join time it gets. Three set-ups, on a cluster of the same size (the large
sizing: the sum over jobs of ``long_round_engines x gpus_per_engine``):

    large   every job holds ``long_round_engines`` replicas all run (long rounds spread over
            all of them from the start; short rounds run on ``engines``, the rest idle)
    small   every job holds ``engines`` replicas; long rounds run on them
    pool    every job holds ``engines``; a shared pool of P replicas (``--pool-replicas``,
            default the largest job's extra: one request's worth) serves the long rounds'
            extra replicas

The pool, a discrete-event co-simulation of the K jobs:

* A job asks for its extra replicas at the step report before a long round (the round starts
  at once on its own replicas). A request is granted whole when that many pool replicas are
  free. A request larger than the whole pool is cut to the pool's size (otherwise it could
  never be granted; a job then gets fewer extra replicas than it asked for).
* Waiting requests are served strictly in order (the first that does not fit blocks the
  others, as Kueue's StrictFIFO), in rlpacer's pool order (docs/kueue.md: the operator holds
  lower-priority long rounds back, Kueue orders the rest): higher priority first, then, with
  admission fair sharing on the pool's ClusterQueue (the default; ``--no-fair-share`` turns
  it off), the namespace (one LocalQueue each) that has used the pool least, then arrival
  (then the job's order). A namespace's usage is Kueue's: the pool
  replicas it holds, decayed with a half-life (``--usage-half-life-s``; Kueue's
  ``usageHalfLifeTime``), plus an entry penalty at each grant (the request times
  ``1 - 0.5 ** (sampling / half-life)``, Kueue's, with ``usageSamplingInterval`` 5 min), taken
  continuously here where Kueue samples. Reports at the same instant are all taken in before
  replicas are handed out.
* Granted replicas join ``scale_up_s`` after the grant: mid-round if the round is running
  (the round simulator's ``join_at``: they take a share of the unfinished requests), from the
  start of a later consecutive long round if they are ready by then (the round spreads over
  all of them), and not at all if the round's rollout ends first.
* Replicas go back to the pool at the report of the job's last consecutive long round (end
  of its step: reward, train and sync included). A request still waiting then is withdrawn:
  its long rounds ran on the job's own replicas. One job alone on a pool of its extra
  replicas is exactly ``rlpacer bench``'s elastic set-up.
* Short rounds never depend on the pool: they take the same seconds in every set-up.

GPU-hours held: the replicas each job holds x the time held x ``gpus_per_engine``; for the
pool, a job's own replicas all run plus pool replicas from grant to release (the pool's idle
replicas are reported apart, as the pool's reserved GPU-hours: P x makespan x GPUs).
Utilisation: GPU-seconds held / (cluster GPUs x makespan). Pool wait: seconds from request to
grant (to withdrawal for a request never granted). The target (the issue's): every job's pool
wall clock within 10% of its large-sizing wall clock, with at least 30% fewer GPU-hours held
than the large sizing; reported as measured, nothing is tuned to it.

Not modelled: the planner deferring a long round while the pool is busy (the job's long round
always starts at once); admission latency beyond ``scale_up_s`` (Kueue, node autoscaling); the
scale-up timeout; preemption of granted replicas; jobs starting at different times; a longer
weight sync with more engines. Every job of a run must have the same GPUs per replica.

Jobs (``--jobs SPEC``, repeatable; ``SPEC`` is ``key=value`` pairs joined by commas):
``name``, ``namespace``, ``priority`` (higher first), ``seed``, ``scenario`` (a name of
rlpacer.sim.workload.SCENARIOS: the cluster, costs and, without a trace, the lengths) and
``trace`` (a recorded trace, rlpacer.sim.trace: a path, or relative to the repository). With a
trace, ``--steps`` gives the trace's epochs as in ``rlpacer bench --trace``: enough for at least
``steps x prompts_per_step`` prompts (the DAPO trace: 576 prompts an epoch).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlpacer.api.trace import Trace, TraceError
from rlpacer.control.tail_batching import RoundKind, TailBatchingPlanner
from rlpacer.sim.bench import job_run_parts, policies, step_report, step_updates
from rlpacer.sim.rollout import RoundSimulator
from rlpacer.sim.trace import TraceWorkload, load_trace, trace_scenario
from rlpacer.sim.workload import SCENARIOS, Scenario, Workload, scenario

POLICY = "sagc_tail"
SETUPS = ("large", "small", "pool")
# The target for the pool against the large sizing: every job's wall clock within
# 10%, at least 30% fewer rollout GPU-hours held.
TARGET_WALL_SLACK = 0.10
TARGET_GPU_SAVING = 0.30
DEFAULT_STEPS = 200
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_JOBS = (
    "name=a0,namespace=team-a,scenario=default,seed=0",
    "name=a1,namespace=team-a,scenario=default,seed=1",
    "name=b2,namespace=team-b,scenario=default,seed=2",
    "name=dapo,namespace=team-c,priority=1,trace=traces/dapo-qwen2.5-32b.jsonl,seed=0",
)
_EPS = 1e-9


# --- one job's schedule ------------------------------------------------------------------

@dataclass
class _LongRound:
    """What re-running a long round with other replicas needs (a copy of the planner taken at
    the round's start, its prompts and lengths) and the outcomes already computed."""

    planner: TailBatchingPlanner
    prompts: list[int]
    lengths: list[list[int]]
    kept: list[int]
    cache: dict[tuple[int, float], float] = field(default_factory=dict)


@dataclass
class Step:
    long: bool
    """A long round that asks for extra replicas (tail batching's LONG with extra > 0)."""
    rollout_s: float
    """Rollout seconds on the job's own ``engines`` replicas."""
    rest_s: float
    """Reward + train + sync seconds."""
    rollout_large_s: float
    """Rollout seconds with ``long_replicas`` from the start (the short rollout for a short
    round: short rounds run on ``engines`` in every set-up)."""
    round: _LongRound | None = None


@dataclass
class JobSchedule:
    """One job's steps under ``sagc_tail``, and its long rounds' rollout on other pools."""

    scenario: str
    engines: int
    long_replicas: int
    gpus_per_replica: int
    scale_up_s: float
    steps: list[Step]
    prompts_trained: int
    sim: RoundSimulator
    simulated_rounds: int = 0
    """Long-round re-simulations run for the pool so far (cache misses)."""

    @property
    def extra(self) -> int:
        return self.long_replicas - self.engines

    def rollout_s(self, i: int, extra: int, join_at: float | None) -> float:
        """Step ``i``'s rollout seconds with ``extra`` more replicas ready ``join_at`` seconds
        into the round (<= 0: there from its start; None or ``extra`` 0: never)."""
        st = self.steps[i]
        lr = st.round
        if lr is None or extra <= 0 or join_at is None or join_at >= st.rollout_s:
            return st.rollout_s
        if join_at <= 0.0:
            if extra == self.extra:
                return st.rollout_large_s
            join_at = 0.0
        key = (extra, join_at)
        hit = lr.cache.get(key)
        if hit is not None:
            return hit
        planner = copy.deepcopy(lr.planner)
        if join_at == 0.0:
            oc = self.sim.run(planner, lr.prompts, lr.lengths, self.engines + extra)
        else:
            oc = self.sim.run(planner, lr.prompts, lr.lengths, join_engines=extra,
                              join_at=join_at)
        if sorted(oc.kept_lengths) != lr.kept:
            raise RuntimeError("a long round kept different responses on another pool")
        self.simulated_rounds += 1
        lr.cache[key] = oc.rollout_s
        return oc.rollout_s

    def wall_s(self, setup: str) -> float:
        """Wall clock of the ``small`` or ``large`` set-up (the steps one after another)."""
        t = 0.0
        for st in self.steps:
            t += (st.rollout_large_s if setup == "large" else st.rollout_s) + st.rest_s
        return t


def build_schedule(
    scn: Scenario, seed: int, workload: Workload | TraceWorkload | None = None
) -> JobSchedule:
    """Train the workload's whole dataset under ``sagc_tail`` once (as
    rlpacer.sim.bench.run_policy) and keep what the pool co-simulation needs per step."""
    pol = {p.name: p for p in policies()}[POLICY]
    parts = job_run_parts(scn, pol, seed, workload)
    jc, planner, sim = parts.jc, parts.planner, parts.sim
    long_r = max(scn.engines, scn.long_round_engines)
    extra = long_r - scn.engines
    steps: list[Step] = []
    plan = jc.plan()
    step = 0
    while not planner.done:
        g = plan.group_size
        rp = planner.start_round(g)
        lengths = parts.lengths(rp)
        long_round = rp.kind is RoundKind.LONG and extra > 0
        saved = copy.deepcopy(planner) if long_round else None
        large_planner = copy.deepcopy(planner) if long_round else None
        oc = sim.run(planner, rp.prompts, lengths)
        rollout_large = oc.rollout_s
        lr = None
        if long_round:
            assert saved is not None and large_planner is not None
            kept_sorted = sorted(oc.kept_lengths)
            oc_large = sim.run(large_planner, rp.prompts, lengths, long_r)
            if sorted(oc_large.kept_lengths) != kept_sorted:
                raise RuntimeError("a long round kept different responses on another pool")
            rollout_large = oc_large.rollout_s
            lr = _LongRound(saved, list(rp.prompts), lengths, kept_sorted)
        res = planner.finish_round()
        report = step_report(scn, step, g, rp.kind, oc, res.aborted_responses, planner,
                             step_updates(scn, rp))
        plan = jc.observe(report)
        rest = report.seconds.reward + report.seconds.train + report.seconds.sync
        steps.append(Step(long_round, oc.rollout_s, rest, rollout_large, lr))
        step += 1
    return JobSchedule(
        scenario=scn.name, engines=scn.engines, long_replicas=long_r,
        gpus_per_replica=scn.gpus_per_engine, scale_up_s=scn.scale_up_s, steps=steps,
        prompts_trained=planner.consumed, sim=sim,
    )


# --- the co-simulation ---------------------------------------------------------------------

@dataclass
class PoolJob:
    name: str
    namespace: str
    priority: int
    schedule: JobSchedule
    workload: str = ""
    """What the job replays, for the report."""


@dataclass
class JobRun:
    """One job's run in one set-up."""

    wall_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    join_s: list[float | None] = field(default_factory=list)
    """Per step: seconds into the round when pool replicas joined (<= 0: from the start;
    None: a short round, or none took work in it)."""
    requests: int = 0
    cut: int = 0
    """Requests cut to the pool's size (the job's extra is larger than the whole pool)."""
    granted: int = 0
    granted_replicas: list[int] = field(default_factory=list)
    waits_s: list[float] = field(default_factory=list)
    """Request to grant, or to withdrawal for a request never granted."""
    withdrawn: int = 0
    long_rounds: int = 0
    long_rounds_ungranted: int = 0
    """Long rounds that ended with the job's request still waiting."""
    long_rounds_unjoined: int = 0
    """Long rounds in which no pool replica took work (not granted, or not ready in time)."""
    pool_replica_s: float = 0.0
    """Pool replicas x seconds held (grant to release)."""


@dataclass(frozen=True)
class Contention:
    """The order waiting requests are served in (module doc): rlpacer's pool order,
    priority first, then Kueue's admission fair sharing (or not), then arrival."""

    fair_share: bool = True
    half_life_s: float = 3600.0
    sampling_s: float = 300.0

    def __post_init__(self) -> None:
        if not (0.0 < self.half_life_s < math.inf):
            raise ValueError(f"usage half-life must be > 0 and finite, got {self.half_life_s}")
        if not (0.0 < self.sampling_s < math.inf):
            raise ValueError(f"usage sampling must be > 0 and finite, got {self.sampling_s}")

    def describe(self) -> str:
        if not self.fair_share:
            return "priority, then arrival (no fair sharing)"
        return (f"priority, then fair share by namespace (usage half-life"
                f" {self.half_life_s:g} s), then arrival")


@dataclass
class _Request:
    job: int
    size: int
    t_request: float
    seq: int
    t_grant: float | None = None


def _fixed(jobs: Sequence[PoolJob], setup: str) -> list[JobRun]:
    out = []
    for job in jobs:
        run = JobRun()
        for st in job.schedule.steps:
            r = st.rollout_large_s if setup == "large" else st.rollout_s
            run.step_s.append(r + st.rest_s)
            run.join_s.append(0.0 if setup == "large" and st.long else None)
            run.long_rounds += st.long
        run.wall_s = job.schedule.wall_s(setup)
        out.append(run)
    return out


def simulate_pool(jobs: Sequence[PoolJob], pool_replicas: int,
                  contention: Contention | None = None) -> list[JobRun]:
    """The ``pool`` set-up: every job from time 0, long rounds' extra replicas from a shared
    pool of ``pool_replicas`` (module doc: requests, contention rule, joins, release)."""
    rule = contention or Contention()
    if pool_replicas < 0:
        raise ValueError(f"pool_replicas must be >= 0, got {pool_replicas}")
    k = len(jobs)
    runs = [JobRun() for _ in jobs]
    idx = [0] * k
    start = [0.0] * k
    end = [0.0] * k
    dur = [0.0] * k  # the current step's seconds
    req: list[_Request | None] = [None] * k
    active = set(range(k))
    free = pool_replicas
    held_by_ns: dict[str, int] = {job.namespace: 0 for job in jobs}
    usage: dict[str, float] = dict.fromkeys(held_by_ns, 0.0)  # Kueue's decayed usage
    usage_t = 0.0
    penalty = 1.0 - 0.5 ** (rule.sampling_s / rule.half_life_s)
    waiting: list[_Request] = []
    seq = 0

    def decay(t: float) -> None:
        """Each namespace's usage relaxes toward the replicas it holds (held since the last
        call), with the half-life: Kueue's moving average, taken continuously."""
        nonlocal usage_t
        f = 0.5 ** ((t - usage_t) / rule.half_life_s)
        for ns, h in held_by_ns.items():
            usage[ns] = h + (usage[ns] - h) * f
        usage_t = t

    def order(q: _Request) -> tuple[int, float, float, int]:
        share = usage[jobs[q.job].namespace] if rule.fair_share else 0.0
        return (-jobs[q.job].priority, share, q.t_request, q.seq)

    def join_at(j: int) -> float | None:
        r = req[j]
        if r is None or r.t_grant is None:
            return None
        return r.t_grant + jobs[j].schedule.scale_up_s - start[j]

    def set_end(j: int) -> None:
        sched = jobs[j].schedule
        st = sched.steps[idx[j]]
        r = req[j]
        rollout = st.rollout_s
        if st.long and r is not None:
            rollout = sched.rollout_s(idx[j], r.size, join_at(j))
        dur[j] = rollout + st.rest_s
        end[j] = start[j] + dur[j]

    def begin(j: int, t: float) -> None:
        nonlocal seq
        start[j] = t
        sched = jobs[j].schedule
        if sched.steps[idx[j]].long and req[j] is None and pool_replicas > 0:
            # the report before this round asked for the extra replicas
            req[j] = r = _Request(j, min(sched.extra, pool_replicas), t, seq)
            seq += 1
            waiting.append(r)
            runs[j].requests += 1
            runs[j].cut += r.size < sched.extra
        set_end(j)

    def allocate(t: float) -> None:
        nonlocal free
        decay(t)
        while waiting:
            r = min(waiting, key=order)
            if r.size > free:
                break  # strict order: the first request that does not fit blocks the rest
            waiting.remove(r)
            free -= r.size
            held_by_ns[jobs[r.job].namespace] += r.size
            usage[jobs[r.job].namespace] += r.size * penalty  # Kueue's entry penalty
            r.t_grant = t
            run = runs[r.job]
            run.granted += 1
            run.granted_replicas.append(r.size)
            run.waits_s.append(t - r.t_request)
            set_end(r.job)  # the job is in a long round: its replicas join it
            if end[r.job] < t - _EPS:
                raise RuntimeError("a grant moved a round's end into the past")

    def finish(j: int, t: float) -> None:
        nonlocal free
        sched = jobs[j].schedule
        i = idx[j]
        st = sched.steps[i]
        run = runs[j]
        run.step_s.append(dur[j])
        r = req[j]
        if st.long:
            run.long_rounds += 1
            ja = join_at(j)
            if r is not None and r.t_grant is None:
                run.long_rounds_ungranted += 1
            joined = ja is not None and ja < st.rollout_s
            run.join_s.append(ja if joined else None)
            run.long_rounds_unjoined += not joined
        else:
            run.join_s.append(None)
        last = i + 1 == len(sched.steps)
        if r is not None and (last or not sched.steps[i + 1].long):
            # the report of the last consecutive long round: give back, or withdraw
            if r.t_grant is None:
                waiting.remove(r)
                run.withdrawn += 1
                run.waits_s.append(t - r.t_request)
            else:
                decay(t)
                free += r.size
                held_by_ns[jobs[j].namespace] -= r.size
                run.pool_replica_s += r.size * (t - r.t_grant)
            req[j] = None
        idx[j] += 1
        if last:
            run.wall_s = t
            active.discard(j)
        else:
            begin(j, t)

    for j in range(k):
        begin(j, 0.0)
    allocate(0.0)
    while active:
        t = min(end[j] for j in active)
        for j in sorted(j for j in active if end[j] == t):
            finish(j, t)
        allocate(t)
    if free != pool_replicas or waiting:
        raise RuntimeError("the pool did not get all its replicas back")
    return runs


# --- the report ----------------------------------------------------------------------------

def _gpu_s(job: PoolJob, run: JobRun, setup: str) -> tuple[float, float]:
    """(own replicas' GPU-seconds, pool replicas' GPU-seconds) held by ``job``."""
    s = job.schedule
    own = (s.long_replicas if setup == "large" else s.engines) * s.gpus_per_replica * run.wall_s
    return own, run.pool_replica_s * s.gpus_per_replica


def run_pool_bench(
    jobs: Sequence[PoolJob], pool_replicas: int | None = None,
    contention: Contention | None = None,
) -> tuple[dict[str, Any], dict[str, list[JobRun]]]:
    """The three set-ups of ``jobs``; returns (the JSON report, the per-job runs)."""
    rule = contention or Contention()
    if not jobs:
        raise ValueError("no jobs")
    gpus = {job.schedule.gpus_per_replica for job in jobs}
    if len(gpus) != 1:
        raise ValueError(f"every job must have the same GPUs per replica, got {sorted(gpus)}")
    gpr = gpus.pop()
    pool = max(job.schedule.extra for job in jobs) if pool_replicas is None else pool_replicas
    runs = {"large": _fixed(jobs, "large"), "small": _fixed(jobs, "small"),
            "pool": simulate_pool(jobs, pool, rule)}
    cluster_gpus = sum(job.schedule.long_replicas * gpr for job in jobs)
    large_walls = [r.wall_s for r in runs["large"]]
    setups: dict[str, Any] = {}
    for name in SETUPS:
        rows = []
        own_total = pool_total = 0.0
        for job, run, base in zip(jobs, runs[name], large_walls, strict=True):
            own, from_pool = _gpu_s(job, run, name)
            own_total += own
            pool_total += from_pool
            row: dict[str, Any] = {
                "name": job.name, "namespace": job.namespace, "priority": job.priority,
                "workload": job.workload, "steps": len(run.step_s),
                "long_rounds": run.long_rounds,
                "replicas_held": (job.schedule.long_replicas if name == "large"
                                  else job.schedule.engines),
                "wall_clock_s": run.wall_s, "wall_vs_large": run.wall_s / base,
                "rollout_gpu_h": (own + from_pool) / 3600.0,
            }
            if name == "pool":
                row.update(
                    requests=run.requests, cut=run.cut, granted=run.granted,
                    granted_replicas=run.granted_replicas, withdrawn=run.withdrawn,
                    wait_sum_s=float(sum(run.waits_s)),
                    wait_max_s=float(max(run.waits_s, default=0.0)),
                    long_rounds_ungranted=run.long_rounds_ungranted,
                    long_rounds_unjoined=run.long_rounds_unjoined,
                    pool_replica_h=run.pool_replica_s / 3600.0,
                )
            rows.append(row)
        makespan = max(r.wall_s for r in runs[name])
        held = own_total + pool_total
        out: dict[str, Any] = {
            "jobs": rows, "makespan_s": makespan, "rollout_gpu_h": held / 3600.0,
            "own_gpu_h": own_total / 3600.0, "utilisation": held / (cluster_gpus * makespan),
        }
        if name == "pool":
            reserved = pool * gpr * makespan
            out.update(
                pool_replicas=pool, pool_granted_gpu_h=pool_total / 3600.0,
                pool_reserved_gpu_h=reserved / 3600.0,
                footprint_gpu_h=(own_total + reserved) / 3600.0,
                pool_utilisation=pool_total / reserved if reserved > 0 else 0.0,
            )
        setups[name] = out
    large_h, pool_st = setups["large"]["rollout_gpu_h"], setups["pool"]
    worst = max(r["wall_vs_large"] for r in pool_st["jobs"])
    gpu_ratio = pool_st["rollout_gpu_h"] / large_h
    report = {
        "policy": POLICY,
        "jobs": len(jobs),
        "gpus_per_replica": gpr,
        "cluster_gpus": cluster_gpus,
        "pool_replicas": pool,
        "contention": rule.describe(),
        "scale_up_s": sorted({job.schedule.scale_up_s for job in jobs}),
        "setups": setups,
        "target": {
            "wall_ratio_max": 1.0 + TARGET_WALL_SLACK,
            "gpu_h_ratio_max": 1.0 - TARGET_GPU_SAVING,
            "worst_wall_vs_large": worst,
            "gpu_h_vs_large": gpu_ratio,
            "footprint_gpu_h_vs_large": pool_st["footprint_gpu_h"] / large_h,
            "met": bool(worst <= 1.0 + TARGET_WALL_SLACK
                        and gpu_ratio <= 1.0 - TARGET_GPU_SAVING),
        },
    }
    return report, runs


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds:.0f} s"


def format_report(report: dict[str, Any]) -> str:
    gpr = report["gpus_per_replica"]
    pool = report["pool_replicas"]
    lines = [
        f"{report['jobs']} jobs ({report['policy']}), {gpr} GPUs per replica, cluster"
        f" {report['cluster_gpus']} GPUs (the large sizing); scale-up"
        f" {'/'.join(f'{s:g}' for s in report['scale_up_s'])} s; pool {pool} replicas",
        f"pool order: {report['contention']}",
    ]
    titles = {
        "large": "large: every job holds its long-round replicas all run",
        "small": "small: every job holds its own replicas only; long rounds run on them",
        "pool": f"pool: every job holds its own replicas; {pool} shared replicas serve long"
                " rounds",
    }
    for name in SETUPS:
        st = report["setups"][name]
        head = (f"{'job':<8}{'namespace':<11}{'prio':>5}{'held':>5}{'steps':>6}{'long':>5}"
                f"{'wall':>10}{'vs large':>10}{'GPU-h':>8}")
        if name == "pool":
            head += (f"{'wait sum':>10}{'wait max':>10}{'req':>5}{'cut':>4}{'wdrn':>5}"
                     f"{'no grant':>9}{'no join':>8}")
        lines += ["", titles[name], head, "-" * len(head)]
        for r in st["jobs"]:
            line = (f"{r['name']:<8}{r['namespace']:<11}{r['priority']:>5}"
                    f"{r['replicas_held']:>5}{r['steps']:>6}{r['long_rounds']:>5}"
                    f"{_hours(r['wall_clock_s']):>10}{r['wall_vs_large']:>9.3f}x"
                    f"{r['rollout_gpu_h']:>8.1f}")
            if name == "pool":
                line += (f"{r['wait_sum_s']:>9.0f}s{r['wait_max_s']:>9.0f}s{r['requests']:>5}"
                         f"{r['cut']:>4}{r['withdrawn']:>5}{r['long_rounds_ungranted']:>9}"
                         f"{r['long_rounds_unjoined']:>8}")
            lines.append(line)
        summary = (f"rollout GPU-h held {st['rollout_gpu_h']:.1f}, makespan"
                   f" {_hours(st['makespan_s'])}, utilisation {st['utilisation']:.3f}")
        if name == "pool":
            summary += (f" (own replicas {st['own_gpu_h']:.1f} + pool granted"
                        f" {st['pool_granted_gpu_h']:.1f}); pool reserved"
                        f" {st['pool_reserved_gpu_h']:.1f} GPU-h, in use"
                        f" {st['pool_utilisation']:.3f}; own + reserved"
                        f" {st['footprint_gpu_h']:.1f}")
        lines.append(summary)
    tg = report["target"]
    verdict = "met" if tg["met"] else "NOT met"
    lines += [
        "",
        f"target (pool: every job within {tg['wall_ratio_max']:.2f}x its large wall clock,"
        f" GPU-h held <= {tg['gpu_h_ratio_max']:.2f}x large): {verdict}: worst job"
        f" {tg['worst_wall_vs_large']:.3f}x, GPU-h {tg['gpu_h_vs_large']:.3f}x large"
        f" (own + the pool's reserved GPU-h: {tg['footprint_gpu_h_vs_large']:.3f}x)",
    ]
    return "\n".join(lines)


# --- the command line ----------------------------------------------------------------------

@dataclass(frozen=True)
class JobSpec:
    name: str
    namespace: str
    priority: int = 0
    seed: int = 0
    scenario: str = "default"
    trace: str | None = None


_SPEC_KEYS = ("name", "namespace", "priority", "seed", "scenario", "trace")


def parse_job_spec(text: str, index: int) -> JobSpec:
    """``key=value,...`` (module doc); defaults: name ``job<index>``, namespace
    ``team-<index>``, priority 0, seed ``index``, scenario ``default``, no trace."""
    vals: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not value:
            raise ValueError(f"{part!r} is not key=value")
        if key not in _SPEC_KEYS:
            raise ValueError(f"unknown key {key!r}; expected one of {list(_SPEC_KEYS)}")
        if key in vals:
            raise ValueError(f"{key!r} given twice")
        vals[key] = value
    ints: dict[str, int] = {}
    for key in ("priority", "seed"):
        if key in vals:
            try:
                ints[key] = int(vals[key])
            except ValueError:
                raise ValueError(f"{key} must be an integer, got {vals[key]!r}") from None
    scn = vals.get("scenario", "default")
    if scn not in SCENARIOS:
        raise ValueError(f"unknown scenario {scn!r}; expected one of {sorted(SCENARIOS)}")
    return JobSpec(
        name=vals.get("name", f"job{index}"), namespace=vals.get("namespace", f"team-{index}"),
        priority=ints.get("priority", 0), seed=ints.get("seed", index), scenario=scn,
        trace=vals.get("trace"),
    )


def resolve_trace(path: str) -> Path:
    """``path`` as given if it exists, else relative to the repository."""
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    in_repo = REPO_ROOT / p
    return in_repo if in_repo.exists() else p


def make_job(
    spec: JobSpec, steps: int, long_round_replicas: int | None = None,
    scale_up_s: float | None = None, traces: dict[Path, Trace] | None = None,
) -> PoolJob:
    """A job's schedule from its spec (raises ValueError or TraceError)."""
    scn = scenario(spec.scenario).with_steps(steps).with_elastic(long_round_replicas,
                                                                 scale_up_s)
    wl: Workload | TraceWorkload
    if spec.trace is None:
        wl = Workload(scn, scn.steps * scn.prompts_per_step, spec.seed)
        what = f"{scn.name} seed {spec.seed}"
    else:
        path = resolve_trace(spec.trace)
        cache = {} if traces is None else traces
        trace = cache.get(path)
        if trace is None:
            trace = cache[path] = load_trace(path)
        scn, epochs = trace_scenario(scn, trace, steps)
        wl = TraceWorkload(trace, epochs, spec.seed)
        what = f"trace {path.name} x{epochs} seed {spec.seed}"
    return PoolJob(spec.name, spec.namespace, spec.priority,
                   build_schedule(scn, spec.seed, wl), what)


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    if args.steps < 1:
        return _error(f"--steps must be >= 1, got {args.steps}")
    if args.pool_replicas is not None and args.pool_replicas < 0:
        return _error(f"--pool-replicas must be >= 0, got {args.pool_replicas}")
    if args.long_round_replicas is not None and args.long_round_replicas < 1:
        return _error(f"--long-round-replicas must be >= 1, got {args.long_round_replicas}")
    if args.scale_up_s is not None and not 0.0 <= args.scale_up_s < math.inf:
        return _error(f"--scale-up-s must be finite and >= 0, got {args.scale_up_s}")
    try:
        contention = Contention(not args.no_fair_share, args.usage_half_life_s)
    except ValueError as err:
        return _error(f"--usage-half-life-s: {err}")
    texts = args.jobs or list(DEFAULT_JOBS)
    specs = []
    for i, text in enumerate(texts):
        try:
            specs.append(parse_job_spec(text, i))
        except ValueError as err:
            return _error(f"--jobs {text!r}: {err}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        return _error(f"--jobs: job names must be unique, got {names}")
    t0 = time.perf_counter()
    traces: dict[Path, Trace] = {}
    jobs = []
    for spec, text in zip(specs, texts, strict=True):
        try:
            jobs.append(make_job(spec, args.steps, args.long_round_replicas, args.scale_up_s,
                                 traces))
        except (ValueError, TraceError) as err:
            return _error(f"--jobs {text!r}: {err}")
    try:
        report, _ = run_pool_bench(jobs, args.pool_replicas, contention)
    except ValueError as err:
        return _error(f"--jobs: {err}")
    report["steps"] = args.steps
    report["job_workloads"] = {job.name: job.workload for job in jobs}
    report["bench_seconds"] = time.perf_counter() - t0
    print("workloads: " + "; ".join(f"{job.name}: {job.workload}" for job in jobs))
    print(format_report(report))
    print(f"(simulated in {report['bench_seconds']:.1f} s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
    return 0


def register(subparsers: Any) -> None:
    """Add ``bench-pool`` to the ``rlpacer`` command line."""
    p = subparsers.add_parser(
        "bench-pool",
        help="simulate K jobs sharing a burst pool for their long rounds: large, small, pool",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--jobs", action="append", metavar="SPEC",
        help="a job, key=value pairs joined by commas: name, namespace, priority, seed,"
        " scenario, trace (repeat for each job); default: "
        + " | ".join(DEFAULT_JOBS),
    )
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help="baseline steps per job (dataset size / P0); with a trace, epochs of"
                   f" the trace enough for at least this many (default {DEFAULT_STEPS})")
    p.add_argument("--pool-replicas", type=int, default=None, metavar="P",
                   help="replicas in the shared pool; default: the largest job's extra"
                   " (long-round replicas - replicas), one request's worth")
    p.add_argument("--long-round-replicas", type=int, default=None, metavar="N",
                   help="every job's long-round replicas; default: the scenario's")
    p.add_argument("--scale-up-s", type=float, default=None, metavar="SECONDS",
                   help="seconds from a grant to the replicas taking work; default: the"
                   " scenario's (default 90)")
    p.add_argument("--no-fair-share", action="store_true",
                   help="serve the pool by priority, then arrival (a pool ClusterQueue"
                   " without admission fair sharing); default: priority, then fair share by"
                   " namespace, then arrival")
    p.add_argument("--usage-half-life-s", type=float, default=3600.0, metavar="SECONDS",
                   help="half-life of a namespace's pool usage for fair sharing (Kueue's"
                   " usageHalfLifeTime; default 3600)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.set_defaults(func=main)
