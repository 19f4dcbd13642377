"""Per-job plan logic: the group-size controller, step counter and report validation.

One :class:`JobController` per training job. The operator hosts it for clusters (state
persisted in the job's status), ``rlpacer run`` calls it in-process; both feed it the
driver's step reports (DESIGN.md "Step-report protocol") and return :meth:`JobController.plan`.
It is pure: no I/O, no clocks, deterministic under the controller's seed.

Protocol rules enforced by :meth:`JobController.observe` (violations raise
:class:`ReportRejected` with a machine-readable ``reason`` and change nothing):

* Idempotency key ``(attempt, step)``: a repeat of the last answered report returns the same
  answer and changes nothing; the same key with a different body is ``ConflictingRepeat``.
* Within an attempt steps increase by one (``StepOutOfOrder``). A new attempt (after a
  restart from a checkpoint at step k) may report any step k+1 <= next step: the controller
  keeps what it learnt. An older attempt is ``StaleAttempt``.
* ``groupSize`` must be the planned G (``GroupSizeNotPlanned``); lengths must be possible
  (``ImpossibleLengths``: median > 0, median <= p90 <= max); counts, seconds and the queue
  non-negative (``InvalidReport``).

Decision: **long rounds do not feed SAGC** by default (``long_rounds_feed_sagc=False``).
A long round holds only the prompts that lost the race; it straggles by construction, and
long rounds are a fixed share of steps set by the over-provisioning, whatever G is (each
short round defers (eta-1) * P0 prompts: one step in 5 is long at eta=1.25, one in 3 at
1.5). Fed to SAGC they are evidence about the queue, not about G, and they spend the
straggler budget: at eta=1.25
and delta=0.2 they use all of it, and at eta=1.5 they alone exceed delta, pinning G at the
smallest size with lambda at its cap whatever the data. Measured with ``rlpacer bench
--ablations`` (default scenario, seeds 0-2): feeding finishes the dataset sooner (2.61-2.87x
fixed16 vs 2.14-2.36x) only by training smaller groups (mean G 4.6-5.5 vs 6.9-7.9) and
fewer responses per second (3.35-3.60 vs 4.15-4.22): the same as choosing a tighter delta,
which a user can do explicitly. So SAGC's objective (largest groups within the SLO) and
trained-responses throughput are both better without feeding.
A long round runs with the pending SAGC decision's G; when long rounds do not feed SAGC that
decision stays pending and the next short round uses it.

**The straggler SLO is over short rounds only.** ``targetStragglerRate`` (delta) bounds the
rate SAGC controls, so :attr:`JobController.straggler_rate` (the plan's ``stragglerRate``,
``status.stragglerRate``) is the fraction of straggler steps among the last
``straggler_window`` *short* rounds. Long rounds straggle by design and are reported apart:
:attr:`JobController.long_round_straggler_rate` over the last ``straggler_window`` long rounds
(``status.longRoundStragglerRate``); :attr:`JobController.all_steps_straggler_rate` keeps the
rate over every kind. (Before, ``straggler_rate`` was over the last ``straggler_window`` steps
of every kind; a state written then restores with empty short and long windows.)

**SLO feasibility** (:func:`straggler_slo_verdict`, :meth:`JobController.slo_verdict`): from
SAGC's own evidence, one of

* ``Unknown``: fewer than :data:`SLO_MIN_OBSERVATIONS` short rounds in the window.
* ``Infeasible`` (SAGC): no candidate can meet delta at the job's tau. The rule looks at the
  smallest candidate G0 only: a step's max/median ratio is a maximum over P x G responses, so
  its straggler probability does not fall as G grows, and G0 is the most conservative choice
  SAGC has. Infeasible when G0 ran at least :data:`SLO_MIN_AT_SMALLEST` (3) short rounds
  and SAGC's posterior of p(G0) (the Beta with forgetting, prior centred on delta) puts
  P(p(G0) > delta) >= :data:`SLO_CONFIDENCE` (0.95). The posterior makes it robust to noise:
  at delta 0.25, 3 stragglers in 3 rounds is enough (P = 0.98), 2 in 3 is not (P = 0.86 to
  0.88, by their order), nor 3 in 5 (0.89 to 0.93). The bar on G0's rounds is low on
  purpose: when every G straggles, each G pays the same price lambda * p, so SAGC goes back
  to the largest G and visits G0 rarely. A larger G that straggles says nothing about G0, so
  a G0 tried fewer than 3 times is never judged infeasible (the verdict is then at most
  Exceeded, the message says how much G0 was tried). And the window's short-round rate must
  not be below delta with P > 0.5: a workload that drifted back within the target is Met,
  whatever G0's old evidence says.
* ``Exceeded``: the short-round rate is above delta with P >= 0.95 under the same prior
  (Beta(alpha0 + s, beta0 + n - s) over the window's n short rounds, s stragglers), and G0 is
  not shown infeasible (SAGC is still correcting; in Fixed mode: the fixed G is over the target).
* ``Met``: otherwise.

Hysteresis keeps the verdict from flapping near the threshold: once ``Infeasible`` (or
``Exceeded``) it stays while the same probability is >= :data:`SLO_RELEASE` (0.5). The
previous verdict is an argument, so the function stays pure: the operator reads it from the
job's ``StragglerSLOMet`` condition, ``rlpacer run`` keeps it in memory.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rlpacer.api.protocol import RoundKind
from rlpacer.control._validate import require_bool, require_int
from rlpacer.control.errors import ConfigError, StateError
from rlpacer.control.sagc import (
    FixedController,
    GroupControlMode,
    SAGCConfig,
    SAGCController,
    controller_from_state_dict,
    make_controller,
)

__all__ = [
    "SLO_CONFIDENCE",
    "SLO_MIN_AT_SMALLEST",
    "SLO_MIN_OBSERVATIONS",
    "SLO_RELEASE",
    "ControlPlan",
    "JobController",
    "JobControllerConfig",
    "LengthStats",
    "ReportRejected",
    "SLOState",
    "SizeEvidence",
    "StepReportData",
    "StepSecondsData",
    "StragglerSLOVerdict",
    "beta_above",
    "straggler_slo_verdict",
]

_STATE_VERSION = 1


class ReportRejected(ValueError):
    """A step report the controller cannot accept (HTTP 422); the state is unchanged."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class JobControllerConfig:
    """Configuration of one job's plan logic."""

    mode: GroupControlMode = GroupControlMode.SAGC
    """SAGC or Fixed (always ``sagc.initial``)."""
    sagc: SAGCConfig = field(default_factory=SAGCConfig)
    """The group-size controller's configuration (Fixed uses initial, tau, forgetting)."""
    straggler_window: int = 50
    """Steps in the windowed straggler rate reported for logging (>= 1)."""
    long_rounds_feed_sagc: bool = False
    """Whether long rounds' length summaries update SAGC (see the module docstring)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", GroupControlMode.parse(self.mode))
        if not isinstance(self.sagc, SAGCConfig):
            raise ConfigError("sagc", f"must be an SAGCConfig, got {type(self.sagc).__name__}")
        require_int("straggler_window", self.straggler_window, minimum=1)
        require_bool("long_rounds_feed_sagc", self.long_rounds_feed_sagc)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "sagc": self.sagc.to_dict(),
            "straggler_window": self.straggler_window,
            "long_rounds_feed_sagc": self.long_rounds_feed_sagc,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobControllerConfig:
        try:
            return cls(
                mode=GroupControlMode.parse(data["mode"]),
                sagc=SAGCConfig.from_dict(data["sagc"]),
                straggler_window=data["straggler_window"],
                long_rounds_feed_sagc=data["long_rounds_feed_sagc"],
            )
        except KeyError as exc:
            raise ConfigError(str(exc.args[0]), "missing") from exc


@dataclass(frozen=True)
class LengthStats:
    """Response lengths (tokens) of a step's kept responses (wire: ``lengths``)."""

    max: float
    median: float
    p90: float
    count: int
    aborted: int = 0
    mean: float | None = None
    """Mean kept response length (optional: a trainer of an older release sends none)."""


@dataclass(frozen=True)
class StepSecondsData:
    """Where the step's time went (wire: ``seconds``)."""

    rollout: float = 0.0
    reward: float = 0.0
    train: float = 0.0
    sync: float = 0.0


@dataclass(frozen=True)
class StepReportData:
    """A step report as plain values (wire: ``StepReport`` in rlpacer.api.protocol)."""

    attempt: int
    step: int
    group_size: int
    round_kind: RoundKind
    lengths: LengthStats
    seconds: StepSecondsData = field(default_factory=StepSecondsData)
    long_queue: int = 0
    next_round_kind: RoundKind = RoundKind.SHORT
    reward: float | None = None
    next_straggler_risk: tuple[tuple[int, float], ...] | None = None
    """(G, predicted straggler probability) of the next round per candidate: SAGC's context
    (rlpacer.control.sagc); None: no context."""

    def to_dict(self) -> dict[str, Any]:
        # asdict()'s result, written out: it deep-copies every value, and a job's state
        # (which holds its last report) is serialised on every step report.
        ln, s = self.lengths, self.seconds
        out: dict[str, Any] = {
            "attempt": self.attempt,
            "step": self.step,
            "group_size": self.group_size,
            "round_kind": self.round_kind.value,
            "lengths": {"max": ln.max, "median": ln.median, "p90": ln.p90, "count": ln.count,
                        "aborted": ln.aborted},
            "seconds": {"rollout": s.rollout, "reward": s.reward, "train": s.train,
                        "sync": s.sync},
            "long_queue": self.long_queue,
            "next_round_kind": self.next_round_kind.value,
            "reward": self.reward,
        }
        if self.next_straggler_risk is not None:  # absent as in a state written before it
            out["next_straggler_risk"] = [[g, p] for g, p in self.next_straggler_risk]
        if ln.mean is not None:  # absent as in a state written before it
            out["lengths"]["mean"] = ln.mean
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepReportData:
        risk = data.get("next_straggler_risk")
        return cls(
            attempt=data["attempt"],
            step=data["step"],
            group_size=data["group_size"],
            round_kind=RoundKind(data["round_kind"]),
            lengths=LengthStats(**data["lengths"]),
            seconds=StepSecondsData(**data["seconds"]),
            long_queue=data["long_queue"],
            next_round_kind=RoundKind(data["next_round_kind"]),
            reward=data["reward"],
            next_straggler_risk=(None if risk is None
                                 else tuple((int(g), float(p)) for g, p in risk)),
        )


@dataclass(frozen=True)
class ControlPlan:
    """What the controller plans for the next step (the host adds rollout capacity)."""

    step: int
    group_size: int
    round_kind: RoundKind
    lambda_: float
    straggler_rate: float
    straggler: bool | None = None
    """Whether the step just reported was a straggler (None for the initial plan)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "group_size": self.group_size,
            "round_kind": self.round_kind.value,
            "lambda_": self.lambda_,
            "straggler_rate": self.straggler_rate,
            "straggler": self.straggler,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ControlPlan:
        return cls(**{**data, "round_kind": RoundKind(data["round_kind"])})


#: Short rounds in the window before any SLO verdict.
SLO_MIN_OBSERVATIONS = 5
#: Short rounds at the smallest candidate before it may be judged infeasible.
SLO_MIN_AT_SMALLEST = 3
#: Posterior probability of "over the target" that makes a verdict Exceeded / Infeasible.
SLO_CONFIDENCE = 0.95
#: ... and below which a verdict already given is released (hysteresis).
SLO_RELEASE = 0.5


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                   -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-12:
            break
    return h


def beta_above(x: float, a: float, b: float) -> float:
    """``P(p > x)`` for ``p ~ Beta(a, b)`` (1 - the regularised incomplete beta I_x(a, b))."""
    if x <= 0.0:
        return 1.0
    if x >= 1.0:
        return 0.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        cdf = front * _betacf(a, b, x) / a
    else:
        cdf = 1.0 - front * _betacf(b, a, 1.0 - x) / b
    return min(1.0, max(0.0, 1.0 - cdf))


class SLOState(enum.StrEnum):
    """The straggler SLO's verdict (see the module docstring)."""

    UNKNOWN = "Unknown"
    MET = "Met"
    EXCEEDED = "Exceeded"
    INFEASIBLE = "Infeasible"


@dataclass(frozen=True)
class SizeEvidence:
    """What SAGC measured at one candidate G (short rounds, unless long rounds feed SAGC)."""

    group_size: int
    observations: int
    stragglers: int
    posterior_mean: float
    p_above_target: float
    """The posterior probability that p(G) exceeds the target."""

    @property
    def rate(self) -> float | None:
        return self.stragglers / self.observations if self.observations else None


@dataclass(frozen=True)
class StragglerSLOVerdict:
    """Whether the job meets its straggler SLO, with the evidence (pure values)."""

    state: SLOState
    mode: GroupControlMode
    target: float
    tau: float
    short_rounds: int
    """Short rounds in the window (the SLO's rate is over these)."""
    short_stragglers: int
    long_rounds: int
    """Long rounds in their own window (excluded from the SLO)."""
    long_stragglers: int
    p_above_target: float
    """Posterior probability that the short-round rate exceeds the target."""
    sizes: tuple[SizeEvidence, ...] = ()

    @property
    def rate(self) -> float:
        return self.short_stragglers / self.short_rounds if self.short_rounds else 0.0

    @property
    def long_rate(self) -> float | None:
        return self.long_stragglers / self.long_rounds if self.long_rounds else None

    @property
    def met(self) -> bool | None:
        """True / False, or None while Unknown."""
        if self.state is SLOState.UNKNOWN:
            return None
        return self.state is SLOState.MET

    def per_size_text(self) -> str:
        parts = []
        for e in self.sizes:
            r = "untried" if e.rate is None else f"{e.stragglers}/{e.observations} ({e.rate:.2f})"
            parts.append(f"G={e.group_size} {r}")
        return ", ".join(parts)

    def message(self) -> str:
        """One paragraph for a condition, an Event or a report."""
        t = f"{self.target:g}"
        head = {
            SLOState.UNKNOWN: f"not judged yet (fewer than {SLO_MIN_OBSERVATIONS} short rounds)",
            SLOState.MET: f"short-round straggler rate within targetStragglerRate {t}",
            SLOState.EXCEEDED: f"short-round straggler rate above targetStragglerRate {t}",
            SLOState.INFEASIBLE: (f"no candidate G can meet targetStragglerRate {t} at"
                                  f" stragglerRatio {self.tau:g}"),
        }[self.state]
        text = (f"{head}: rate {self.rate:.2f} over the last {self.short_rounds} short rounds"
                f" (P(rate > {t}) = {self.p_above_target:.2f}); stragglers per G:"
                f" {self.per_size_text()}")
        if self.long_rounds:
            text += (f"; long rounds (excluded, stragglers by design): {self.long_stragglers}/"
                     f"{self.long_rounds}")
        if self.state is SLOState.INFEASIBLE:
            g0 = self.sizes[0]
            text += (f". The smallest candidate G={g0.group_size} straggles with P(p > {t}) ="
                     f" {g0.p_above_target:.2f}; raise stragglerRatio or targetStragglerRate,"
                     " or add a smaller candidate")
        elif self.state is SLOState.EXCEEDED and self.mode is GroupControlMode.FIXED:
            text += ". Fixed mode: a smaller G (or mode SAGC) may meet it"
        elif self.state is SLOState.EXCEEDED and self.sizes:
            g0 = self.sizes[0]
            text += (f". Not yet known whether the smallest candidate G={g0.group_size} can meet"
                     f" it ({g0.observations} short rounds, P(p > {t}) ="
                     f" {g0.p_above_target:.2f})")
        return text

    def brief(self) -> str:
        """A few characters for a progress line."""
        if self.state is SLOState.UNKNOWN:
            return "?"
        if self.state is SLOState.MET:
            return "met"
        return f"{self.state.value.upper()} {self.rate:.2f}>{self.target:g}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "mode": self.mode.value,
            "target": self.target,
            "tau": self.tau,
            "rate": self.rate,
            "short_rounds": self.short_rounds,
            "short_stragglers": self.short_stragglers,
            "long_rounds": self.long_rounds,
            "long_stragglers": self.long_stragglers,
            "long_rate": self.long_rate,
            "p_above_target": self.p_above_target,
            "per_size": [
                {"group_size": e.group_size, "observations": e.observations,
                 "stragglers": e.stragglers, "rate": e.rate,
                 "posterior_mean": e.posterior_mean, "p_above_target": e.p_above_target}
                for e in self.sizes
            ],
            "message": self.message(),
        }


def straggler_slo_verdict(
    *,
    mode: GroupControlMode,
    target: float,
    tau: float,
    prior: tuple[float, float],
    short_window: tuple[int, int],
    long_window: tuple[int, int] = (0, 0),
    sizes: dict[int, tuple[int, int, float, float]],
    previous: SLOState | None = None,
) -> StragglerSLOVerdict:
    """The straggler SLO's verdict (rule in the module docstring). Pure.

    ``prior``: (alpha0, beta0) of the window's rate; ``short_window`` / ``long_window``:
    (rounds, stragglers); ``sizes``: ``{G: (observations, stragglers, alpha, beta)}`` of
    every candidate (Fixed: the one G); ``previous``: the last verdict, for hysteresis.
    """
    n, s = short_window
    p_rate = beta_above(target, prior[0] + s, prior[1] + (n - s))
    evidence = tuple(
        SizeEvidence(group_size=g, observations=obs, stragglers=k,
                     posterior_mean=a / (a + b), p_above_target=beta_above(target, a, b))
        for g, (obs, k, a, b) in sorted(sizes.items())
    )

    def over(p: float, state: SLOState) -> bool:
        return p >= (SLO_RELEASE if previous is state else SLO_CONFIDENCE)

    state = SLOState.UNKNOWN
    if n >= SLO_MIN_OBSERVATIONS:
        g0 = evidence[0] if evidence else None
        if (mode is GroupControlMode.SAGC and g0 is not None
                and g0.observations >= SLO_MIN_AT_SMALLEST
                and over(g0.p_above_target, SLOState.INFEASIBLE)
                and p_rate >= SLO_RELEASE):
            state = SLOState.INFEASIBLE
        elif over(p_rate, SLOState.EXCEEDED):
            state = SLOState.EXCEEDED
        else:
            state = SLOState.MET
    return StragglerSLOVerdict(
        state=state, mode=mode, target=float(target), tau=float(tau), short_rounds=n,
        short_stragglers=s, long_rounds=long_window[0], long_stragglers=long_window[1],
        p_above_target=p_rate, sizes=evidence,
    )


def _finite_nonneg(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ReportRejected("InvalidReport", f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ReportRejected("InvalidReport", f"{name} must be finite and >= 0, got {value!r}")


def _count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ReportRejected("InvalidReport", f"{name} must be an integer >= 0, got {value!r}")


class JobController:
    """Plan logic of one job: group-size control, step counter, idempotent reports."""

    def __init__(self, cfg: JobControllerConfig | None = None) -> None:
        self._cfg = JobControllerConfig() if cfg is None else cfg
        self._ctl: SAGCController | FixedController = make_controller(
            self._cfg.mode, self._cfg.sagc
        )
        self._next_step = 0
        self._attempt = 0
        self._next_kind = RoundKind.SHORT
        #: Straggler flags of the last steps of every kind, of short rounds (the SLO's) and
        #: of long rounds, each the last ``straggler_window`` of its kind.
        self._window: deque[bool] = deque(maxlen=self._cfg.straggler_window)
        self._short_window: deque[bool] = deque(maxlen=self._cfg.straggler_window)
        self._long_window: deque[bool] = deque(maxlen=self._cfg.straggler_window)
        #: Wall-clock seconds of the steps in the same window (the step-time SLO).
        self._seconds: deque[float] = deque(maxlen=self._cfg.straggler_window)
        self._steps_observed = 0
        self._long_rounds = 0
        self._last_key: tuple[int, int] | None = None
        self._last_report: dict[str, Any] | None = None
        self._last_answer: ControlPlan | None = None
        self._ctl.decide()  # the plan is always fully decided (and in the state)

    # --- views ----------------------------------------------------------------------------
    @property
    def config(self) -> JobControllerConfig:
        return self._cfg

    @property
    def controller(self) -> SAGCController | FixedController:
        return self._ctl

    @property
    def next_step(self) -> int:
        return self._next_step

    @property
    def attempt(self) -> int:
        return self._attempt

    @property
    def long_rounds(self) -> int:
        return self._long_rounds

    @property
    def steps_observed(self) -> int:
        return self._steps_observed

    @property
    def straggler_rate(self) -> float:
        """The SLO's rate: straggler steps among the last ``straggler_window`` short rounds."""
        w = self._short_window
        return sum(w) / len(w) if w else 0.0

    @property
    def long_round_straggler_rate(self) -> float | None:
        """Straggler steps among the last ``straggler_window`` long rounds (None before
        any): long rounds straggle by design and are not part of the SLO."""
        w = self._long_window
        return sum(w) / len(w) if w else None

    @property
    def all_steps_straggler_rate(self) -> float:
        """Straggler steps among the last ``straggler_window`` steps of every kind."""
        return sum(self._window) / len(self._window) if self._window else 0.0

    def slo_verdict(self, previous: SLOState | None = None) -> StragglerSLOVerdict:
        """The straggler SLO's verdict from this job's evidence (see the module docstring);
        ``previous``: the verdict last shown, for hysteresis. Pure."""
        ctl = self._ctl
        post = ctl.posterior()
        counts = ctl.per_size()
        sizes = {g: (*counts.get(g, (0, 0)), a, b) for g, (a, b) in post.items()}
        cfg = self._cfg.sagc
        return straggler_slo_verdict(
            mode=self._cfg.mode, target=cfg.delta, tau=ctl.tau,
            prior=(cfg.alpha0, cfg.beta0),
            short_window=(len(self._short_window), sum(self._short_window)),
            long_window=(len(self._long_window), sum(self._long_window)),
            sizes=sizes, previous=previous,
        )

    @property
    def mean_step_seconds(self) -> float | None:
        """Mean wall-clock time of the last ``straggler_window`` steps (None before any)."""
        return math.fsum(self._seconds) / len(self._seconds) if self._seconds else None

    @property
    def lambda_(self) -> float:
        return self._ctl.lambda_

    def reconfigure(self, sagc: SAGCConfig) -> bool:
        """Switch the SAGC configuration (a run-time policy clamps delta and candidates).

        Deterministic in (state, ``sagc``): a host may persist the resulting state and restore
        it bit-exactly. The pending G may change (when it is no longer a candidate); the
        stored answer to the last report follows, so a repeat of that report gets the plan
        the host answered with. Returns whether anything changed. Fixed mode: no-op (False).
        """
        if self._cfg.mode is not GroupControlMode.SAGC or sagc == self._cfg.sagc:
            return False
        assert isinstance(self._ctl, SAGCController)
        self._ctl.reconfigure(sagc)
        self._cfg = JobControllerConfig(
            mode=self._cfg.mode, sagc=sagc, straggler_window=self._cfg.straggler_window,
            long_rounds_feed_sagc=self._cfg.long_rounds_feed_sagc,
        )
        if self._ctl.pending is None:
            self._ctl.decide()
        if self._last_answer is not None:
            self._last_answer = self.plan(straggler=self._last_answer.straggler)
        return True

    def posterior_means(self) -> dict[int, float]:
        return self._ctl.posterior_means()

    def step_seconds(self) -> dict[int, float]:
        """SAGC's measured seconds of a step per group size, what its objective per second
        prices each size at ({} for a fixed G)."""
        fn = getattr(self._ctl, "step_seconds", None)
        return {} if fn is None else fn()

    def step_prices(self) -> dict[int, float]:
        """What SAGC per second prices a step of each candidate size at now ({} per step,
        before a step is measured, or for a fixed G)."""
        fn = getattr(self._ctl, "step_prices", None)
        return {} if fn is None else fn()

    @property
    def last_report(self) -> StepReportData | None:
        """The last accepted report (a repeat of it gets the same answer)."""
        return None if self._last_report is None else StepReportData.from_dict(self._last_report)

    def plan(self, *, straggler: bool | None = None) -> ControlPlan:
        """The plan for the next step. Pure: calling it changes nothing."""
        g = self._ctl.pending
        assert g is not None  # invariant: decided at construction and after each report
        return ControlPlan(
            step=self._next_step,
            group_size=g,
            round_kind=self._next_kind,
            lambda_=self._ctl.lambda_,
            straggler_rate=self.straggler_rate,
            straggler=straggler,
        )

    # --- reports --------------------------------------------------------------------------
    def validate(self, report: StepReportData) -> None:
        """Raise :class:`ReportRejected` if ``report`` cannot be accepted now (a repeat of
        the last answered report is accepted)."""
        if (report.attempt, report.step) == self._last_key:
            if report.to_dict() != self._last_report:
                raise ReportRejected(
                    "ConflictingRepeat",
                    f"step {report.step} of attempt {report.attempt} was already reported"
                    " with a different body",
                )
            return
        self._validate_new(report)

    def _validate_new(self, r: StepReportData) -> None:
        _count("attempt", r.attempt)
        _count("step", r.step)
        if r.attempt < self._attempt:
            raise ReportRejected(
                "StaleAttempt",
                f"attempt {r.attempt} is older than the current attempt {self._attempt}",
            )
        if r.attempt == self._attempt and r.step != self._next_step:
            raise ReportRejected(
                "StepOutOfOrder",
                f"attempt {r.attempt} must report step {self._next_step} next, got {r.step}"
                " (steps increase by one within an attempt)",
            )
        if r.attempt > self._attempt and r.step > self._next_step:
            raise ReportRejected(
                "StepOutOfOrder",
                f"a new attempt may restart at a step <= {self._next_step}, got {r.step}",
            )
        planned = self._ctl.pending
        if r.group_size != planned:
            raise ReportRejected(
                "GroupSizeNotPlanned",
                f"groupSize {r.group_size} was not planned: the plan's group size is {planned}",
            )
        if not isinstance(r.round_kind, RoundKind) or not isinstance(r.next_round_kind, RoundKind):
            raise ReportRejected("InvalidReport", "roundKind and nextRoundKind must be Short|Long")
        ln = r.lengths
        for name in ("max", "median", "p90"):
            _finite_nonneg(f"lengths.{name}", getattr(ln, name))
        _count("lengths.count", ln.count)
        _count("lengths.aborted", ln.aborted)
        _count("longQueue", r.long_queue)
        for name in ("rollout", "reward", "train", "sync"):
            _finite_nonneg(f"seconds.{name}", getattr(r.seconds, name))
        if ln.count < 1:
            raise ReportRejected("ImpossibleLengths", "lengths.count must be >= 1 (kept responses)")
        if not 0 < ln.median <= ln.p90 <= ln.max:
            raise ReportRejected(
                "ImpossibleLengths",
                f"need 0 < median <= p90 <= max, got median={ln.median} p90={ln.p90}"
                f" max={ln.max}",
            )
        if ln.mean is not None:
            _finite_nonneg("lengths.mean", ln.mean)
            if not 0 < ln.mean <= ln.max:
                raise ReportRejected("ImpossibleLengths",
                                     f"need 0 < mean <= max, got mean={ln.mean} max={ln.max}")
        if r.reward is not None and (
            isinstance(r.reward, bool)
            or not isinstance(r.reward, int | float)
            or not math.isfinite(r.reward)
        ):
            raise ReportRejected("InvalidReport", f"reward must be finite, got {r.reward!r}")
        if r.next_straggler_risk is not None:
            seen: set[int] = set()
            for g, p in r.next_straggler_risk:
                _count("nextStragglerRisk.groupSize", g)
                if (isinstance(p, bool) or not isinstance(p, int | float)
                        or not 0.0 <= p <= 1.0):
                    raise ReportRejected(
                        "InvalidReport",
                        f"nextStragglerRisk.probability must be in [0, 1], got {p!r}")
                if g in seen:
                    raise ReportRejected(
                        "InvalidReport", f"nextStragglerRisk names groupSize {g} twice")
                seen.add(g)

    def observe(self, report: StepReportData) -> ControlPlan:
        """Accept one step report and return the plan for the next step.

        Raises :class:`ReportRejected` (state unchanged) for an impossible report. A repeat
        of the last answered report returns the same answer and changes nothing.
        """
        key = (report.attempt, report.step)
        if key == self._last_key:
            self.validate(report)
            assert self._last_answer is not None
            return self._last_answer
        self._validate_new(report)
        feeds = report.round_kind is RoundKind.SHORT or self._cfg.long_rounds_feed_sagc
        ln = report.lengths
        s = report.seconds
        step_seconds = float(s.rollout + s.reward + s.train + s.sync)
        if feeds:
            straggler = self._ctl.observe(
                report.group_size, ln.max, ln.median, seconds=step_seconds,
                tokens=None if ln.mean is None else ln.mean * ln.count)
        else:
            straggler = self._ctl.is_straggler(ln.max, ln.median)
        risk = report.next_straggler_risk
        self._ctl.decide(None if risk is None else dict(risk))
        self._window.append(straggler)
        if report.round_kind is RoundKind.LONG:
            self._long_window.append(straggler)
        else:
            self._short_window.append(straggler)
        self._seconds.append(step_seconds)
        self._steps_observed += 1
        if report.round_kind is RoundKind.LONG:
            self._long_rounds += 1
        self._attempt = report.attempt
        self._next_step = report.step + 1
        self._next_kind = report.next_round_kind
        answer = self.plan(straggler=straggler)
        self._last_key = key
        self._last_report = report.to_dict()
        self._last_answer = answer
        return answer

    # --- persistence ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable; :meth:`from_state_dict` restores bit-exactly."""
        return {
            "kind": "job_controller",
            "version": _STATE_VERSION,
            "config": self._cfg.to_dict(),
            "controller": self._ctl.state_dict(),
            "next_step": self._next_step,
            "attempt": self._attempt,
            "next_round_kind": self._next_kind.value,
            "window": [bool(x) for x in self._window],
            "short_window": [bool(x) for x in self._short_window],
            "long_window": [bool(x) for x in self._long_window],
            "step_seconds": list(self._seconds),
            "steps_observed": self._steps_observed,
            "long_rounds": self._long_rounds,
            "last": None
            if self._last_key is None
            else {
                "key": list(self._last_key),
                "report": self._last_report,
                "answer": None if self._last_answer is None else self._last_answer.to_dict(),
            },
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> JobController:
        if not isinstance(state, dict) or state.get("kind") != "job_controller":
            raise StateError("not a job-controller state")
        if state.get("version") != _STATE_VERSION:
            raise StateError(f"unsupported state version {state.get('version')!r}")
        try:
            cfg = JobControllerConfig.from_dict(state["config"])
            jc = cls(cfg)
            jc._ctl = controller_from_state_dict(state["controller"])
            if jc._ctl.pending is None:
                raise StateError("controller state has no pending decision")
            jc._next_step = int(state["next_step"])
            jc._attempt = int(state["attempt"])
            jc._next_kind = RoundKind(state["next_round_kind"])
            jc._window = deque((bool(x) for x in state["window"]), maxlen=cfg.straggler_window)
            # Absent in states written before the short-round SLO rate: empty windows (the
            # old window mixed the kinds; which steps were long is not known).
            jc._short_window = deque((bool(x) for x in state.get("short_window", [])),
                                     maxlen=cfg.straggler_window)
            jc._long_window = deque((bool(x) for x in state.get("long_window", [])),
                                    maxlen=cfg.straggler_window)
            # Absent in states written before the step-time SLO: an empty window.
            jc._seconds = deque((float(x) for x in state.get("step_seconds", [])),
                                maxlen=cfg.straggler_window)
            jc._steps_observed = int(state["steps_observed"])
            jc._long_rounds = int(state["long_rounds"])
            last = state["last"]
            if last is not None:
                jc._last_key = (int(last["key"][0]), int(last["key"][1]))
                jc._last_report = last["report"]
                jc._last_answer = ControlPlan.from_dict(last["answer"])
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, StateError | ConfigError):
                raise
            raise StateError(f"cannot restore JobController: {exc!r}") from exc
        return jc
