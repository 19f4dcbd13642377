"""Tail batching: RollPacker's race-to-finish round planner (ALGORITHMS.md section 2).

The planner owns the data order (prompt ids ``0..N-1``, shuffled per epoch) and decides,
round by round, which prompts run and which responses are kept. It is driven by events
(each response finishing, in finish order) and answers with decisions, so the same code
drives the simulator (``rlpacer.sim``) and the trainer's driver.

Rounds (one round = one step = one policy update)::

    SHORT  launch ceil(eta * P0) fresh prompts x (G + extra) responses; keep the first G
           responses to finish per prompt (abort that prompt's others); the round is complete
           when P0 groups are complete: every other launched prompt is aborted and queued.
    LONG   min(L, queue) queued prompts (FIFO) x G responses, no over-provisioning,
           everything runs to completion; those prompts leave the queue. L is
           ``long_round_prompts`` (default P0).

``next_round_kind`` is LONG when the queue holds at least L prompts, or when the epoch's
fresh prompts are exhausted and the queue is not empty (the flush); otherwise SHORT.

A long round lasts about as long as its longest response, which decodes at a small batch
whatever the round's size, so L > P0 runs fewer long rounds of the same length each: the
same prompts trained in less rollout time (``rlpacer bench --long-round-prompts``). The
trainer then splits such a round's update into as many optimizer steps as L / P0 steps
would have made (the trainer driver's ``long_round_mini_batches``), so updates per prompt
are unchanged.

**Filled long rounds** (``long_round_fill`` F > 0). The same fact leaves a long round's
engines mostly idle once its short responses are done. A filled long round also launches the
next F fresh prompts x G responses beside its queued ones, to be generated in that idle
capacity under the same weights; the round completes when every queued prompt's group has
(as before: it does not wait for fill), and then each fill prompt whose group has not
completed is aborted and queued for a later long round, as a short round defers its slowest.
Its fill groups that completed are trained in the same update as the queued ones (the trainer
counts them in its optimizer steps as it counts the queued ones). Every prompt still trains
exactly once an epoch; ``target_prompts`` counts the queued prompts only.

Decisions taken here:

* **Exactly once.** State changes only in :meth:`TailBatchingPlanner.finish_round` (the
  commit). ``start_round`` only reserves prompts; :meth:`abort_round` (failure, restart)
  drops the round and its prompts return to where they were (fresh prompts stay at the data
  position, queued prompts stay queued). A ``state_dict()`` taken mid-round restores as if
  the round was aborted. So every prompt of every epoch has its group generated and scored
  to completion exactly once; a group that dynamic sampling later drops still counts as
  consumed (the planner's job ends at "scored").
* **Late finishers are discarded.** A response finishing after its prompt already has G
  kept (it raced the abort), or after its prompt was deferred, or after the round completed,
  gets ``keep=False``. Reporting the same response twice is an error.
* **Epoch ends flush the queue.** When an epoch's fresh prompts are exhausted, long rounds
  of at most L queued prompts run until the queue is empty before the next epoch starts, so
  epochs never mix, no prompt id is queued twice, and every policy trains the same prompts
  (``prompts_trained`` is equal to the baseline's). At an epoch's end a short round may
  launch fewer than P0 prompts; it then keeps them all (its target is min(P0, launched)).
* **Deferred prompts start over.** A deferred prompt's finished responses are discarded and
  its whole group is generated again in the long round (as in RollPacker): the kept group
  is then a sample of one policy, with no selection bias toward short responses.
* **A round that reached the cap defers nothing** (``keep_near_cap`` f, off by default).
  Deferral exists so that a short round need not wait for its tail. When the response that
  completes an over-provisioned round's P0-th group is itself at least ``(1 - f)`` of the
  length cap long, the round has waited for the tail already: the responses still running
  started with it and end within ``f`` of the cap, while deferring their prompts would
  throw away what they generated, generate their groups again in a long round and hold back
  what they teach until then. So the round waits for every launched prompt's group and
  keeps them all (up to ceil(eta * P0) groups, ``RoundResult.kept_near_cap``); nothing is
  deferred. It happens when more than ceil(eta * P0) - P0 prompts have a response running
  to the cap: a tail too wide to fit in the prompts the race may defer.
* ``enabled=False`` is a plain synchronous batcher: every round is SHORT with P0 prompts
  (fewer at an epoch's end), G responses each, nothing aborted, complete when all are done.
* The data order of epoch ``e`` is ``Generator(PCG64([seed, e])).permutation(N)``: the
  state holds the seed, the epoch and the position instead of a generator state, so it
  stays small for any N and restores exactly.
* **Over-provisioning only where there is a tail** (``activation="adaptive"``): an
  :class:`OverprovisionGate` decides, short round by short round, whether the round is
  over-provisioned (ceil(eta * P0) prompts x (G + extra), deferral) or plain (P0 prompts x
  G, nothing aborted, exactly the ``enabled=False`` round). It starts off and looks only at
  the lengths of the responses each short round keeps (given to
  :meth:`TailBatchingPlanner.on_response_finished`). So on a workload without a long tail
  nothing is ever aborted or deferred and no long round runs; once the tail shows, the
  rounds race and the queue fills as above. Long rounds are never gated: whatever is queued
  drains as before. ``activation="always"`` (the default of this class, and of every state
  written before the gate existed) over-provisions every short round.
* **Long rounds that do not pay are retired** (``min_yield_ratio > 0``): the driver gives
  each step's informative groups and rollout cost to :meth:`observe_yield`; between
  rounds :meth:`retire_due_long_rounds` takes a due long round's prompts out of the queue
  ungenerated when its measured yield is under ``min_yield_ratio`` of the short rounds'
  (:class:`~rlpacer.control.long_rounds.LongRoundYield`: the first long round always runs,
  and every ``yield_probe_every``-th due one runs to re-measure). Retired prompts are done
  for their epoch (``retired``; ``done`` counts them), never trained in it, and offered again
  as fresh prompts in the next; no step is spent on them. With 0 (this class's default)
  nothing is retired and every policy trains the same prompts.
* **Routing** (optional, ``start_round(g, route=...)``): an over-provisioned short round
  sends the fresh prompts a predicate flags (a length prior's "predicted long",
  :mod:`rlpacer.control.length_prior`) straight to the long queue instead of racing them,
  at most ``launched - P0`` a round; they are committed with the round (an aborted round
  routes nothing) and trained once in a long round, like a deferred prompt.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from rlpacer.api.protocol import RoundKind
from rlpacer.control._validate import require_bool, require_float, require_int
from rlpacer.control.errors import ConfigError, StateError
from rlpacer.control.long_rounds import LongRoundYield, YieldConfig
from rlpacer.control.sagc import is_straggler

__all__ = [
    "ACTIVATIONS",
    "Decision",
    "OverprovisionGate",
    "PlannerError",
    "RoundKind",
    "RoundPlan",
    "RoundPreview",
    "RoundResult",
    "TailBatchingConfig",
    "TailBatchingPlanner",
]

_STATE_VERSION = 3  # 3: long-round yields and retired prompts; 2: the gate; 1 still loads

#: ``TailBatchingConfig.activation``: ``always`` over-provisions every short round (the
#: planner before the gate); ``adaptive`` lets :class:`OverprovisionGate` decide.
ACTIVATIONS = ("always", "adaptive")


class PlannerError(RuntimeError):
    """A call out of order (no round in progress, unknown prompt, duplicate event, ...)."""


@dataclass(frozen=True)
class TailBatchingConfig:
    """Configuration of :class:`TailBatchingPlanner`; invalid values raise ConfigError."""

    prompts_per_step: int = 32
    """P0: prompts trained per step (>= 1)."""
    prompt_overprovision: float = 1.25
    """eta: a short round launches ceil(eta * P0) prompts (>= 1)."""
    extra_responses: int = 1
    """Responses launched beyond G per prompt in a short round (>= 0)."""
    enabled: bool = True
    """False: a plain synchronous batcher (the baseline)."""
    activation: str = "always"
    """``always``: every short round is over-provisioned; ``adaptive``: only while the
    :class:`OverprovisionGate` is on (see there)."""
    straggler_ratio: float = 4.0
    """tau of the gate's straggler test ``max > tau * median`` (SAGC's, sagc.is_straggler)."""
    gate_window: int = 4
    """W: the gate remembers its last W observations (>= 1)."""
    gate_on: int = 2
    """Straggling short rounds among the last W observed that switch the gate on (1..W)."""
    gate_off: int = 2
    """Consecutive non-straggling observations (probes) that switch the gate off (>= 1)."""
    probe_every: int = 8
    """While on: after this many over-provisioned rounds whose kept lengths did not
    straggle, the next short round is a plain probe (>= 1)."""
    min_yield_ratio: float = 0.0
    """A due long round runs only when its measured yield (informative groups per rollout
    second) is at least this fraction of the short rounds'; otherwise its prompts are retired
    for the epoch (:class:`~rlpacer.control.long_rounds.LongRoundYield`). 0: every due long
    round runs (the planner before yields were kept)."""
    yield_probe_every: int = 4
    """After this many due long rounds retired in a row, the next one runs to re-measure."""
    long_round_prompts: int | None = None
    """L: a long round waits for this many queued prompts and runs at most this many
    (>= ``prompts_per_step``; None: ``prompts_per_step``, RollPacker's long round)."""
    long_round_fill: int = 0
    """F: fresh prompts a long round also launches beside its queued ones, generated in the
    engine capacity its tail leaves idle: each kept if its group completes before the queued
    prompts' last does, deferred to the long queue otherwise (>= 0; 0: RollPacker's long
    round, queued prompts only)."""
    keep_near_cap: float | None = None
    """f: an over-provisioned short round whose P0-th group completes with a response of at
    least ``(1 - f) * response_cap`` tokens defers nothing; it waits for every launched
    prompt's group and keeps them all (see the module docstring). None: off (RollPacker's
    race, every such round defers)."""
    response_cap: int | None = None
    """The responses' length cap in tokens (the sampling's max_tokens); needed by
    ``keep_near_cap``."""

    def __post_init__(self) -> None:
        require_int("prompts_per_step", self.prompts_per_step, minimum=1)
        require_float(
            "prompt_overprovision", self.prompt_overprovision, low=1.0,
            hint="1.0 launches exactly P0 prompts (no prompt over-provisioning)",
        )
        require_int("extra_responses", self.extra_responses, minimum=0)
        require_bool("enabled", self.enabled)
        if self.activation not in ACTIVATIONS:
            raise ConfigError(
                "activation", f"must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}"
            )
        require_float("straggler_ratio", self.straggler_ratio, low=1.0)
        require_int("gate_window", self.gate_window, minimum=1)
        require_int("gate_on", self.gate_on, minimum=1)
        if self.gate_on > self.gate_window:
            raise ConfigError(
                "gate_on", f"must be <= gate_window ({self.gate_window}), got {self.gate_on}"
            )
        require_int("gate_off", self.gate_off, minimum=1)
        require_int("probe_every", self.probe_every, minimum=1)
        YieldConfig(min_ratio=self.min_yield_ratio, probe_every=self.yield_probe_every)
        if self.long_round_prompts is not None:
            require_int("long_round_prompts", self.long_round_prompts,
                        minimum=self.prompts_per_step)
        require_int("long_round_fill", self.long_round_fill, minimum=0)
        if self.keep_near_cap is not None:
            require_float("keep_near_cap", self.keep_near_cap, low=0.0, high=1.0,
                          high_open=True,
                          hint="0 keeps a round whose last group needed a response cut at the"
                          " cap; 0.1 one within a tenth of the cap")
            if self.response_cap is None:
                raise ConfigError("response_cap", "keep_near_cap needs the responses' length"
                                  " cap (tokens)")
        if self.response_cap is not None:
            require_int("response_cap", self.response_cap, minimum=1)

    @property
    def long_prompts(self) -> int:
        """L: the prompts a long round waits for and runs at most."""
        if self.long_round_prompts is None:
            return self.prompts_per_step
        return self.long_round_prompts

    def yield_config(self) -> YieldConfig:
        return YieldConfig(min_ratio=self.min_yield_ratio, probe_every=self.yield_probe_every)

    @property
    def launched_prompts(self) -> int:
        """Prompts a full short round launches: ceil(eta * P0) (P0 when disabled)."""
        if not self.enabled:
            return self.prompts_per_step
        # The epsilon keeps 1.25 * 32 = 40.000000000000004 from becoming 41.
        launched = math.ceil(self.prompt_overprovision * self.prompts_per_step - 1e-9)
        return max(self.prompts_per_step, launched)


@dataclass(frozen=True)
class RoundPlan:
    kind: RoundKind
    index: int
    """Sequential index of the round (= committed rounds before it)."""
    prompts: list[int]
    responses_per_prompt: int
    """Responses to launch per prompt (G + extra in a short round, G otherwise)."""
    keep_per_prompt: int
    """G: responses kept per trained prompt."""
    target_prompts: int
    """Groups the round trains (the rest of a short round's prompts are deferred)."""
    epoch: int
    overprovisioned: bool = False
    """A short round that races ceil(eta * P0) prompts x (G + extra); False: a plain round
    (every launched response runs to completion and is kept) or a long round."""
    routed: list[int] = field(default_factory=list)
    """Fresh prompts sent straight to the long queue, never launched in this round (the
    ``route`` predicate of :meth:`TailBatchingPlanner.start_round`); queued at the commit."""
    fill: list[int] = field(default_factory=list)
    """A long round's fresh prompts (``long_round_fill``), the last ``len(fill)`` of
    ``prompts``: each kept if its group completes before every queued prompt's has,
    deferred to the long queue otherwise. ``target_prompts`` counts the queued ones only."""

    @property
    def queued_prompts(self) -> list[int]:
        """The prompts taken from the long queue (all of a long round's but its fill; none
        of a short round's)."""
        if self.kind is not RoundKind.LONG:
            return []
        return self.prompts[: len(self.prompts) - len(self.fill)]


@dataclass(frozen=True)
class RoundPreview:
    """The next round as :meth:`TailBatchingPlanner.peek_round` sees it before its G."""

    kind: RoundKind
    prompts: list[int]
    """The prompts it launches."""
    target_prompts: int
    """Groups it trains: the first to complete in a race, every one otherwise."""
    extra_responses: int
    """Responses launched beyond G per prompt (0 unless an over-provisioned short round)."""


@dataclass(frozen=True)
class Decision:
    keep: bool
    """Whether the finished response belongs to the trained batch."""
    abort_prompts: list[int] = field(default_factory=list)
    """Prompts whose running responses must all be aborted now (deferred to the queue)."""
    abort_responses: list[tuple[int, int]] = field(default_factory=list)
    """(prompt, response index) pairs to abort now (surplus responses of a complete group)."""
    round_complete: bool = False
    """True once the round has all its groups; call finish_round()."""


@dataclass(frozen=True)
class RoundResult:
    kind: RoundKind
    index: int
    kept: dict[int, list[int]]
    """Trained prompt -> kept response indices (G each), in completion order."""
    deferred: list[int]
    """Prompts that went to the long queue."""
    aborted_responses: int
    """Responses launched and not kept (aborted or discarded late finishers)."""
    overprovisioned: bool = False
    """The round was an over-provisioned short round (:attr:`RoundPlan.overprovisioned`)."""
    routed: list[int] = field(default_factory=list)
    """Prompts routed straight to the long queue (:attr:`RoundPlan.routed`)."""
    kept_near_cap: bool = False
    """An over-provisioned round that reached the cap before its P0-th group completed and
    so kept every launched prompt (``keep_near_cap``)."""
    straggled: bool | None = None
    """What the gate observed from this short round's kept lengths: True/False, or None
    when it took nothing from it (a long round, lengths not given, an over-provisioned
    round that did not straggle, ``activation="always"``)."""


class OverprovisionGate:
    """Decides, short round by short round, whether the round is over-provisioned.

    Pure: it sees only the kept response lengths of each short round, in order.

    * **Off** (the start): every short round is plain, so every response runs to completion
      and its kept lengths are the uncensored ones. Each such round is one observation:
      straggled = ``max > tau * median`` (SAGC's test, with SAGC's tau). The gate switches
      on when at least ``gate_on`` of its last ``gate_window`` observations straggled
      (default 2 of 4: one odd round does not switch it, a real tail does within W rounds).
    * **On**: short rounds are over-provisioned. Their kept lengths are censored (the race
      aborts the slowest responses and prompts), so they prove a tail but cannot disprove
      one: a round whose kept lengths still straggle is an observation (True); one that does
      not is no observation, only counted. After ``probe_every`` such quiet rounds in a row
      the next short round is a plain **probe** (uncensored, one observation). The gate
      switches off after ``gate_off`` non-straggling observations in a row since it switched
      on (default 2 clean probes, so at least 2 * probe_every rounds on: the hysteresis).
      While the tail is there, probes are rare: every censored straggle, and every
      straggling probe, restarts the quiet count.
    * Every switch clears the observations, so the new state needs fresh evidence to flip
      back; the gate cannot flap from round to round.

    With ``activation="always"`` it is always on and never probes (the planner before the
    gate). Its state is a few integers (:meth:`state_dict`), restored exactly.
    """

    def __init__(self, cfg: TailBatchingConfig) -> None:
        self._cfg = cfg
        self._active = False
        self._history: list[bool] = []  # observations since the last switch, the last W
        self._quiet = 0  # over-provisioned rounds since the last observation
        self._switches = 0

    @property
    def adaptive(self) -> bool:
        return self._cfg.activation == "adaptive"

    @property
    def active(self) -> bool:
        """On: short rounds are over-provisioned (but for a probe)."""
        return True if not self.adaptive else self._active

    @property
    def switches(self) -> int:
        """How often the gate switched (on or off) so far."""
        return self._switches

    @property
    def history(self) -> list[bool]:
        return list(self._history)

    def overprovision_next(self) -> bool:
        """Whether the next short round is over-provisioned (False: plain, or a probe)."""
        if not self.adaptive:
            return True
        return self._active and self._quiet < self._cfg.probe_every

    def observe(self, lengths: Sequence[int], *, overprovisioned: bool) -> bool | None:
        """A short round finished with these kept lengths; returns the observation (None:
        none taken). Switches the gate as the class docstring says."""
        if not self.adaptive or not lengths:
            return None
        cfg = self._cfg
        straggled = is_straggler(float(max(lengths)), float(statistics.median(lengths)),
                                 cfg.straggler_ratio)
        if overprovisioned and not straggled:
            self._quiet += 1
            return None
        self._quiet = 0
        self._history = [*self._history, straggled][-cfg.gate_window :]
        if not self._active and sum(self._history) >= cfg.gate_on:
            self._switch(True)
        elif (self._active and len(self._history) >= cfg.gate_off
              and not any(self._history[-cfg.gate_off :])):
            self._switch(False)
        return straggled

    def _switch(self, on: bool) -> None:
        self._active = on
        self._history = []
        self._quiet = 0
        self._switches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"active": self._active, "history": list(self._history),
                "quiet": self._quiet, "switches": self._switches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        active, history = state["active"], state["history"]
        if not isinstance(active, bool) or not isinstance(history, list) or not all(
            isinstance(x, bool) for x in history
        ):
            raise StateError("gate: active and history must be booleans")
        if len(history) > self._cfg.gate_window:
            raise StateError("gate: history longer than gate_window")
        quiet, switches = int(state["quiet"]), int(state["switches"])
        if quiet < 0 or switches < 0:
            raise StateError("gate: negative counters")
        self._active, self._history = active, list(history)
        self._quiet, self._switches = quiet, switches


class _PromptRun:
    __slots__ = ("aborted", "finished", "kept", "lengths")

    def __init__(self) -> None:
        self.finished: set[int] = set()
        self.kept: list[int] = []
        self.lengths: list[int | None] = []  # of the kept responses, as reported
        self.aborted = False


class _Round:
    def __init__(self, plan: RoundPlan) -> None:
        self.plan = plan
        self.runs = {p: _PromptRun() for p in plan.prompts}
        self.complete_order: list[int] = []
        self.complete = False
        self.deferred: list[int] = []
        self.fill = set(plan.fill)
        self.queued_left = len(plan.prompts) - len(plan.fill)  # a filled long round's
        self.keep_all = False  # keep_near_cap: the round waits for every launched prompt


#: Short rounds whose queue growth the long-round forecast averages.
FORECAST_ROUNDS = 8


def ask_early(rounds_until_long: int | None, short_step_s: float, lead_s: float) -> bool:
    """Whether to ask for a long round's extra replicas now, ahead of the report before it:
    the round is forecast ``rounds_until_long`` short rounds away (each ``short_step_s``) and
    its replicas take ``lead_s`` to join; waiting one more report would leave them less than
    that. ``lead_s`` 0: never (the scale-up is asked only when the next round is long)."""
    if rounds_until_long is None or rounds_until_long < 1 or lead_s <= 0:
        return False
    return (rounds_until_long - 1) * max(0.0, short_step_s) < lead_s


class TailBatchingPlanner:
    """Race-to-finish round planner; see the module docstring."""

    def __init__(
        self, cfg: TailBatchingConfig, num_prompts: int, seed: int = 0, epochs: int = 1
    ) -> None:
        if not isinstance(cfg, TailBatchingConfig):
            raise ConfigError("config", f"must be a TailBatchingConfig, got {type(cfg).__name__}")
        self._cfg = cfg
        self._n = require_int("num_prompts", num_prompts, minimum=1)
        self._seed = require_int("seed", seed, minimum=0)
        self._epochs = require_int("epochs", epochs, minimum=1)
        self._epoch = 0
        self._position = 0  # fresh prompts of this epoch consumed or deferred
        self._queue: list[int] = []
        self._rounds = 0
        self._long_rounds = 0
        self._consumed = 0
        self._order_cache: tuple[int, np.ndarray] | None = None
        self._round: _Round | None = None
        self._gate = OverprovisionGate(cfg)
        self._yield = LongRoundYield(cfg.yield_config())
        self._retired = 0  # prompts whose due long round was retired (not trained)
        #: prompts each of the last short rounds added to the queue (deferred and routed):
        #: the forecast of the next long round (:meth:`rounds_until_long`)
        self._queued_recent: list[int] = []
        #: the next round is a short one in place of a due long round (defer_long_round)
        self._defer = False

    # --- views ----------------------------------------------------------------------------
    @property
    def config(self) -> TailBatchingConfig:
        return self._cfg

    @property
    def num_prompts(self) -> int:
        return self._n

    @property
    def epochs(self) -> int:
        return self._epochs

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        """Fresh prompts of the current epoch already handed out for good."""
        return self._position

    @property
    def long_queue_len(self) -> int:
        return len(self._queue)

    @property
    def long_queue(self) -> list[int]:
        return list(self._queue)

    @property
    def rounds(self) -> int:
        return self._rounds

    @property
    def long_rounds(self) -> int:
        return self._long_rounds

    @property
    def consumed(self) -> int:
        """Prompts (over all epochs) whose group was generated and scored to completion."""
        return self._consumed

    @property
    def retired(self) -> int:
        """Prompts (over all epochs) whose due long round was retired: never generated, not
        trained in that epoch (:meth:`retire_due_long_rounds`)."""
        return self._retired

    @property
    def yields(self) -> LongRoundYield:
        """Informative groups per unit of rollout cost per round kind (the driver feeds it)."""
        return self._yield

    @property
    def total_prompts(self) -> int:
        return self._n * self._epochs

    @property
    def gate(self) -> OverprovisionGate:
        """The over-provisioning gate (read it; the planner feeds it)."""
        return self._gate

    @property
    def overprovision_next(self) -> bool:
        """Whether the next short round is over-provisioned (False when disabled)."""
        return self._cfg.enabled and self._gate.overprovision_next()

    @property
    def in_round(self) -> bool:
        return self._round is not None

    @property
    def done(self) -> bool:
        """Every prompt of every epoch has been trained exactly once (or retired)."""
        return self._consumed + self._retired == self.total_prompts

    @property
    def next_round_kind(self) -> RoundKind:
        """The kind of round :meth:`start_round` will plan next (SHORT once done)."""
        if self._queue and (len(self._queue) >= self._cfg.long_prompts
                            or self._position >= self._n):
            if self._defer and self._position < self._n:
                return RoundKind.SHORT  # a short round in the due long round's place
            return RoundKind.LONG
        return RoundKind.SHORT

    def defer_long_round(self) -> bool:
        """The next round is a due long round whose capacity is not there yet (its extra
        rollout replicas wait for a queue or their pods): plan one short round in its place,
        from the epoch's fresh prompts. The long queue keeps its prompts (its deferred ones
        join them), so every prompt still trains exactly once; the long round is due again
        after that round. Applies to the next :meth:`start_round` only and is not part of
        the state (a resumed run decides again). Returns False, changing nothing, when the
        next round is not long or no fresh prompt is left in the epoch (its flush cannot
        wait for a short round)."""
        if self._round is not None:
            raise PlannerError("a round is in progress: defer a long round between rounds")
        if self.next_round_kind is not RoundKind.LONG or self._position >= self._n:
            return False
        self._defer = True
        return True

    def rounds_until_long(self) -> int | None:
        """A forecast: how many short rounds run before the next long round (0: the next
        round is long). The queue grows by what the last full short rounds added to it
        (their mean, over the last ``FORECAST_ROUNDS``; an epoch's last, short of fresh
        prompts, is not counted) until it holds L prompts, or the epoch's
        fresh prompts run out (the flush) with prompts queued. None: no long round is
        foreseen (tail batching off, the job done, or nothing queued lately and none
        queued). The driver times a long round's scale-up with it; nothing here depends
        on it."""
        if not self._cfg.enabled or self.done:
            return None
        if self.next_round_kind is RoundKind.LONG:
            return 0
        p0 = self._cfg.prompts_per_step
        long_p = self._cfg.long_prompts
        q = len(self._queue)
        rate = (sum(self._queued_recent) / len(self._queued_recent)
                if self._queued_recent else 0.0)
        # each short round takes its launched prompts from the epoch's fresh ones; the last,
        # with fewer left, keeps all it launches (queues none); then the queue is flushed
        launched = self._cfg.launched_prompts if self.overprovision_next else p0
        fresh = self._n - self._position
        full_left, partial = divmod(fresh, launched)
        if rate > 0:
            need = max(1, math.ceil((long_p - q) / rate - 1e-9))
            if need <= full_left:
                return need
        rounds_to_end = full_left + (1 if partial else 0)
        if q + full_left * rate > 0:
            return max(1, rounds_to_end)  # the epoch's flush
        if rate > 0 and self._epoch + 1 < self._epochs:
            return rounds_to_end + max(1, math.ceil(long_p / rate - 1e-9))  # the next epoch's
        return None

    def epoch_order(self, epoch: int) -> list[int]:
        """The data order of ``epoch`` (deterministic in the seed)."""
        return [int(x) for x in self._order(epoch)]

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            perm = np.random.Generator(np.random.PCG64([self._seed, epoch])).permutation(self._n)
            self._order_cache = (epoch, perm)
        return self._order_cache[1]

    # --- a round --------------------------------------------------------------------------
    def _select(
        self, route: Callable[[int], bool] | None
    ) -> tuple[RoundKind, list[int], list[int], bool]:
        """The next round's (kind, launched prompts, routed prompts of a short round or fill
        prompts of a long one, over-provisioned); reads the planner only. The prompts do not
        depend on the round's group size."""
        cfg = self._cfg
        p0 = cfg.prompts_per_step
        kind = self.next_round_kind
        order = self._order(self._epoch)
        if kind is RoundKind.LONG:
            fill = [int(x) for x in order[self._position : self._position + cfg.long_round_fill]]
            return kind, [*self._queue[: cfg.long_prompts], *fill], fill, False
        over = self.overprovision_next
        full = cfg.launched_prompts if over else p0
        launched = min(full, self._n - self._position)
        routed: list[int] = []
        if over and route is not None:
            budget = launched - p0
            prompts: list[int] = []
            at = self._position
            while len(prompts) < launched and at < self._n:
                p = int(order[at])
                at += 1
                if len(routed) < budget and route(p):
                    routed.append(p)
                else:
                    prompts.append(p)
        else:
            prompts = [int(x) for x in order[self._position : self._position + launched]]
        return kind, prompts, routed, over

    def peek_round(self, route: Callable[[int], bool] | None = None) -> RoundPreview:
        """What :meth:`start_round` would launch next with the same ``route``, whatever the
        group size, without starting it: a length prior's straggler risk for SAGC's choice of
        G is computed from it (rlpacer.control.length_prior.LengthPrior.straggler_risk)."""
        if self._round is not None:
            raise PlannerError("a round is in progress: peek at the next one after its commit")
        if self.done:
            raise PlannerError("every prompt of every epoch is trained: nothing left to plan")
        kind, prompts, _, over = self._select(route)
        target = len(prompts) if kind is RoundKind.LONG else min(
            self._cfg.prompts_per_step, len(prompts))
        return RoundPreview(kind, prompts, target,
                            self._cfg.extra_responses if over else 0)

    def start_round(
        self, group_size: int, route: Callable[[int], bool] | None = None
    ) -> RoundPlan:
        """Plan the next round with group size ``group_size`` (from SAGC or a fixed G).

        ``route`` (an over-provisioned short round only): a predicate on fresh prompt ids,
        e.g. a length prior's "predicted long". A fresh prompt it flags is not launched but
        goes straight to the long queue (at the commit, with the round's deferred prompts),
        and the next fresh prompt takes its place; at most ``launched - P0`` prompts a round
        (as many as the race would defer), so routing never grows the long queue faster than
        racing does. The predicate must be deterministic for a resumed run to repeat it."""
        g = require_int("group_size", group_size, minimum=1)
        if self._round is not None:
            raise PlannerError("a round is in progress: finish_round() or abort_round() first")
        if self.done:
            raise PlannerError("every prompt of every epoch is trained: nothing left to plan")
        cfg = self._cfg
        p0 = cfg.prompts_per_step
        kind, prompts, routed, over = self._select(route)
        if kind is RoundKind.LONG:
            fill = routed  # a long round's fresh prompts
            plan = RoundPlan(kind, self._rounds, prompts, g, g, len(prompts) - len(fill),
                             self._epoch, fill=fill)
        else:
            per_prompt = g + cfg.extra_responses if over else g
            plan = RoundPlan(
                kind, self._rounds, prompts, per_prompt, g, min(p0, len(prompts)), self._epoch,
                overprovisioned=over, routed=routed,
            )
        self._round = _Round(plan)
        self._defer = False
        return plan

    @property
    def current_round(self) -> RoundPlan | None:
        return None if self._round is None else self._round.plan

    def long_round_follows(self) -> bool:
        """During a round: whether the round after it will be long, as far as is known now.
        A long round's queued prompts leave the queue at its commit, so what follows is what
        the queue holds beyond them (as :attr:`next_round_kind` will say then; a filled long
        round's fill deferrals, not known until it ends, are not counted). Between rounds:
        whether the next round is long. The driver keeps a long round's added replicas
        while this holds (``releaseWhenFits``), and so does the simulator."""
        cur = self.current_round
        left = len(self._queue) - (len(cur.queued_prompts) if cur is not None else 0)
        return left > 0 and (left >= self._cfg.long_prompts or self._position >= self._n)

    def on_response_finished(
        self, prompt_id: int, response_index: int, length: int | None = None
    ) -> Decision:
        """A response finished (events in finish order). Returns what to keep and abort.
        ``length``: its length in tokens, which the gate reads (``activation="adaptive"``
        observes only rounds whose kept responses all came with one)."""
        rnd = self._round
        if rnd is None:
            raise PlannerError("no round in progress: call start_round() first")
        run = rnd.runs.get(prompt_id)
        if run is None:
            raise PlannerError(f"prompt {prompt_id} is not in round {rnd.plan.index}")
        plan = rnd.plan
        if not 0 <= response_index < plan.responses_per_prompt:
            raise PlannerError(
                f"response index {response_index} of prompt {prompt_id} outside"
                f" [0, {plan.responses_per_prompt})"
            )
        if response_index in run.finished:
            raise PlannerError(f"response {response_index} of prompt {prompt_id} reported twice")
        if length is not None and (isinstance(length, bool) or not isinstance(length, int)
                                   or length < 0):
            raise PlannerError(f"length of response {response_index} of prompt {prompt_id}"
                               f" must be a token count >= 0, got {length!r}")
        run.finished.add(response_index)
        g = plan.keep_per_prompt
        if rnd.complete or run.aborted or len(run.kept) >= g:
            return Decision(keep=False, round_complete=rnd.complete)
        run.kept.append(response_index)
        run.lengths.append(length)
        if len(run.kept) < g:
            return Decision(keep=True)
        # This prompt's group is complete.
        rnd.complete_order.append(prompt_id)
        abort_responses = [
            (prompt_id, i) for i in range(plan.responses_per_prompt) if i not in run.finished
        ]
        if plan.fill:  # a filled long round ends with its queued prompts' last group
            if prompt_id not in rnd.fill:
                rnd.queued_left -= 1
            if rnd.queued_left > 0:
                return Decision(keep=True, abort_responses=abort_responses)
        elif len(rnd.complete_order) < plan.target_prompts:
            return Decision(keep=True, abort_responses=abort_responses)
        elif rnd.keep_all or self._near_cap(plan, length):
            # the round has waited for the cap already: what still runs ends within
            # keep_near_cap of it, and deferring it would only generate it again later
            rnd.keep_all = True
            if len(rnd.complete_order) < len(plan.prompts):
                return Decision(keep=True, abort_responses=abort_responses)
        # The round has its groups: defer every other launched prompt.
        rnd.complete = True
        done = set(rnd.complete_order)
        for p in plan.prompts:
            if p not in done:
                rnd.runs[p].aborted = True
                rnd.deferred.append(p)
        return Decision(
            keep=True,
            abort_prompts=list(rnd.deferred),
            abort_responses=abort_responses,
            round_complete=True,
        )

    def _near_cap(self, plan: RoundPlan, length: int | None) -> bool:
        """Whether an over-provisioned short round whose P0-th group just completed with a
        response of ``length`` tokens keeps every launched prompt (``keep_near_cap``)."""
        f, cap = self._cfg.keep_near_cap, self._cfg.response_cap
        return (f is not None and cap is not None and plan.overprovisioned
                and length is not None and length >= (1.0 - f) * cap)

    def finish_round(self) -> RoundResult:
        """Commit the complete round: its groups count as trained, deferred prompts queue."""
        rnd = self._round
        if rnd is None:
            raise PlannerError("no round in progress")
        if not rnd.complete:
            raise PlannerError(
                f"round {rnd.plan.index} is not complete: {len(rnd.complete_order)} of"
                f" {rnd.plan.target_prompts} groups done"
            )
        plan = rnd.plan
        kept = {p: list(rnd.runs[p].kept) for p in rnd.complete_order}
        straggled: bool | None = None
        if plan.kind is RoundKind.LONG:
            del self._queue[: len(plan.prompts) - len(plan.fill)]
            self._position += len(plan.fill)
            self._queue.extend(rnd.deferred)  # fill prompts whose groups did not complete
            self._long_rounds += 1
        else:
            self._position += len(plan.prompts) + len(plan.routed)
            self._queue.extend(plan.routed)
            self._queue.extend(rnd.deferred)
            cfg = self._cfg
            full = cfg.launched_prompts if plan.overprovisioned else cfg.prompts_per_step
            if len(plan.prompts) >= full:
                # a full round (an epoch's last, with fewer fresh prompts, keeps them all
                # and queues none: not the rate of the rounds to come)
                added = len(plan.routed) + len(rnd.deferred)
                self._queued_recent = [*self._queued_recent, added][-FORECAST_ROUNDS:]
            lengths = [n for p in rnd.complete_order for n in rnd.runs[p].lengths]
            known = [n for n in lengths if n is not None]
            if self._cfg.enabled and len(known) == len(lengths):
                straggled = self._gate.observe(known, overprovisioned=plan.overprovisioned)
        self._consumed += len(kept)
        self._rounds += 1
        self._round = None
        self._maybe_next_epoch()
        launched = plan.responses_per_prompt * len(plan.prompts)
        return RoundResult(
            kind=plan.kind,
            index=plan.index,
            kept=kept,
            deferred=list(rnd.deferred),
            aborted_responses=launched - sum(len(v) for v in kept.values()),
            overprovisioned=plan.overprovisioned,
            routed=list(plan.routed),
            kept_near_cap=rnd.keep_all,
            straggled=straggled,
        )

    def observe_yield(self, kind: RoundKind, informative_groups: int, cost: float) -> None:
        """A finished step's informative groups (groups whose rewards are not all equal) and
        rollout cost (the driver: each round's longest kept response in tokens, summed over
        the step's refill rounds), for the long-round yield."""
        self._yield.observe(kind, informative_groups, cost)

    def retire_due_long_rounds(self) -> list[int]:
        """Between rounds: while the next round is a long one that its measured yield does
        not pay for (:meth:`LongRoundYield.should_run_long`), take its prompts out of the
        queue without generating them; they count as done for this epoch (the next epoch
        offers them again). Returns the retired prompt ids (none when
        ``min_yield_ratio`` is 0). Call it after :meth:`finish_round` and before reporting
        the next round's kind."""
        if self._round is not None:
            raise PlannerError("a round is in progress: retire long rounds between rounds")
        out: list[int] = []
        long_p = self._cfg.long_prompts
        while (not self.done and self.next_round_kind is RoundKind.LONG
               and not self._yield.should_run_long()):
            batch = self._queue[:long_p]
            del self._queue[:long_p]
            self._retired += len(batch)
            self._yield.note_retired()
            out.extend(batch)
            self._maybe_next_epoch()
        return out

    def abort_round(self) -> None:
        """Drop the round in progress (a failure or restart): nothing is lost or duplicated.
        A no-op when no round is in progress."""
        self._round = None
        self._defer = False

    def _maybe_next_epoch(self) -> None:
        if self._position >= self._n and not self._queue and self._epoch + 1 < self._epochs:
            self._epoch += 1
            self._position = 0

    # --- persistence ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable committed state (data position, queue, seed); a round in
        progress is not included (restoring is the same as aborting it)."""
        return {
            "kind": "tail_batching",
            "version": _STATE_VERSION,
            "config": self._config_state(),
            "num_prompts": self._n,
            "seed": self._seed,
            "epochs": self._epochs,
            "epoch": self._epoch,
            "position": self._position,
            "queue": list(self._queue),
            "rounds": self._rounds,
            "long_rounds": self._long_rounds,
            "consumed": self._consumed,
            "gate": self._gate.state_dict(),
            "yield": self._yield.state_dict(),
            "retired": self._retired,
            "queued_recent": list(self._queued_recent),
        }

    def _config_state(self) -> dict[str, Any]:
        """The config as stored: ``long_round_prompts``, ``long_round_fill``,
        ``keep_near_cap`` and ``response_cap`` only when set, so a state of a job that leaves
        them unset stays readable by a trainer that predates them."""
        cfg = asdict(self._cfg)
        if cfg["long_round_prompts"] is None:
            del cfg["long_round_prompts"]
        if not cfg["long_round_fill"]:
            del cfg["long_round_fill"]
        for key in ("keep_near_cap", "response_cap"):
            if cfg[key] is None:
                del cfg[key]
        return cfg

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> TailBatchingPlanner:
        if not isinstance(state, dict) or state.get("kind") != "tail_batching":
            raise StateError("not a tail-batching planner state")
        if state.get("version") not in (1, 2, _STATE_VERSION):
            raise StateError(f"unsupported state version {state.get('version')!r}")
        try:
            cfg = TailBatchingConfig(**state["config"])
            planner = cls(cfg, state["num_prompts"], state["seed"], state["epochs"])
            planner._epoch = int(state["epoch"])
            planner._position = int(state["position"])
            planner._queue = [int(p) for p in state["queue"]]
            planner._rounds = int(state["rounds"])
            planner._long_rounds = int(state["long_rounds"])
            planner._consumed = int(state["consumed"])
            if "gate" in state:  # version 1 has none: a fresh gate (its config: "always")
                planner._gate.load_state_dict(state["gate"])
            # versions 1-2 kept no yields (their config has min_yield_ratio 0: none retired)
            planner._yield = LongRoundYield.from_state_dict(state.get("yield"), cfg.yield_config())
            planner._retired = int(state.get("retired", 0))
            # older states kept no forecast: it starts over (it only times a scale-up)
            planner._queued_recent = [int(x) for x in state.get("queued_recent", [])
                                      ][-FORECAST_ROUNDS:]
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"cannot restore TailBatchingPlanner: {exc!r}") from exc
        n = planner._n
        if not 0 <= planner._consumed + planner._retired <= planner.total_prompts:
            raise StateError("consumed + retired prompts out of range")
        if not (0 <= planner._epoch < planner._epochs and 0 <= planner._position <= n):
            raise StateError("epoch/position out of range")
        if len(set(planner._queue)) != len(planner._queue) or any(
            not 0 <= p < n for p in planner._queue
        ):
            raise StateError("queue holds duplicate or unknown prompt ids")
        return planner

