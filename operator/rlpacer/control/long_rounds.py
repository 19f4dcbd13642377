"""Long rounds that earn their time: run a due long round only when it is expected to train.

A long round holds the prompts that lost a short round's race. On some tasks those are the
prompts the policy cannot yet solve: every response of the group wrong, rewards all equal, no
advantage, nothing learnt (DAPO's dynamic sampling drops such groups; GRPO trains them with
zero advantage). Measured on the tiny task (examples/tiny-local.yaml, 30 steps): 10 long
rounds took 34% of the rollout time and gave 1.6% of the trained samples, mean reward 0.005.

:class:`LongRoundYield` keeps, per round kind, the *yield*: informative groups (kept groups
whose rewards are not all equal: the ones that train) per unit of rollout cost, as
exponentially weighted sums (``smoothing`` the newest round's weight). When a long round is
due, it runs if

* no long round has been measured yet (there is nothing to predict from), or
* ``probe_every`` due long rounds in a row were retired (the next one runs to re-measure: the
  policy improves, and yesterday's hopeless prompts may train today), or
* its yield is at least ``min_ratio`` times the short rounds' yield.

Otherwise its prompts are *retired*: they leave the queue without being generated, for this
epoch only (the next epoch offers them again as fresh prompts). The on-policy guarantee is
untouched (nothing is trained from a retired prompt), and every kept prompt is still trained
at most once per epoch. The step is not consumed: the next round is a short one, so a job of
``spec.steps`` steps trains more groups instead of spending steps on rounds that teach
nothing. ``min_ratio = 0`` turns retirement off (every due long round runs, as before).

The cost is whatever the caller measures a round's duration in. The trainer's driver passes
each step's critical path: the longest kept response of each of its rounds, in tokens (a
synchronous round lasts as long as its longest response), which, unlike seconds, is the same
when a run is repeated or resumed, so retirement decisions are too.

Pure and deterministic: no clocks, state in
:meth:`state_dict` (kept in the planner's state, so in the checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rlpacer.api.protocol import RoundKind
from rlpacer.control._validate import require_float, require_int
from rlpacer.control.errors import StateError

__all__ = ["LongRoundYield", "YieldConfig"]


@dataclass(frozen=True)
class YieldConfig:
    min_ratio: float = 0.25
    """A due long round runs when its yield is at least this fraction of a short round's
    (0: always run)."""
    probe_every: int = 4
    """After this many due long rounds retired in a row, the next one runs anyway."""
    smoothing: float = 0.5
    """Weight of the newest round in the yield's running sums (0 < smoothing <= 1)."""

    def __post_init__(self) -> None:
        require_float("min_ratio", self.min_ratio, low=0.0,
                      hint="0 runs every long round; 0.25 retires long rounds that train"
                      " under a quarter as much per unit of cost as short rounds")
        require_int("probe_every", self.probe_every, minimum=1)
        require_float("smoothing", self.smoothing, low=0.0, high=1.0, low_open=True)


class LongRoundYield:
    """Informative groups per unit of rollout cost, per round kind; see the module docstring."""

    def __init__(self, cfg: YieldConfig | None = None) -> None:
        self.cfg = cfg or YieldConfig()
        # per kind: [weighted informative groups, weighted rollout cost, rounds seen]
        self._sums: dict[str, list[float]] = {k.value: [0.0, 0.0, 0.0] for k in RoundKind}
        self.retired_in_a_row = 0
        self.retired_rounds = 0

    def observe(self, kind: RoundKind, informative_groups: int, cost: float) -> None:
        """One finished round (a step's refill rounds may be summed into one observation)."""
        if informative_groups < 0 or not math.isfinite(cost) or cost < 0:
            raise ValueError(f"impossible round: {informative_groups} groups at cost {cost}")
        w = self.cfg.smoothing
        s = self._sums[RoundKind(kind).value]
        s[0] = (1 - w) * s[0] + w * informative_groups
        s[1] = (1 - w) * s[1] + w * cost
        s[2] += 1
        if RoundKind(kind) is RoundKind.LONG:
            self.retired_in_a_row = 0

    def yield_per_s(self, kind: RoundKind) -> float | None:
        """Informative groups per unit of cost (None before any round of ``kind``)."""
        groups, secs, n = self._sums[RoundKind(kind).value]
        if n == 0:
            return None
        return groups / secs if secs > 0 else math.inf if groups > 0 else 0.0

    def should_run_long(self) -> bool:
        """Whether the long round that is due now should run (else: retire its prompts)."""
        if self.cfg.min_ratio == 0.0:
            return True
        long_y, short_y = self.yield_per_s(RoundKind.LONG), self.yield_per_s(RoundKind.SHORT)
        if long_y is None or short_y is None:
            return True
        if self.retired_in_a_row >= self.cfg.probe_every:
            return True
        return long_y >= self.cfg.min_ratio * short_y

    def note_retired(self) -> None:
        self.retired_in_a_row += 1
        self.retired_rounds += 1

    def state_dict(self) -> dict[str, Any]:
        return {"sums": {k: list(v) for k, v in self._sums.items()},
                "retired_in_a_row": self.retired_in_a_row,
                "retired_rounds": self.retired_rounds}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any] | None, cfg: YieldConfig | None = None
                        ) -> LongRoundYield:
        """``None`` (a state written before yields were kept): a fresh tracker."""
        out = cls(cfg)
        if state is None:
            return out
        try:
            for k in out._sums:
                vals = [float(x) for x in state["sums"][k]]
                if len(vals) != 3 or any(not math.isfinite(x) or x < 0 for x in vals):
                    raise ValueError(f"bad sums for {k}: {vals}")
                out._sums[k] = vals
            out.retired_in_a_row = int(state["retired_in_a_row"])
            out.retired_rounds = int(state["retired_rounds"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"cannot restore LongRoundYield: {exc!r}") from exc
        return out
