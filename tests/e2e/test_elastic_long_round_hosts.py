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
from pathlib import Path

import pytest

from rlpacer.testing.played_job import PlayedJob, run_long_round, write_manifest

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
    # rollout-1's own processes did the work its engine reports: the CPU its host used from
    # the join to the scale-down covers at least half the engine's busy time (an engine that
    # generated elsewhere, or not at all, leaves only Ray's idle housekeeping there)
    busy = sum(e["busy_s"] for r in longs for e in r["engines"] if e["replica"] == 1)
    print(f"rollout-1: engine busy {busy:.2f}s, host CPU {run.added_cpu_seconds:.2f}s")
    assert busy > 0.5, longs
    assert run.added_cpu_seconds is not None and run.added_cpu_seconds >= 0.5 * busy


def test_an_engine_whose_pod_died_is_started_again_when_the_pod_is_back(
    tmp_path: Path,
) -> None:
    """Two rollout replicas; between steps 0 and 1 (the played operator holds the driver in
    ScalingUp) rollout-1's pod is killed, host and all, and a new one started in its place:
    the driver finds its engine dead and starts one on the new pod, at the learner's weights,
    which serves the remaining steps."""
    write_manifest(tmp_path / "job.yaml", replicas=2, steps=STEPS)
    with PlayedJob(tmp_path) as job:
        job.start_operator("restart")
        job.start_head()
        for name in ("learner-0", "rollout-0", "rollout-1", "driver"):
            job.start(name)
        assert job.wait_file("paused"), "no step 0:\n" + job.logs_text()
        job.delete("rollout-1")  # the pod and every process on it
        job.start("rollout-1", temp="rollout-1-new")  # its replacement
        (job.state / "go").write_text("1")
        rc = job.wait_driver()
        assert rc == 0, "driver failed:\n" + job.logs_text()
        recs = job.records()
        addr = {n: job.hosts.address(n) for n in ("rollout-0", "rollout-1")}
        driver_log = (job.logs / "driver.log").read_text(errors="replace")
    print(json.dumps([{k: r[k] for k in ("step", "round_kind", "replicas", "engines")}
                      for r in recs], indent=1))
    assert [r["step"] for r in recs] == list(range(STEPS))
    assert "rollout engine of replica 1 died" in driver_log, driver_log[-3000:]
    assert "rollout engine of replica 1 joined" in driver_log
    held = {r["step"]: prev["policy_version"] for prev, r in itertools.pairwise(recs)}
    for r in recs:
        assert r["replicas"] == [0, 1], r
        by = {e["replica"]: e for e in r["engines"]}
        assert sorted(by) == [0, 1] and all(e["responses"] > 0 for e in by.values()), r
        assert by[1]["address"] == addr["rollout-1"]
        if r["step"] in held:
            assert {e["policy_version"] for e in by.values()} == {held[r["step"]]}
