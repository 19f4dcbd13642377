"""Prometheus metrics of the operator (CONVENTIONS.md item 11).

Names carry the ``rlpacer_`` prefix and a unit suffix; per-job series have exactly the labels
``namespace`` and ``job`` (bounded by the number of jobs) and are removed when the job is
deleted (:meth:`Metrics.forget`). Each operator process owns one :class:`Metrics` with its own
registry (tests run several in one process).
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from rlpacer.api.status import (
    SLO_BREACH_REASONS,
    ConditionStatus,
    ConditionType,
    RLTrainingJobStatus,
    find,
    is_terminal,
    is_true,
)

JOB_LABELS = ("namespace", "job")
CONTENT_TYPE = CONTENT_TYPE_LATEST

_STEP_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)
_QUEUE_BUCKETS = (1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
                    0.25, 0.5, 1, 2.5, 5)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.group_size = Gauge("rlpacer_group_size", "Group size G the plan gives now.",
                                JOB_LABELS, registry=r)
        self.lambda_ = Gauge("rlpacer_sagc_lambda", "SAGC's dual variable (straggler price).",
                             JOB_LABELS, registry=r)
        self.straggler_rate = Gauge(
            "rlpacer_straggler_rate_ratio", "Windowed straggler rate (0..1).", JOB_LABELS,
            registry=r)
        self.stragglers = Counter("rlpacer_straggler_events_total",
                                  "Straggler steps reported.", JOB_LABELS, registry=r)
        self.steps = Counter("rlpacer_steps_total", "Steps reported (accepted, not repeats).",
                             JOB_LABELS, registry=r)
        self.step_duration = Histogram(
            "rlpacer_step_duration_seconds", "Wall-clock time of a step (rollout+reward+train+"
            "sync) as reported.", JOB_LABELS, buckets=_STEP_BUCKETS, registry=r)
        self.long_rounds = Counter("rlpacer_long_rounds_total", "Long rounds started.",
                                   JOB_LABELS, registry=r)
        self.long_queue = Gauge("rlpacer_long_queue_prompts", "Prompts waiting for a long round.",
                                JOB_LABELS, registry=r)
        self.rollout_desired = Gauge("rlpacer_rollout_replicas_desired",
                                     "Rollout replicas the plan asks for.", JOB_LABELS, registry=r)
        self.rollout_ready = Gauge("rlpacer_rollout_replicas_ready", "Rollout replicas ready.",
                                   JOB_LABELS, registry=r)
        self.scale_actions = Counter("rlpacer_scale_actions_total", "Rollout scale actions.",
                                     JOB_LABELS, registry=r)
        self.report_latency = Histogram(
            "rlpacer_step_report_duration_seconds",
            "Step-report endpoint handling time (route steps: state persisted; plan: a read),"
            " by route and HTTP code.", ("route", "code"),
            buckets=_LATENCY_BUCKETS, registry=r)
        self.report_errors = Counter(
            "rlpacer_step_report_errors_total",
            "Step-report endpoint answers >= 400, by route, HTTP code and the ErrorBody's"
            " reason (e.g. InvalidReport, StepOutOfOrder, Unauthorized, Unavailable).",
            ("route", "code", "reason"), registry=r)
        self.report_unknown_fields = Counter(
            "rlpacer_step_report_unknown_fields_total",
            "Step reports accepted with fields this operator does not know and ignored (a"
            " newer trainer's additions; the names are logged), by route.", ("route",),
            registry=r)
        self.report_throttled = Counter(
            "rlpacer_step_report_throttled_total",
            "Step-report endpoint requests answered 429 (over the job's request rate).",
            JOB_LABELS, registry=r)
        self.status_write = Histogram(
            "rlpacer_status_write_duration_seconds",
            "PUT of a job's status to the API server (each step report makes one), by result"
            " (ok, conflict, error). Compare with rlpacer_step_report_duration_seconds: the"
            " difference is the operator's own time.", ("result",),
            buckets=_LATENCY_BUCKETS, registry=r)
        self.kube_requests = Counter(
            "rlpacer_kube_requests_total",
            "Requests this operator's own client made to the API server (not Kopf's watches"
            " of the children), by verb (GET, LIST, WATCH, PUT, PATCH, POST, DELETE) and"
            " resource (plural, with the subresource: rltrainingjobs/status).",
            ("verb", "resource"), registry=r)
        self.reconcile_errors = Counter("rlpacer_reconcile_errors_total",
                                        "Reconciles that raised.", JOB_LABELS, registry=r)
        self.reconciles = Counter("rlpacer_reconciles_total", "Reconciles run.", JOB_LABELS,
                                  registry=r)
        self.slo_violated = Gauge(
            "rlpacer_slo_violated", "1 while the job's SLOViolated condition is True and it"
            " breaks the SLO of this reason (StragglerRateAboveSLO, StepTimeAboveSLO: both"
            " when it breaks both), else 0.",
            (*JOB_LABELS, "reason"), registry=r)
        self.job_active = Gauge("rlpacer_job_active", "1 while the job is admitted and not"
                                " finished (nor suspended).", JOB_LABELS, registry=r)
        self.job_queued = Gauge(
            "rlpacer_job_queued", "1 while Kueue holds the job (waiting for admission, or"
            " evicted), else 0; only for jobs with spec.scheduling.queueName.", JOB_LABELS,
            registry=r)
        self.long_round_queued = Gauge(
            "rlpacer_long_round_queued", "1 while a long round's extra rollout replicas wait"
            " for Kueue to admit their Workload, else 0.", JOB_LABELS, registry=r)
        self.queue_wait = Histogram(
            "rlpacer_queue_wait_seconds", "Time from a Kueue Workload's creation to its"
            " admission, as this operator saw it happen, by namespace and what waited (job:"
            " the job's own pods; long_round: a long round's extra replicas).",
            ("namespace", "workload"), buckets=_QUEUE_BUCKETS, registry=r)
        self.leader = Gauge("rlpacer_leader", "1 while this replica holds the Lease.",
                            registry=r)
        self._per_job = [
            self.group_size, self.lambda_, self.straggler_rate, self.stragglers, self.steps,
            self.step_duration, self.long_rounds, self.long_queue, self.rollout_desired,
            self.rollout_ready, self.scale_actions, self.reconcile_errors, self.reconciles,
            self.job_active, self.report_throttled, self.job_queued, self.long_round_queued,
        ]

    def observe_status(self, namespace: str, job: str, st: RLTrainingJobStatus) -> None:
        lab = (namespace, job)
        if st.group_size is not None:
            self.group_size.labels(*lab).set(st.group_size)
        if st.lambda_ is not None:
            self.lambda_.labels(*lab).set(float(st.lambda_))
        if st.straggler_rate is not None:
            self.straggler_rate.labels(*lab).set(float(st.straggler_rate))
        self.long_queue.labels(*lab).set(st.long_queue)
        self.rollout_desired.labels(*lab).set(st.rollout.desired_replicas)
        self.rollout_ready.labels(*lab).set(st.rollout.ready_replicas)
        active = (is_true(st.conditions, ConditionType.ADMITTED)
                  and not is_terminal(st.conditions)
                  and not is_true(st.conditions, ConditionType.SUSPENDED))
        self.job_active.labels(*lab).set(1 if active else 0)
        if find(st.conditions, ConditionType.QUEUE_ADMITTED) is not None:
            held = find(st.conditions, ConditionType.SUSPENDED)
            queued = (held is not None and held.status == ConditionStatus.TRUE
                      and held.reason != "Suspended" and not is_terminal(st.conditions))
            self.job_queued.labels(*lab).set(1 if queued else 0)
        # The step counter exists from the job's first observation at 0, so the first step after
        # an operator (re)start is an increase Prometheus sees (a series first scraped at 1 is not):
        # the RLPacerJobStuck alert relies on it across leader changes.
        self.steps.labels(*lab)
        slo = find(st.conditions, ConditionType.SLO_VIOLATED)
        if slo is not None:
            breaches = (set(st.slo_breaches) if st.slo_breaches is not None
                        else {slo.reason})  # a status written before sloBreaches existed
            for reason in SLO_BREACH_REASONS:
                on = slo.status == ConditionStatus.TRUE and reason.value in breaches
                self.slo_violated.labels(namespace, job, reason.value).set(1 if on else 0)

    def forget(self, namespace: str, job: str) -> None:
        """Remove every series of a deleted job."""
        for m in self._per_job:
            with contextlib.suppress(KeyError):
                m.remove(namespace, job)
        for reason in SLO_BREACH_REASONS:
            with contextlib.suppress(KeyError):
                self.slo_violated.remove(namespace, job, reason.value)

    def series_for(self, namespace: str, job: str) -> int:
        """How many samples mention the job (tests)."""
        n = 0
        for fam in self.registry.collect():
            for s in fam.samples:
                if s.labels.get("namespace") == namespace and s.labels.get("job") == job:
                    n += 1
        return n

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
