"""Hosting ``rlpacer.control.plan.JobController`` for one job, with its state as a string.

The operator keeps no live controller between requests: the persisted JSON string in
``status.controllerState`` *is* the controller. Each report restores a controller from the
string, observes the report, and serialises the new state; the new string is persisted before
the answer is sent, and only then becomes the in-memory base. A failed write therefore leaves
nothing half-applied, and a restarted operator continues from exactly the persisted bytes.

Serialisation is canonical (sorted keys, no whitespace): ``dumps(from(dumps(s))) == dumps(s)``,
so the state round-trips bit-exactly (floats via ``repr``, the RNG state as integers).
"""

from __future__ import annotations

import json
from typing import Any

from rlpacer.api._base import format_decimal
from rlpacer.api.job import RLTrainingJobSpec
from rlpacer.api.protocol import StepReport
from rlpacer.api.status import Posterior, RLTrainingJobStatus
from rlpacer.control.plan import (
    ControlPlan,
    JobController,
    JobControllerConfig,
    LengthStats,
    ReportRejected,
    StepReportData,
    StepSecondsData,
)
from rlpacer.control.sagc import GroupControlMode, SAGCConfig

__all__ = ["ReportRejected", "apply_report", "controller_config", "dumps", "load", "new_state"]


def controller_config(spec: RLTrainingJobSpec) -> JobControllerConfig:
    gc = spec.group_control
    return JobControllerConfig(
        mode=GroupControlMode.parse(gc.mode.value),
        sagc=SAGCConfig(**gc.sagc_kwargs()),
        straggler_window=gc.window_steps,
    )


def dumps(state: dict[str, Any]) -> str:
    return json.dumps(state, sort_keys=True, separators=(",", ":"), allow_nan=False)


def new_state(spec: RLTrainingJobSpec) -> str:
    return dumps(JobController(controller_config(spec)).state_dict())


def load(state_json: str) -> JobController:
    return JobController.from_state_dict(json.loads(state_json))


def to_data(report: StepReport) -> StepReportData:
    ln, s = report.lengths, report.seconds
    return StepReportData(
        attempt=report.attempt,
        step=report.step,
        group_size=report.group_size,
        round_kind=report.round_kind,
        lengths=LengthStats(max=ln.max, median=ln.median, p90=ln.p90, count=ln.count,
                            aborted=ln.aborted, mean=ln.mean),
        seconds=StepSecondsData(rollout=s.rollout, reward=s.reward, train=s.train, sync=s.sync),
        long_queue=report.long_queue,
        next_round_kind=report.next_round_kind,
        reward=report.reward,
        next_straggler_risk=(None if report.next_straggler_risk is None else tuple(
            (x.group_size, x.probability) for x in report.next_straggler_risk)),
    )


def apply_report(
    state_json: str, report: StepReport, ctl: JobController | None = None
) -> tuple[str, ControlPlan, JobController]:
    """Observe ``report`` on a controller restored from ``state_json`` (or on ``ctl``, a live
    controller whose state is exactly ``state_json``: it saves the restore).

    Returns (new state JSON, plan for the next step, the controller). Raises
    :class:`ReportRejected` (nothing changed) for an impossible report.
    """
    ctl = load(state_json) if ctl is None else ctl
    plan = ctl.observe(to_data(report))
    return dumps(ctl.state_dict()), plan, ctl


def posteriors(ctl: JobController) -> list[Posterior]:
    inner = ctl.controller
    pairs: dict[int, tuple[float, float]] = {}
    fn = getattr(inner, "posterior", None)
    if callable(fn):
        pairs = fn()
    means = ctl.posterior_means()
    out = []
    for g, mean in sorted(means.items()):
        ab = pairs.get(g)
        out.append(Posterior(
            group_size=g,
            alpha=None if ab is None else format_decimal(ab[0]),
            beta=None if ab is None else format_decimal(ab[1]),
            mean=format_decimal(mean),
        ))
    return out


def fill_status(st: RLTrainingJobStatus, ctl: JobController, cp: ControlPlan) -> None:
    """Copy the controller's readable numbers into ``st`` (in place)."""
    st.step = cp.step
    st.group_size = cp.group_size
    st.round_kind = cp.round_kind.value
    st.lambda_ = format_decimal(cp.lambda_)
    st.straggler_rate = format_decimal(cp.straggler_rate)
    long_rate = ctl.long_round_straggler_rate
    st.long_round_straggler_rate = None if long_rate is None else format_decimal(long_rate)
    mean = ctl.mean_step_seconds
    st.step_seconds = None if mean is None else format_decimal(mean)
    st.posteriors = posteriors(ctl)


def init_status(st: RLTrainingJobStatus, spec: RLTrainingJobSpec) -> None:
    """A new job's controller state and readable fields (G, lambda, p(G)) from the start."""
    if st.controller_state is None:
        st.controller_state = new_state(spec)
    ctl = load(st.controller_state)
    fill_status(st, ctl, ctl.plan())
