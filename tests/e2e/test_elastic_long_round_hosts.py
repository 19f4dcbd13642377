"""An elastic long round across played hosts: the added rollout replica serves it.

The job's pods each on a host of their own (as in ``test_runtime_hosts.py``): a Ray head, a
learner, rollout-0 and the driver, and a played operator (``rlpacer.testing.plan_server``: the
step-report protocol over the real plan logic, with the capacity of an operator that scales
the rollout StatefulSet from 1 to 2 replicas for each long round); the set-up is
:mod:`rlpacer.testing.played_job`, which ``rlpacer bench-long-round`` times. ``rollout-1``'s pod is
started only when a report asks for a long round (the plan says ScalingUp until then), and
deleted once the long round is reported done. From the driver's metrics records:

* the long round ran on replicas 0 and 1, and rollout-1's engine, on rollout-1's host (as
  the engine reports itself), generated part of it at the learner's weights;
* the short rounds ran on replica 0 only (the added engine was released after the long
  round), and the driver finished every step after rollout-1's pod was deleted.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from pathlib import Path

import pytest

from rlpacer.testing.played_job import ENGINE_PROCESS, PlayedJob, run_long_round, write_manifest

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 3


def test_long_round_is_served_by_the_replica_that_joined(tmp_path: Path) -> None:
    run = run_long_round(tmp_path, "elastic", steps=STEPS)
    recs, driver_log = run.records, run.driver_log
    addr = {n: a for n, (a, _) in run.hosts.items()}
    inode = {n: i for n, (_, i) in run.hosts.items()}
    print(json.dumps([{k: r[k] for k in ("step", "round_kind", "replicas", "engines")}
                      for r in recs], indent=1))

    assert [r["step"] for r in recs] == list(range(STEPS))
    longs = [r for r in recs if r["round_kind"] == "Long"]
    assert longs, [r["round_kind"] for r in recs]
    held = {r["step"]: prev["policy_version"] for prev, r in itertools.pairwise(recs)}
    for r in recs:
        if r["round_kind"] == "Long":
            assert r["replicas"] == [0, 1], r
            by = {e["replica"]: e for e in r["engines"]}
            assert sorted(by) == [0, 1], r["engines"]
            for i, e in by.items():
                host = f"rollout-{i}"
                assert (e["address"], e["netns"], e["hostname"]) == \
                    (addr[host], inode[host], host), e
                assert e["responses"] > 0 and e["tokens"] > 0
                assert e["policy_version"] == held[r["step"]], (e, held[r["step"]])
        else:
            assert r["replicas"] == [0] and [e["replica"] for e in r["engines"]] == [0], r
    assert "rollout engine of replica 1 joined" in driver_log
    assert "rollout engine of replica 1 released" in driver_log
    # rollout-1's engine process computed during the round: the CPU it used in the round (read
    # in that process) covers at least half its busy time; and an engine process ran on
    # rollout-1's host, seen from outside it, having used at least that much CPU
    (added,) = [e for r in longs for e in r["engines"] if e["replica"] == 1]
    print(f"rollout-1: engine busy {added['busy_s']:.2f}s, CPU {added['cpu_s']:.2f}s in the"
          f" round; its process on rollout-1's host: {run.added_cpu_seconds:.2f}s in all")
    assert added["busy_s"] > 0.1 and added["cpu_s"] >= 0.5 * added["busy_s"], added
    assert run.added_cpu_seconds is not None and run.added_cpu_seconds >= added["cpu_s"]

def test_a_rollout_pod_dying_between_or_during_rounds_loses_and_doubles_nothing(
    tmp_path: Path,
) -> None:
    """Two rollout replicas; rollout-1's pod is killed twice, host and all, each time with a
    new one started in its place (one job, so the hosts, Ray, the learner and the driver
    start once):

    * between steps 0 and 1, while the played operator holds the driver (ScalingUp): at the
      next round the driver finds the engine dead and starts one on the new pod, at the
      learner's weights;
    * then, while that engine is generating its share of step 1's round (rollout-1's host
      burning CPU on it): its unfinished requests go to rollout-0 (same seeds), what it
      answered before is kept, the step trains its prompts once; the next replacement's
      engine serves step 2, and the job ends.
    """
    with PlayedJob(tmp_path) as job:
        write_manifest(job.tmp / "job.yaml", replicas=2, steps=STEPS)
        job.start_operator("restart")
        job.start_head()
        for name in ("learner-0", "rollout-0", "rollout-1", "driver"):
            job.start(name)
        assert job.wait_file("paused"), "no step 0:\n" + job.logs_text()
        # 1. between rounds
        job.delete("rollout-1")  # the pod and every process on it
        job.start("rollout-1", temp="rollout-1-new")  # its replacement
        (job.state / "go").write_text("1")
        # 2. mid-round: the replacement's engine generating step 1's round, which takes about
        # a second on this machine, most of it the longest responses: watched closely, so it
        # dies with most of its share unfinished
        driver_log = job.logs / "driver.log"
        deadline = time.monotonic() + 300
        while "rollout engine of replica 1 joined" not in driver_log.read_text(errors="replace"):
            assert time.monotonic() < deadline, "no engine joined:\n" + job.logs_text()
            assert job.procs["driver"].poll() is None, job.logs_text()
            time.sleep(0.01)
        idle = job.host_cpu("rollout-1", ENGINE_PROCESS)

        def used() -> float:
            now = job.host_cpu("rollout-1", ENGINE_PROCESS)
            return sum(v - idle.get(pid, 0.0) for pid, v in now.items())

        deadline = time.monotonic() + 120
        while used() < 0.05:  # its engine is generating
            assert time.monotonic() < deadline, "step 1 never ran:\n" + job.logs_text()
            assert "\nstep 1 " not in driver_log.read_text(errors="replace"), \
                "step 1 ended first:\n" + job.logs_text()
            time.sleep(0.01)
        job.delete("rollout-1")
        job.start("rollout-1", temp="rollout-1-third")
        rc = job.wait_driver()
        assert rc == 0, "driver failed:\n" + job.logs_text()
        recs = job.records()
        trace = [json.loads(x) for x in
                 (job.ckpt / "trace-attempt0.jsonl").read_text().splitlines()[1:]]
        addr = job.hosts.address("rollout-1")
        log = driver_log.read_text(errors="replace")
    print(json.dumps([{k: r[k] for k in ("step", "round_kind", "replicas", "engines",
                                         "prompts")} for r in recs], indent=1))
    assert [r["step"] for r in recs] == list(range(STEPS))
    assert log.count("rollout engine of replica 1 died") >= 2, log[-3000:]
    assert log.count("rollout engine of replica 1 joined") >= 2, log[-3000:]
    held = {r["step"]: prev["policy_version"] for prev, r in itertools.pairwise(recs)}
    # 2: replica 1 (the first replacement's engine) died in step 1's round, which rollout-0
    # finished
    step1 = recs[1]
    dead = [e for e in step1["engines"] if e.get("died")]
    assert [e["replica"] for e in dead] == [1], step1["engines"]
    live = [e for e in step1["engines"] if not e.get("died")]
    assert [e["replica"] for e in live] == [0] and live[0]["responses"] > 0, step1["engines"]
    # it died with requests unfinished, and those went to rollout-0: every response of the
    # round is counted once, from one engine or the other
    (gone,) = dead
    assert gone["redispatched"] > 0, gone
    assert f"rollout replica 1: {gone['redispatched']} unfinished requests re-dispatched" \
        in log
    assert gone["responses"] + live[0]["responses"] == step1["kept"], step1
    # the driver pod's response trace says the same, response by response: each step's kept
    # responses, and in step 1 those the dead engine finished before it died (the rest of its
    # requests finished on replica 0)
    for r in recs:
        kept = [x for x in trace if x["step"] == r["step"] and x["outcome"] == "kept"]
        assert len(kept) == r["kept"], (r["step"], len(kept), r["kept"])
    kept1 = Counter(x["engine"] for x in trace if x["step"] == 1 and x["outcome"] == "kept")
    assert kept1 == Counter({1: gone["responses"], 0: live[0]["responses"]}), kept1
    # the engines of the original pod (step 0) and of the second replacement (step 2) served
    # on rollout-1's host, the latter at the learner's weights
    for r in (recs[0], recs[2]):
        assert r["replicas"] == [0, 1], r
        by = {e["replica"]: e for e in r["engines"] if not e.get("died")}
        assert sorted(by) == [0, 1] and all(e["responses"] > 0 for e in by.values()), r
        assert by[1]["address"] == addr
        if r["step"] in held:
            assert {e["policy_version"] for e in by.values()} == {held[r["step"]]}, r
    # every step trained its prompts once, none twice across the run
    for r in recs:
        assert len(r["prompts"]) == len(set(r["prompts"])) == 4, r["prompts"]
    every = [p for r in recs for p in r["prompts"]]
    assert len(every) == len(set(every)), every


def test_a_timed_out_scale_up_with_a_higher_ordinal_ready_uses_what_is_ready(
        tmp_path: Path) -> None:
    """A long round asks for 3 replicas; only ordinal 2 comes up (its pod joins Ray), ordinal
    1 stays pending, and the scale-up times out. The operator keeps ordinal 2 (scaling back to
    2 would remove it: a StatefulSet drops its highest ordinal first), so the plan names [0, 2]
    usable: the driver starts an engine on rollout-2's pod, which generates part of the long
    round; the pending replica 1 is never tried; the short rounds run on rollout-0."""
    run = run_long_round(tmp_path, "timeout-gap", steps=STEPS)
    recs, driver_log = run.records, run.driver_log
    longs = [r for r in recs if r["round_kind"] == "Long"]
    assert longs and [r["step"] for r in recs] == list(range(STEPS))
    for r in recs:
        if r["round_kind"] == "Long":
            assert r["replicas"] == [0, 2], r
            by = {e["replica"]: e for e in r["engines"]}
            assert sorted(by) == [0, 2] and by[2]["responses"] > 0, r["engines"]
        else:
            assert r["replicas"] == [0], r
            assert {e["replica"] for e in r["engines"]} == {0}, r["engines"]
    # nothing was tried on replica 1 (pending): the plan's usableReplicas, not the ready
    # count, decided
    assert "replica 1" not in driver_log, driver_log[-3000:]


def test_an_early_scale_up_starts_the_added_engine_while_short_rounds_run(tmp_path: Path) -> None:
    """``scaleUpLeadSeconds`` 60: the report after step 0 forecasts the long round at step 4
    (one prompt deferred a round, four make a long round) and asks for its replica then (the
    played operator scales up for it, as the operator's scaler does); rollout-1's pod comes
    up and its engine starts in the background while the short rounds run on rollout-0
    without waiting; the long round finds part of that start done (it waits less than the
    ask took to serve), and rollout-1's engine generates part of it on its own host at the
    learner's weights."""
    run = run_long_round(tmp_path, "early", steps=5)
    recs, log = run.records, run.driver_log
    print(json.dumps([{k: r[k] for k in ("step", "round_kind", "replicas", "prepare_long_round",
                                         "rounds_until_long", "seconds_capacity_wait",
                                         "seconds_rollout", "scale_up_lead_s")}
                      for r in recs], indent=1))
    assert [r["round_kind"] for r in recs] == ["Short"] * 4 + ["Long"]
    assert recs[0]["prepare_long_round"] is True and recs[0]["rounds_until_long"] == 3
    assert "rollout replica 1: its engine starts in the background" in log
    for r in recs[1:4]:
        assert r["seconds_capacity_wait"] < 2.0, r  # no short round waited for the join
    long = recs[4]
    assert long["replicas"] == [0, 1], long
    by = {e["replica"]: e for e in long["engines"]}
    addr = {n: a for n, (a, _) in run.hosts.items()}
    assert by[1]["address"] == addr["rollout-1"] and by[1]["responses"] > 0, long["engines"]
    assert by[1]["policy_version"] == recs[3]["policy_version"], (by[1], recs[3])
    # the lead measured (the ask to rollout-1's engine serving) less the long round's wait:
    # the part of the scale-up that ran beside the short rounds (about 0 without the ask)
    hidden = long["scale_up_lead_s"] - long["seconds_capacity_wait"]
    assert hidden >= 0.25, (hidden, long)


def test_a_wide_long_round_engine_runs_the_long_rounds_queued_prompts_alone(
        tmp_path: Path) -> None:
    """``tailBatching.longRound.tensorParallelSize`` (1 here: a CPU engine has no tensor
    parallelism; the pods and the routing are those of any size) with ``fillPrompts`` 4: the
    long round's replica, rollout-1, is a wide engine the driver starts at that size on its
    own host; the long round's queued prompts are routed to it alone (every one of their
    responses is rollout-1's) and its fill to rollout-0's engine, which would otherwise wait
    through the round; the short rounds run on rollout-0 alone; every prompt trains once.
    With ``releaseWhenFits`` the wide engine is given back at the long round's end: shut
    down, and the played operator asked to scale back (``POST release``) before the step's
    report."""
    run = run_long_round(tmp_path, "wide", steps=STEPS, fill=4, release_when_fits=True)
    recs, driver_log = run.records, run.driver_log
    addr = {n: a for n, (a, _) in run.hosts.items()}
    print(json.dumps([{k: r[k] for k in ("step", "round_kind", "replicas", "engines")}
                      for r in recs], indent=1))
    assert [r["step"] for r in recs] == list(range(STEPS))
    longs = [r for r in recs if r["round_kind"] == "Long"]
    assert longs, [r["round_kind"] for r in recs]
    for r in recs:
        served = {e["replica"]: e for e in r["engines"]}
        if r["round_kind"] == "Long":
            assert r["replicas"] == [0, 1], r  # the wide engine, and rollout-0 for the fill
            assert r["fill_prompts"] == 4, r
            wide = served[1]
            assert wide["address"] == addr["rollout-1"] and wide["hostname"] == "rollout-1"
            assert wide["tensor_parallel_size"] == 1, wide
            # every response of the queued prompts (each trains its whole group) and none
            # of the fill's is rollout-1's; the fill's are rollout-0's
            queued = len(r["prompts"]) - r["fill_kept"]
            assert queued > 0 and wide["responses"] == queued * r["group_size"], (r, wide)
            assert served[0]["responses"] >= r["fill_kept"] * r["group_size"], r["engines"]
            assert served[0]["responses"] > 0, r["engines"]
            if r["next_round_kind"] == "Short":  # given back at the round's end
                t, *gone = r["released_mid_round"]
                assert gone == [1] and t == pytest.approx(r["seconds_rollout"], abs=0.01), r
        else:
            assert r["replicas"] == [0] and sorted(served) == [0], r
    assert "rollout engine of replica 1 joined" in driver_log
    assert "rollout engine of replica 1 released" in driver_log
    assert "long round is over: replica(s) [1] released before its training" in driver_log
    requests = [json.loads(x) for x in
                (tmp_path / "state" / "requests.log").read_text().splitlines()]
    for r in longs:
        if r["next_round_kind"] == "Short":
            i_release = next(i for i, x in enumerate(requests) if x.get("release") == r["step"])
            i_report = next(i for i, x in enumerate(requests) if x.get("report") == r["step"])
            assert i_release < i_report, requests
    every = [p for r in recs for p in r["prompts"]]
    assert len(every) == len(set(every)), every


def test_a_replica_joining_mid_round_takes_unfinished_requests_with_their_tokens(
        tmp_path: Path) -> None:
    """``tailBatching.longRound.joinMidRound``: the long round starts at once on rollout-0
    while the scale-up to rollout-1 pends (it waits for no capacity); rollout-1's engine
    starts in the background on its own host, gets the learner's weights during the round,
    and takes a share of the round's unfinished requests with the tokens rollout-0 had
    generated, which it continues (every engine step made 0.4 s longer, the testing
    setting that makes the tiny job's long round outlast an engine's start, as long rounds
    do on GPUs). Every response of the round is answered once: the engines' responses add up
    to the round's kept ones."""
    run = run_long_round(tmp_path, "midround", steps=STEPS, prompts=8, step_sleep_s=0.4)
    recs, driver_log = run.records, run.driver_log
    addr = {n: a for n, (a, _) in run.hosts.items()}
    keys = ("step", "round_kind", "replicas", "seconds_rollout", "seconds_capacity_wait",
            "joined_mid_round", "moved_requests", "moved_tokens", "kept")
    print(json.dumps([{k: r[k] for k in keys} for r in recs], indent=1))
    (long,) = [r for r in recs if r["round_kind"] == "Long"]
    assert long["seconds_capacity_wait"] < 1.0, long  # not the engine start's ~20 s
    assert [j[0] for j in long["joined_mid_round"]] == [1], long
    assert 0 < long["joined_mid_round"][0][1] < long["seconds_rollout"]
    assert long["moved_requests"] > 0 and long["moved_tokens"] > 0, long
    by = {e["replica"]: e for e in long["engines"]}
    assert sorted(by) == [0, 1], long["engines"]
    assert by[1]["address"] == addr["rollout-1"] and by[1]["responses"] > 0, by[1]
    assert by[1]["policy_version"] == by[0]["policy_version"], by
    assert sum(e["responses"] for e in long["engines"]) == long["kept"], long
    assert "unfinished requests moved to them with their tokens" in driver_log
    assert "rollout engine of replica 1 released" in driver_log
    for r in recs:
        if r["round_kind"] == "Short":
            assert r["moved_requests"] == 0 and [e["replica"] for e in r["engines"]] == [0]


def test_a_long_round_gives_its_added_replica_back_before_its_report(tmp_path: Path) -> None:
    """``tailBatching.longRound.releaseWhenFits``: the long round runs on rollout-0 and
    rollout-1; once its unfinished requests fit on rollout-0 at the load it began with,
    rollout-1's go there with their tokens, its engine is shut down, and the driver asks the
    played operator to scale back (``POST release``) before the round's end: the operator
    scales down then (its ``scale-down``, and the pod deleted, before the step's report).
    Every engine step is made 0.4 s longer (the testing setting) so there is a tail to act
    in. Every response of the round is answered once."""
    run = run_long_round(tmp_path, "release", steps=STEPS, prompts=8, step_sleep_s=0.4)
    recs, log = run.records, run.driver_log
    (long,) = [r for r in recs if r["round_kind"] == "Long"]
    print(json.dumps({k: long[k] for k in ("step", "replicas", "released_mid_round",
                                           "seconds_rollout", "engines", "kept")}, indent=1))
    t, *gone = long["released_mid_round"]
    assert gone == [1] and 0 < t < long["seconds_rollout"], long["released_mid_round"]
    by = {e["replica"]: e for e in long["engines"]}
    assert by[1].get("released") and by[1]["hostname"] == "rollout-1", by
    assert by[1]["responses"] > 0 and by[0]["responses"] > 0, by
    assert by[0]["responses"] + by[1]["responses"] == long["kept"], long
    assert "the operator scales back now" in log, log[-2000:]
    requests = [json.loads(x) for x in
                (tmp_path / "state" / "requests.log").read_text().splitlines()]
    i_release = next(i for i, x in enumerate(requests) if x.get("release") == long["step"])
    i_report = next(i for i, x in enumerate(requests) if x.get("report") == long["step"])
    assert i_release < i_report, requests[i_release - 2:i_report + 2]
