"""Early scale-up (``tailBatching.longRound.scaleUpLeadSeconds``): the driver asks for a long
round's replicas ahead of it, from the planner's forecast; the operator's own scaler
(rlpacer.operator.scaler) scales up for that report though the next round is short; the
short rounds in between do not wait, the added engine starts in the background and serves
from the first round after it is up, and the long round finds it serving.

The plan logic here is the in-process controller with the operator's scaler in front of it
(as the operator's report handler calls it): pods are Ready ``POD_READY_S`` after the
scale-up asked for them; an engine takes ``START_S`` to start (the factory's sleep). Each
case also runs the same job without the early scale-up (lead 0) as its baseline."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from test_driver_fake_engine import LoggedEngine

from rlpacer.api.job import TailBatchingActivation
from rlpacer.api.protocol import (
    Plan,
    RolloutCapacity,
    RolloutState,
    RoundKind,
    StepReport,
)
from rlpacer.api.status import RolloutStatus, ScaleAction
from rlpacer.control.plan import ControlPlan
from rlpacer.operator import scaler
from rlpacer_trainer import runtime
from rlpacer_trainer.config import RunConfig
from rlpacer_trainer.controller_client import InProcessController
from rlpacer_trainer.engine import Finished

pytestmark = pytest.mark.unit
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-local.yaml"
POD_READY_S = 0.2
START_S = 1.0


class SlowEngine(LoggedEngine):
    """Each engine step takes 20 ms, so a short round lasts a fraction of a second."""

    def poll(self, max_steps: int = 16) -> list[Finished]:
        time.sleep(0.02)
        return super().poll(max_steps=1)


class OperatorCapacity(InProcessController):
    """The in-process plan logic behind the operator's scaler: each report goes through
    ``scaler.plan_round`` (its next round kind and its ``prepareLongRound``), each plan read
    through ``scaler.observe`` with the pods Ready ``ready_after_s`` after their scale-up (a
    short round run in a pending long round's place is passed on as deferred, decided as the
    operator's report handler decides it)."""

    ready_after_s = POD_READY_S

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg.controller_config(), cfg.total_steps, replicas=1)
        self.spec = cfg.spec
        self.rollout = RolloutStatus(desired_replicas=1, ready_replicas=1, state="Ready")
        self.asked: float | None = None  # when the replicas above 1 were asked for
        self.actions: list[ScaleAction] = []
        self.reports: list[StepReport] = []
        self.events: list[scaler.Event] = []
        self.deferred_counts: list[int] = []  # status.rollout.deferredRounds after each report
        self.step = 0
        self.last: Plan | None = None  # the plan the driver last read

    def _capacity(self) -> RolloutCapacity:
        want = self.rollout.desired_replicas
        up = self.asked is not None and time.monotonic() - self.asked >= self.ready_after_s
        ready = want if up else 1
        self.rollout, acts, evs = scaler.observe(self.rollout, self.spec, ready, self.step,
                                                 datetime.now(UTC), ordinals=list(range(ready)))
        self.actions += acts
        self.events += evs
        return RolloutCapacity(desired_replicas=self.rollout.desired_replicas,
                               ready_replicas=ready, state=RolloutState(self.rollout.state),
                               usable_replicas=list(range(min(ready,
                                                              self.rollout.desired_replicas))))

    def _to_plan(self, cp: ControlPlan) -> Plan:
        return super()._to_plan(cp).model_copy(update={"rollout": self._capacity()})

    def plan(self) -> Plan:
        self.last = super().plan()
        return self.last

    def report(self, report: StepReport) -> Plan:
        last = self.last
        deferred = last is not None and scaler.deferred_round(
            report.round_kind, report.step, last.step, last.round_kind.value,
            self.rollout.state)
        self.reports.append(report)
        cp = self.jc.observe(self._data(report))
        self.step = cp.step
        self.rollout, acts, evs = scaler.plan_round(
            self.rollout, self.spec, cp.round_kind, cp.step, datetime.now(UTC),
            prepare=report.prepare_long_round, deferred=deferred,
            ran_long=report.round_kind is RoundKind.LONG)
        self.actions += acts
        self.events += evs
        self.deferred_counts.append(self.rollout.deferred_rounds or 0)
        if self.rollout.desired_replicas > 1 and self.asked is None:
            self.asked = time.monotonic()
        elif self.rollout.desired_replicas == 1:
            self.asked = None
        self.last = self._to_plan(cp)
        return self.last

    @staticmethod
    def _data(report: StepReport) -> Any:
        from rlpacer_trainer.controller_client import to_data

        return to_data(report)

    def wait_ready(self, plan: Plan) -> Plan:  # as the HTTP client polls
        while plan.rollout.state is RolloutState.SCALING_UP:
            time.sleep(0.02)
            plan = self.plan()
        return plan


def _run(lead: int, steps: int = 5) -> tuple[Any, OperatorCapacity, list[tuple[object, ...]]]:
    cfg = RunConfig.load(EXAMPLE, steps=steps)
    cfg.job.spec.prompts_per_step = 4
    cfg.job.spec.tail_batching.activation = TailBatchingActivation("Always")
    cfg.job.spec.tail_batching.long_round.rollout_replicas = 2
    cfg.job.spec.tail_batching.long_round.scale_up_lead_seconds = lead
    log: list[tuple[object, ...]] = []

    def factory(r: int) -> LoggedEngine:
        time.sleep(START_S)  # the engine's start (on its pod)
        log.append(("start", r))
        return SlowEngine(r, log)

    ctl = OperatorCapacity(cfg)
    drv = runtime.build_driver(cfg, [SlowEngine(0, log)], controller=ctl, engine_factory=factory,
                               offered_replicas=lambda: set(range(8)))
    drv.join_wait_s = 0.0
    try:
        drv.run()
    finally:
        drv.close()
    return drv, ctl, log


def test_a_forecast_long_round_finds_its_replica_serving_and_short_rounds_do_not_wait() -> None:
    drv, ctl, log = _run(lead=60)
    recs = drv.records
    kinds = [r["round_kind"] for r in recs]
    first_long = kinds.index("Long")
    asked = [r.step for r in ctl.reports if r.prepare_long_round]
    # asked ahead, by a report whose next round was short, with the operator's scaler
    # scaling up for it (an EarlyScaleUp action at that step)
    assert asked and asked[0] < first_long - 1, (asked, kinds)
    assert all(r.next_round_kind is RoundKind.SHORT for r in ctl.reports if r.prepare_long_round)
    early = [a for a in ctl.actions if a.reason == "EarlyScaleUp"]
    assert early and early[0].step == asked[0] + 1 and early[0].to_replicas == 2, ctl.actions
    # no short round waited for the scale-up or the engine's start
    for r in recs:
        if r["round_kind"] == "Short":
            assert r["seconds_capacity_wait"] < START_S / 2, r
    # the engine of replica 1 started before the long round, loaded the weights before its
    # first request, and every request it got was at the version the driver held
    i_start = log.index(("start", 1))
    assert i_start < log.index(("report", first_long, "Long")) if ("report", first_long,
                                                                     "Long") in log else True
    first_load = log.index(next(x for x in log if x[:2] == ("load", 1)))
    first_submit = log.index(next(x for x in log if x[:2] == ("submit", 1)))
    assert i_start < first_load < first_submit
    assert all(x[2] is not None for x in log if x[:2] == ("submit", 1))
    # the long round: both replicas generated, and it did not wait for the added one
    long_recs = [r for r in recs if r["round_kind"] == "Long"]
    for r in long_recs:
        assert r["replicas"] == [0, 1], r
        assert {e["replica"] for e in r["engines"] if e["responses"] > 0} == {0, 1}, r
    assert long_recs[0]["seconds_capacity_wait"] < START_S / 2, long_recs[0]
    # the lead was measured: from the ask to the added engine serving (its start included)
    assert drv.lead_measured is not None and drv.lead_measured >= START_S
    assert long_recs[-1]["scale_up_lead_s"] == pytest.approx(drv.lead_measured)


def test_without_a_lead_the_long_round_waits_for_its_replica() -> None:
    """The baseline (lead 0, the default): nothing is asked ahead; the long round waits for
    the pod and the engine's start, as before."""
    drv, ctl, _ = _run(lead=0)
    assert not any(r.prepare_long_round for r in ctl.reports)
    assert not any(a.reason == "EarlyScaleUp" for a in ctl.actions)
    long_recs = [r for r in drv.records if r["round_kind"] == "Long"]
    assert long_recs and long_recs[0]["seconds_capacity_wait"] >= START_S
    assert all(r["prepare_long_round"] is False for r in drv.records)


def test_a_restarted_attempt_does_not_wait_for_the_early_scale_up_it_inherits(
    tmp_path: Path,
) -> None:
    """An attempt that stops right after its report asked ahead (the operator holds the
    early scale-up while it pends); the next attempt resumes from the checkpoint and reads a
    plan for a short round with the scale-up pending: its short round does not wait for the
    pods (as the attempt that asked would not have), and its reports ask on."""
    cfg = RunConfig.load(EXAMPLE, steps=8)
    cfg.job.spec.prompts_per_step = 4
    cfg.job.spec.tail_batching.activation = TailBatchingActivation("Always")
    cfg.job.spec.tail_batching.long_round.rollout_replicas = 2
    cfg.job.spec.tail_batching.long_round.scale_up_lead_seconds = 60
    log: list[tuple[object, ...]] = []

    def factory(r: int) -> LoggedEngine:
        time.sleep(START_S)
        return SlowEngine(r, log)

    ctl = OperatorCapacity(cfg)
    ctl.ready_after_s = 6.0  # the pods of the early scale-up come long after the restart
    first = runtime.build_driver(cfg, [SlowEngine(0, log)], controller=ctl,
                                 engine_factory=factory, offered_replicas=lambda: set(range(8)),
                                 checkpoint_dir=tmp_path)
    first.join_wait_s = 0.0
    try:
        while not (ctl.reports and ctl.reports[-1].prepare_long_round):
            assert first.step < 6, [r.round_kind for r in ctl.reports]
            first.run(steps=1)
        first.save_checkpoint()
    finally:
        first.close()
    plan = ctl.plan()
    assert plan.round_kind is RoundKind.SHORT and plan.rollout.state is RolloutState.SCALING_UP
    second = runtime.build_driver(cfg, [SlowEngine(0, log)], controller=ctl, attempt=1,
                                  engine_factory=factory,
                                  offered_replicas=lambda: set(range(8)),
                                  checkpoint_dir=tmp_path)
    second.join_wait_s = 0.0
    try:
        assert second.load_checkpoint(at_most=plan.step) and second.step == plan.step
        t0 = time.monotonic()
        second.run(steps=1)
        took = time.monotonic() - t0
    finally:
        second.close()
    rec = second.records[-1]
    assert rec["round_kind"] == "Short" and rec["seconds_capacity_wait"] < 1.0, rec
    assert took < ctl.ready_after_s - 1.0, took  # not held until the pods were ready
