"""Tail batching: RollPacker's race-to-finish round planner (ALGORITHMS.md section 2).

The planner owns the data order (prompt ids ``0..N-1``, shuffled per epoch) and decides,
round by round, which prompts run and which responses are kept. It is driven by events
(each response finishing, in finish order) and answers with decisions, so the same code
drives the simulator (``rlpacer.sim``) and the trainer's driver.

Rounds (one round = one step = one policy update)::

    SHORT  launch ceil(eta * P0) fresh prompts x (G + extra) responses; keep the first G
           responses to finish per prompt (abort that prompt's others); the round is complete
           when P0 groups are complete: every other launched prompt is aborted and queued.
    LONG   min(P0, queue) queued prompts (FIFO) x G responses, no over-provisioning,
           everything runs to completion; those prompts leave the queue.

``next_round_kind`` is LONG when the queue holds at least P0 prompts, or when the epoch's
fresh prompts are exhausted and the queue is not empty (the flush); otherwise SHORT.

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
  of at most P0 queued prompts run until the queue is empty before the next epoch starts, so
  epochs never mix, no prompt id is queued twice, and every policy trains the same prompts
  (``prompts_trained`` is equal to the baseline's). At an epoch's end a short round may
  launch fewer than P0 prompts; it then keeps them all (its target is min(P0, launched)).
* **Deferred prompts start over.** A deferred prompt's finished responses are discarded and
  its whole group is generated again in the long round (as in RollPacker): the kept group
  is then a sample of one policy, with no selection bias toward short responses.
* ``enabled=False`` is a plain synchronous batcher: every round is SHORT with P0 prompts
  (fewer at an epoch's end), G responses each, nothing aborted, complete when all are done.
* The data order of epoch ``e`` is ``Generator(PCG64([seed, e])).permutation(N)``: the
  state holds the seed, the epoch and the position instead of a generator state, so it
  stays small for any N and restores exactly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from rlpacer.api.protocol import RoundKind
from rlpacer.control._validate import require_bool, require_float, require_int
from rlpacer.control.errors import ConfigError, StateError

__all__ = [
    "Decision",
    "PlannerError",
    "RoundKind",
    "RoundPlan",
    "RoundResult",
    "TailBatchingConfig",
    "TailBatchingPlanner",
]

_STATE_VERSION = 1


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

    def __post_init__(self) -> None:
        require_int("prompts_per_step", self.prompts_per_step, minimum=1)
        require_float(
            "prompt_overprovision", self.prompt_overprovision, low=1.0,
            hint="1.0 launches exactly P0 prompts (no prompt over-provisioning)",
        )
        require_int("extra_responses", self.extra_responses, minimum=0)
        require_bool("enabled", self.enabled)

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


class _PromptRun:
    __slots__ = ("aborted", "finished", "kept")

    def __init__(self) -> None:
        self.finished: set[int] = set()
        self.kept: list[int] = []
        self.aborted = False


class _Round:
    def __init__(self, plan: RoundPlan) -> None:
        self.plan = plan
        self.runs = {p: _PromptRun() for p in plan.prompts}
        self.complete_order: list[int] = []
        self.complete = False
        self.deferred: list[int] = []


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
    def total_prompts(self) -> int:
        return self._n * self._epochs

    @property
    def in_round(self) -> bool:
        return self._round is not None

    @property
    def done(self) -> bool:
        """Every prompt of every epoch has been trained exactly once."""
        return self._consumed == self.total_prompts

    @property
    def next_round_kind(self) -> RoundKind:
        """The kind of round :meth:`start_round` will plan next (SHORT once done)."""
        p0 = self._cfg.prompts_per_step
        if self._queue and (len(self._queue) >= p0 or self._position >= self._n):
            return RoundKind.LONG
        return RoundKind.SHORT

    def epoch_order(self, epoch: int) -> list[int]:
        """The data order of ``epoch`` (deterministic in the seed)."""
        return [int(x) for x in self._order(epoch)]

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            perm = np.random.Generator(np.random.PCG64([self._seed, epoch])).permutation(self._n)
            self._order_cache = (epoch, perm)
        return self._order_cache[1]

    # --- a round --------------------------------------------------------------------------
    def start_round(self, group_size: int) -> RoundPlan:
        """Plan the next round with group size ``group_size`` (from SAGC or a fixed G)."""
        g = require_int("group_size", group_size, minimum=1)
        if self._round is not None:
            raise PlannerError("a round is in progress: finish_round() or abort_round() first")
        if self.done:
            raise PlannerError("every prompt of every epoch is trained: nothing left to plan")
        cfg = self._cfg
        p0 = cfg.prompts_per_step
        kind = self.next_round_kind
        if kind is RoundKind.LONG:
            prompts = list(self._queue[:p0])
            plan = RoundPlan(kind, self._rounds, prompts, g, g, len(prompts), self._epoch)
        else:
            order = self._order(self._epoch)
            launched = min(cfg.launched_prompts, self._n - self._position)
            prompts = [int(x) for x in order[self._position : self._position + launched]]
            per_prompt = g + cfg.extra_responses if cfg.enabled else g
            plan = RoundPlan(
                kind, self._rounds, prompts, per_prompt, g, min(p0, launched), self._epoch
            )
        self._round = _Round(plan)
        return plan

    @property
    def current_round(self) -> RoundPlan | None:
        return None if self._round is None else self._round.plan

    def on_response_finished(self, prompt_id: int, response_index: int) -> Decision:
        """A response finished (events in finish order). Returns what to keep and abort."""
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
        run.finished.add(response_index)
        g = plan.keep_per_prompt
        if rnd.complete or run.aborted or len(run.kept) >= g:
            return Decision(keep=False, round_complete=rnd.complete)
        run.kept.append(response_index)
        if len(run.kept) < g:
            return Decision(keep=True)
        # This prompt's group is complete.
        rnd.complete_order.append(prompt_id)
        abort_responses = [
            (prompt_id, i) for i in range(plan.responses_per_prompt) if i not in run.finished
        ]
        if len(rnd.complete_order) < plan.target_prompts:
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
        if plan.kind is RoundKind.LONG:
            del self._queue[: len(plan.prompts)]
            self._long_rounds += 1
        else:
            self._position += len(plan.prompts)
            self._queue.extend(rnd.deferred)
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
        )

    def abort_round(self) -> None:
        """Drop the round in progress (a failure or restart): nothing is lost or duplicated.
        A no-op when no round is in progress."""
        self._round = None

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
            "config": asdict(self._cfg),
            "num_prompts": self._n,
            "seed": self._seed,
            "epochs": self._epochs,
            "epoch": self._epoch,
            "position": self._position,
            "queue": list(self._queue),
            "rounds": self._rounds,
            "long_rounds": self._long_rounds,
            "consumed": self._consumed,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> TailBatchingPlanner:
        if not isinstance(state, dict) or state.get("kind") != "tail_batching":
            raise StateError("not a tail-batching planner state")
        if state.get("version") != _STATE_VERSION:
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
        except (KeyError, TypeError) as exc:
            raise StateError(f"cannot restore TailBatchingPlanner: {exc!r}") from exc
        n = planner._n
        if not (0 <= planner._epoch < planner._epochs and 0 <= planner._position <= n):
            raise StateError("epoch/position out of range")
        if len(set(planner._queue)) != len(planner._queue) or any(
            not 0 <= p < n for p in planner._queue
        ):
            raise StateError("queue holds duplicate or unknown prompt ids")
        return planner

