"""`rlpacer bench-pool`: K jobs sharing a burst pool for their long rounds' extra replicas.

Real schedules (the production planner and controller on the default scenario, 30 steps) check
the pool against ``rlpacer bench``'s single-job elastic set-up and the set-ups against each
other; hand-made schedules (fixed seconds per step) pin the contention rule's order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlpacer.cli import main
from rlpacer.sim.bench import policies, run_policy
from rlpacer.sim.pool import (
    Contention,
    JobRun,
    JobSchedule,
    PoolJob,
    Step,
    build_schedule,
    parse_job_spec,
    run_pool_bench,
    simulate_pool,
)
from rlpacer.sim.rollout import RoundSimulator
from rlpacer.sim.workload import Workload, scenario

pytestmark = pytest.mark.unit

STEPS = 30
SCALE_UP_S = 10.0  # short enough that granted replicas join long rounds mid-way
SCN = scenario("default").with_steps(STEPS).with_elastic(scale_up_s=SCALE_UP_S)


@pytest.fixture(scope="module")
def sched0() -> JobSchedule:
    return build_schedule(SCN, 0)


@pytest.fixture(scope="module")
def sched1() -> JobSchedule:
    return build_schedule(SCN, 1)


def _job(name: str, ns: str, prio: int, sched: JobSchedule) -> PoolJob:
    return PoolJob(name, ns, prio, sched)


def test_one_job_on_one_requests_pool_is_the_bench_elastic_setup(sched0: JobSchedule) -> None:
    bench = run_policy(SCN, {p.name: p for p in policies()}["sagc_tail"], 0,
                       Workload(SCN, STEPS * SCN.prompts_per_step, 0))
    report, runs = run_pool_bench([_job("a", "team-a", 0, sched0)], pool_replicas=2)
    pool, large, small = runs["pool"][0], runs["large"][0], runs["small"][0]
    assert pool.wall_s == pytest.approx(sum(bench.step_s_elastic), rel=1e-12)
    assert large.wall_s == pytest.approx(sum(bench.step_s_large), rel=1e-12)
    assert small.wall_s == pytest.approx(sum(bench.step_s), rel=1e-12)
    assert pool.join_s == bench.join_s and any(j is not None and j > 0 for j in pool.join_s)
    # the pool made a difference: the joined replicas shortened long rounds
    assert large.wall_s < pool.wall_s < small.wall_s
    el = bench.setups()["elastic"]["rollout_gpu_s"]
    assert report["setups"]["pool"]["rollout_gpu_h"] * 3600 == pytest.approx(el, rel=1e-12)
    assert pool.waits_s == [0.0] * pool.requests and pool.requests == bench.scale_ups


def _first_waits(runs: list[JobRun]) -> list[float]:
    return [r.waits_s[0] for r in runs]


def test_higher_priority_is_granted_first_and_swapping_swaps(sched0: JobSchedule) -> None:
    # identical schedules: both ask at the report before the same first long round
    lo_hi = simulate_pool([_job("x", "team-a", 0, sched0), _job("y", "team-b", 1, sched0)], 2)
    x, y = _first_waits(lo_hi)
    assert y == 0.0 and x > 0.0
    assert lo_hi[1].wall_s < lo_hi[0].wall_s  # the first grant shortened y's long round
    hi_lo = simulate_pool([_job("x", "team-a", 1, sched0), _job("y", "team-b", 0, sched0)], 2)
    x, y = _first_waits(hi_lo)
    assert x == 0.0 and y > 0.0
    # equal priority, no namespace holding anything: arrival, then the job's order
    tie = simulate_pool([_job("x", "team-a", 0, sched0), _job("y", "team-b", 0, sched0)], 2)
    assert _first_waits(tie)[0] == 0.0 and _first_waits(tie)[1] > 0.0
    for runs in (lo_hi, hi_lo, tie):
        assert all(len(r.step_s) == len(sched0.steps) for r in runs)


# --- the contention rule on hand-made schedules (no re-simulation: fixed seconds) -----------

SIM = RoundSimulator(scenario("default").cost, 2, 512, 64)


def _fixed(*steps: tuple[bool, float]) -> JobSchedule:
    """Steps of (long, seconds): a long round's rollout does not change with the pool."""
    return JobSchedule("hand", 2, 4, 2, 0.0, [Step(lg, s, 1.0, s) for lg, s in steps], 0, SIM)


def test_equal_priority_fair_share_by_namespace_before_arrival() -> None:
    # z (team-a) and w (team-c) hold the pool's 4 replicas from 0; x (team-a) asks at 11,
    # y (team-b) at 21; w gives back at 100: y goes first, team-a already holding 2
    jobs = [
        _job("z", "team-a", 0, _fixed((True, 199.0))),
        _job("w", "team-c", 0, _fixed((True, 99.0))),
        _job("x", "team-a", 0, _fixed((False, 10.0), (True, 300.0))),
        _job("y", "team-b", 0, _fixed((False, 20.0), (True, 300.0))),
    ]
    z, w, x, y = simulate_pool(jobs, 4)
    assert z.waits_s == w.waits_s == [0.0]
    assert y.waits_s == [100.0 - 21.0] and x.waits_s == [200.0 - 11.0]
    # with y in team-a too, arrival decides: x (earlier) first, whatever the list order
    jobs[3] = _job("y", "team-a", 0, jobs[3].schedule)
    for order in (jobs, [jobs[0], jobs[1], jobs[3], jobs[2]]):
        runs = dict(zip((j.name for j in order), simulate_pool(order, 4), strict=True))
        assert runs["x"].waits_s == [100.0 - 11.0] and runs["y"].waits_s == [200.0 - 21.0]


def test_priority_comes_before_fair_share_and_without_fair_share_too() -> None:
    """rlpacer's pool order (docs/kueue.md): the higher priority first, though its namespace
    used the pool more (Kueue alone, with admission fair sharing, would order usage first);
    the same without fair sharing."""
    jobs = [
        _job("z", "team-a", 0, _fixed((True, 99.0))),  # team-a used the pool from 0 to 100
        _job("x", "team-a", 5, _fixed((False, 10.0), (True, 300.0))),  # high priority, at 11
        _job("y", "team-b", 0, _fixed((False, 20.0), (True, 300.0))),  # low priority, at 21
    ]
    for rule in (Contention(), Contention(fair_share=False)):
        z, x, y = simulate_pool(jobs, 2, rule)
        assert z.waits_s == [0.0]
        # x (team-a, high) is granted at 100; y (team-b, low) waits until x's round ends
        assert x.waits_s == [100.0 - 11.0], rule
        assert y.granted == 1 and y.waits_s[0] > 100.0 - 21.0, rule
    with pytest.raises(ValueError, match="half-life"):
        Contention(half_life_s=0.0)


def test_a_request_still_waiting_at_its_last_long_round_is_withdrawn() -> None:
    jobs = [
        _job("z", "team-a", 1, _fixed((True, 499.0))),
        _job("x", "team-b", 0, _fixed((False, 10.0), (True, 50.0), (True, 50.0), (False, 5.0))),
    ]
    z, x = simulate_pool(jobs, 2)
    assert x.requests == 1 and x.granted == 0 and x.withdrawn == 1
    assert x.waits_s == [pytest.approx(11.0 + 51.0 + 51.0 - 11.0)]
    assert x.long_rounds == x.long_rounds_ungranted == x.long_rounds_unjoined == 2
    assert x.pool_replica_s == 0.0 and z.pool_replica_s == 2 * 500.0


def test_a_pool_smaller_than_one_request_still_grants_and_every_job_finishes(
    sched0: JobSchedule, sched1: JobSchedule,
) -> None:
    jobs = [_job("a", "team-a", 0, sched0), _job("b", "team-b", 0, sched1)]
    report, runs = run_pool_bench(jobs, pool_replicas=1)  # each job's extra is 2
    for job, run, small in zip(jobs, runs["pool"], runs["small"], strict=True):
        assert len(run.step_s) == len(job.schedule.steps)
        assert run.requests > 0 and run.cut == run.requests
        assert run.granted > 0 and set(run.granted_replicas) == {1}
        assert run.pool_replica_s > 0 and run.wall_s <= small.wall_s
    assert report["setups"]["pool"]["pool_granted_gpu_h"] > 0
    # no pool at all: the small set-up
    _, none = run_pool_bench(jobs, pool_replicas=0)
    assert [r.wall_s for r in none["pool"]] == [r.wall_s for r in none["small"]]


def test_gpu_hours_small_le_pool_lt_large_and_short_rounds_never_change(
    sched0: JobSchedule, sched1: JobSchedule,
) -> None:
    jobs = [_job("a", "team-a", 0, sched0), _job("b", "team-a", 1, sched1),
            _job("c", "team-b", 0, sched0)]
    report, runs = run_pool_bench(jobs)
    st = report["setups"]
    assert report["pool_replicas"] == 2 and report["cluster_gpus"] == 3 * 4 * 2
    assert st["small"]["rollout_gpu_h"] <= st["pool"]["rollout_gpu_h"] < st["large"][
        "rollout_gpu_h"]
    assert st["pool"]["pool_reserved_gpu_h"] == pytest.approx(
        2 * 2 * st["pool"]["makespan_s"] / 3600)
    for s in st.values():
        assert s["utilisation"] == pytest.approx(
            s["rollout_gpu_h"] * 3600 / (24 * s["makespan_s"]))
    assert any(max(r.waits_s, default=0.0) > 0 for r in runs["pool"])  # they contended
    for j, job in enumerate(jobs):
        steps = job.schedule.steps
        for i, step in enumerate(steps):
            secs = {name: runs[name][j].step_s[i] for name in ("large", "small", "pool")}
            if not step.long:
                assert secs["large"] == secs["small"] == secs["pool"]
            else:
                assert secs["large"] <= secs["pool"] <= secs["small"]


def test_job_specs_parse_and_name_what_is_wrong() -> None:
    spec = parse_job_spec("name=x,namespace=ns,priority=2,seed=5,trace=t.jsonl", 3)
    assert (spec.name, spec.namespace, spec.priority, spec.seed, spec.trace) == (
        "x", "ns", 2, 5, "t.jsonl")
    assert parse_job_spec("", 1).seed == 1
    for bad, what in (("colour=red", "unknown key"), ("seed=x", "seed"),
                      ("scenario=nope", "unknown scenario"), ("name", "key=value")):
        with pytest.raises(ValueError, match=what):
            parse_job_spec(bad, 0)


def test_cli_prints_the_three_setups_and_the_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    out_json = tmp_path / "pool.json"
    # the default mix: three parametric jobs and the DAPO trace (found in the repository)
    assert main(["bench-pool", "--steps", "6", "--scale-up-s", "20", "--json",
                 str(out_json)]) == 0
    text = capsys.readouterr().out
    for line in ("large: every job", "small: every job", "pool: every job", "target (pool"):
        assert line in text
    assert "dapo-qwen2.5-32b.jsonl" in text
    assert ("pool order: priority, then fair share by namespace (usage half-life 3600 s),"
            " then arrival") in text
    report = json.loads(out_json.read_text())
    assert set(report["setups"]) == {"large", "small", "pool"}
    assert [r["name"] for r in report["setups"]["pool"]["jobs"]] == ["a0", "a1", "b2", "dapo"]
    assert isinstance(report["target"]["met"], bool)


@pytest.mark.parametrize(("argv", "flag"), [
    (["--pool-replicas", "-1"], "--pool-replicas"),
    (["--steps", "0"], "--steps"),
    (["--scale-up-s", "-5"], "--scale-up-s"),
    (["--long-round-replicas", "0"], "--long-round-replicas"),
    (["--jobs", "seed=1,colour=red"], "--jobs"),
    (["--jobs", "trace=no/such/trace.jsonl"], "--jobs"),
    (["--usage-half-life-s", "0"], "--usage-half-life-s"),
])
def test_cli_rejects_bad_flags_naming_them(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench-pool", "--steps", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and flag in err
