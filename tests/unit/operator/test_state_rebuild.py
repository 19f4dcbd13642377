"""A job's controller state broken by someone else's status write (issue 32, defect 4).

``status.controllerState`` edited to something the operator cannot restore (``{}``, not JSON,
another version) or removed: the step-report endpoint answers 503 with a reason and
Retry-After (never 500) and wakes the job's loop; the job watch's event of the foreign write
wakes it too; the pass rebuilds the state from the spec and the status's readable fields
(StateRebuilt=True and a Warning Event), and the running driver's next report is accepted at
the right step, with the group size it was given.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from operator_fakekube import FakeKube
from test_reports import NS, SPEC, Env, admitted, report, run

from rlpacer.api.job import parse_spec
from rlpacer.api.protocol import plan_path
from rlpacer.api.status import ConditionType, read_status
from rlpacer.control.plan import JobController
from rlpacer.operator import decide, hosting, runtime
from rlpacer.operator.runtime import job_path
from rlpacer.operator.timeutil import utcnow

pytestmark = pytest.mark.unit

BROKEN: dict[str, str | None] = {
    "empty-object": "{}",
    "not-json": "not json {",
    "other-version": '{"version": 999}',
    "missing": None,
}


def _edit_status(fk: FakeKube, name: str, state: str | None) -> None:
    """Someone else's status write (kubectl patch --subresource=status): a new
    resourceVersion, the controller state replaced or removed."""
    obj = fk.objects[job_path(NS, name)]
    if state is None:
        obj["status"].pop("controllerState", None)
    else:
        obj["status"]["controllerState"] = state
    fk._bump(obj)


def _events(fk: FakeKube, reason: str) -> list[dict[str, Any]]:
    return [e for e in fk.of_kind("events") if e["reason"] == reason]


def _cond(st: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in st.get("conditions", []) if c["type"] == type_), None)


async def _steps(env: Env, n: int) -> int:
    """Report steps 0..n-1 (some stragglers); the group size planned for step n."""
    g = (await env.plan("job"))["groupSize"]
    for step in range(n):
        code, plan = await env.post("job", report(step, g, 100 if step % 3 else 20))
        assert code == 200, plan
        g = plan["groupSize"]
    return int(g)


@pytest.mark.parametrize("state", list(BROKEN.values()), ids=list(BROKEN))
def test_a_broken_state_is_answered_503_then_rebuilt_and_the_driver_carries_on(
    state: str | None,
) -> None:
    async def body() -> None:
        env, close = await admitted()
        try:
            g = await _steps(env, 7)
            before = env.status("job")
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            _edit_status(env.fk, "job", state)
            broken = env.status("job")
            # the report is refused, not failed: 503 with Retry-After, nothing written, the
            # job's loop woken to rebuild
            rt.wake.clear()
            code, err = await env.post("job", report(7, g, 100))
            reason = ("ControllerStateMissing" if state is None
                      else "ControllerStateUnreadable")
            assert code == 503 and err["reason"] == reason, err
            assert "rebuilding" in err["message"] and rt.wake.is_set()
            assert env.status("job") == broken
            r = await env.client.get(plan_path(NS, "job"), headers={
                "Authorization": f"Bearer {await env.token('job')}"})
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert (await r.json())["reason"] == reason
            # the pass rebuilds it: condition, Event, a state that restores
            await env.jobs.reconcile(rt)
            st = env.status("job")
            cond = _cond(st, ConditionType.STATE_REBUILT.value)
            assert cond is not None and cond["status"] == "True" and cond["reason"] == reason
            assert "step 7" in cond["message"] and f"group size {g}" in cond["message"]
            (ev,) = _events(env.fk, "ControllerStateRebuilt")
            assert ev["type"] == "Warning" and ev["message"] == cond["message"]
            ctl = hosting.load(st["controllerState"])
            assert (ctl.next_step, ctl.attempt, ctl.plan().group_size) == (7, 0, g)
            # what the status showed of SAGC is kept
            assert st["step"] == before["step"] == 7 and st["groupSize"] == g
            assert st["lambda"] == before["lambda"]
            assert [(p["groupSize"], p["alpha"], p["beta"]) for p in st["posteriors"]] == [
                (p["groupSize"], p["alpha"], p["beta"]) for p in before["posteriors"]]
            for p, q in zip(st["posteriors"], before["posteriors"], strict=True):
                assert float(p["mean"]) == pytest.approx(float(q["mean"]), abs=1e-5)
            assert st["summary"] == before["summary"]
            # the driver's report of step 7 is now accepted, and the job goes on
            code, plan = await env.post("job", report(7, g, 100))
            assert code == 200 and plan["step"] == 8, plan
            code, plan = await env.post("job", report(8, plan["groupSize"], 100))
            assert code == 200 and env.status("job")["step"] == 9
            # rebuilt once: a later pass finds the state usable and changes nothing
            await env.jobs.reconcile(rt)
            assert len(_events(env.fk, "ControllerStateRebuilt")) == 1
        finally:
            await close()

    run(body)


def test_the_job_watch_wakes_the_loop_on_someone_elses_write_not_on_its_own() -> None:
    """The foreign write is acted on at once (the watch's event), with no report and no full
    pass: the operator's own writes' events wake nothing."""

    async def body() -> None:
        env, close = await admitted()
        try:
            await _steps(env, 3)
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            # the watch's event of the operator's own last write (possibly seen before the
            # write's answer): no wake-up
            rt.wake.clear()
            env.jobs.saw(NS, "job", rt.rv)
            await asyncio.sleep(runtime.FOREIGN_WRITE_CHECK_S + 0.1)
            assert not rt.wake.is_set()
            # an edit of the status by someone else
            _edit_status(env.fk, "job", "not json {")
            env.jobs.saw(NS, "job", env.fk.objects[job_path(NS, "job")]["metadata"]
                         ["resourceVersion"])
            await asyncio.wait_for(rt.wake.wait(), timeout=2)
            # the pass it wakes reads the job again and rebuilds the state
            await env.jobs.reconcile(rt)
            st = env.status("job")
            assert _cond(st, ConditionType.STATE_REBUILT.value) is not None
            assert hosting.load(st["controllerState"]).next_step == 3
        finally:
            await close()

    run(body)


def _status_after(spec: dict[str, Any], steps: int) -> tuple[Any, JobController]:
    """The status (as the operator writes it) and controller after ``steps`` reports."""
    parsed = parse_spec(spec)
    lib = JobController(hosting.controller_config(parsed))
    from rlpacer.api.protocol import StepReport

    st, _ = read_status({})
    hosting.init_status(st, parsed)
    g = lib.plan().group_size
    for step in range(steps):
        cp = lib.observe(hosting.to_data(StepReport.model_validate(
            report(step, g, 100 if step % 4 else 15))))
        g = cp.group_size
    st.controller_state = hosting.dumps(lib.state_dict())
    hosting.fill_status(st, lib, lib.plan())
    st.long_rounds = lib.long_rounds
    return st, lib


@pytest.mark.parametrize("mode", ["SAGC", "Fixed"])
def test_rebuild_keeps_what_the_status_shows_of_the_controller(mode: str) -> None:
    spec = {**SPEC, "groupControl": {**SPEC["groupControl"], "mode": mode}}
    st, lib = _status_after(spec, 23)
    st.attempt = 2
    ctl, kept = decide.rebuild_state(parse_spec(spec), st)
    assert ctl.next_step == 23 and ctl.attempt == 2
    assert ctl.plan().group_size == lib.plan().group_size
    assert ctl.lambda_ == pytest.approx(lib.lambda_, rel=1e-5, abs=1e-9)
    for g, mean in lib.posterior_means().items():
        assert ctl.posterior_means()[g] == pytest.approx(mean, abs=1e-5)
    assert ctl.straggler_rate == pytest.approx(lib.straggler_rate, abs=0.5 / 23)
    assert ctl.mean_step_seconds == pytest.approx(lib.mean_step_seconds, rel=1e-5)
    assert "step 23" in kept and "attempt 2" in kept
    # a state the operator can persist and restore
    assert hosting.load(hosting.dumps(ctl.state_dict())).next_step == 23


def test_a_state_that_cannot_be_rebuilt_fails_the_job_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    st, _ = _status_after(SPEC, 4)
    st.controller_state = "not json {"

    def impossible(*_: Any, **__: Any) -> Any:
        raise ValueError("no")

    monkeypatch.setattr(decide, "rebuild_state", impossible)
    new, events = decide.recover_controller_state(parse_spec(SPEC), st, utcnow(), 1)
    failed = _cond(json.loads(json.dumps(new.to_wire())), ConditionType.FAILED.value)
    assert failed is not None and failed["reason"] == "ControllerStateLost"
    assert "unreadable" in failed["message"] and new.summary == "Failed"
    assert [e.reason for e in events] == ["ControllerStateLost"]
    # a finished job is not failed again (no Event on every pass)
    again, events = decide.recover_controller_state(parse_spec(SPEC), new, utcnow(), 1)
    assert again == new and events == []
