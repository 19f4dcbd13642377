"""The driver's own round scheduling against the simulator's, on the same recorded round.

Both run a round of the same :class:`TailBatchingPlanner` (the driver's, and a copy of it
before the round): the driver dispatches real requests to engines, polls them, feeds finishes
to the planner and aborts what it says (``Driver.run_round``); the simulator does the same in
simulated time (``rlpacer.sim.rollout.RoundSimulator``). The engines here replay recorded
response lengths on one shared clock (a response of n tokens finishes n decode steps after
the round starts, every engine stepping together), and the simulator gets the cost profile of
that clock (one second a decode step whatever the batch, no prefill, no memory limit). Under
it the two must agree exactly, round after round of one run (short rounds that race and defer,
then the long round they fill): the responses each prompt kept, the planner's whole state
after the round (its long queue included), the responses aborted, and the round's length in
decode steps.

What this does not cover, by design: placement. The simulator puts a prompt's responses on one
engine (prefix sharing) and the driver spreads requests by outstanding count; with a cost per
step that grows with the batch the two differ in timing (docs/benchmarks.md says by how much:
0.3% or less on the DAPO trace), so the shared clock here is batch-independent.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rlpacer.api.job import TailBatchingActivation
from rlpacer.control.tail_batching import RoundKind
from rlpacer.sim.cost import CostProfile
from rlpacer.sim.rollout import RoundSimulator
from rlpacer.sim.trace import load_trace
from rlpacer_trainer import runtime, weights
from rlpacer_trainer.config import RunConfig
from rlpacer_trainer.engine import EngineInfo, EngineStats, Finished, GenRequest

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("close_drivers")]

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "tiny-local.yaml"
DAPO = ROOT / "traces" / "dapo-qwen2.5-32b.jsonl"
_RID = re.compile(r"^r\d+-p(\d+)-i(\d+)$")

#: The shared clock as a simulator cost profile: a decode step is one second at any batch.
STEP_CLOCK = CostProfile(
    name="one second a decode step", base_s=1.0, per_seq_s=0.0, per_kv_token_s=0.0,
    kv_capacity_tokens=10**12, max_num_seqs=10**6, prefill_s_per_token=0.0, kv_watermark=0.0)


class Clock:
    """Decode steps since the round started, shared by every engine; a poll moves it to the
    next finish of any engine (so finishes reach the driver in time order)."""

    def __init__(self) -> None:
        self.t = 0
        self.engines: list[RecordedEngine] = []
        self.polled: set[RecordedEngine] = set()  # engines polled since the clock last moved

    def next_finish(self) -> int | None:
        ends = [t for e in self.engines for t, _ in e.live.values()]
        return min(ends) if ends else None


class RecordedEngine:
    """Replays recorded lengths: response i of prompt p is ``length(p, i)`` tokens long and
    finishes that many steps after it was submitted, on the shared clock."""

    def __init__(self, clock: Clock, length: Any, replica: int) -> None:
        self.clock, self.length, self.replica = clock, length, replica
        self.live: dict[str, tuple[int, int]] = {}  # request id -> (finish step, tokens)
        self.version: str | None = None
        self.st = EngineStats()
        clock.engines.append(self)

    def submit(self, requests: Sequence[GenRequest]) -> None:
        for r in requests:
            m = _RID.match(r.request_id)
            assert m, r.request_id
            n = int(self.length(int(m[1]), int(m[2])))
            self.live[r.request_id] = (self.clock.t + n, n)

    def poll(self, max_steps: int = 16) -> list[Finished]:
        # the driver polls every busy engine once a pass: the clock steps (to the next finish
        # of any engine, when nothing is due) only when a new pass begins, so every engine
        # hands over what finished at a step before the driver sees a later one
        nxt = self.clock.next_finish()
        if self in self.clock.polled and nxt is not None and nxt > self.clock.t:
            self.clock.t = nxt
            self.clock.polled.clear()
        self.clock.polled.add(self)
        due = [rid for rid, (t, _) in self.live.items() if t <= self.clock.t]
        out = []
        for rid in sorted(due, key=lambda r: self.live[r][0]):
            _, n = self.live.pop(rid)
            self.st.tokens += n
            out.append(Finished(rid, (1,) * n, "stop"))
        return out

    def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            if self.live.pop(rid, None) is not None:
                self.st.aborted += 1

    def pending(self) -> int:
        return len(self.live)

    def load_weights(self, blob: bytes) -> float:
        self.version = weights.fingerprint(weights.from_bytes(blob).items())
        return 0.0

    def info(self) -> EngineInfo:
        return EngineInfo(self.replica, "127.0.0.1", "recorded", 0, 0, self.version)

    def stats(self) -> EngineStats:
        return self.st

    def generate(self, requests: Sequence[GenRequest]) -> dict[str, Finished]:
        raise AssertionError("a round is dispatched and polled, never generated at once")


PROMPTS = 64
RESPONSES = 17  # at most G + extra responses a prompt: 16 + 1


def _recorded() -> Any:
    """Response lengths from the DAPO trace (Qwen2.5-32B, groups of 8): prompt p replays
    group p, response i its (i mod 8)-th recorded length, as a rank among all of them (ties
    broken by prompt, then response), so no two responses finish at the same step (a tie's
    order is neither side's to choose) and every round finishes in the recorded order; a rank
    keeps the tokens a test holds small (the planner's decisions follow the order only)."""
    groups = load_trace(DAPO).groups
    base = {(p, i): groups[p].lengths[i % len(groups[p].lengths)]
            for p in range(PROMPTS) for i in range(RESPONSES)}
    rank = {key: k + 1 for k, key in enumerate(sorted(base, key=lambda x: (base[x], x)))}

    def length(p: int, i: int) -> int:
        return rank[(p, i)]
    return length


@pytest.mark.parametrize("engines", [1, 2, 3])
def test_the_driver_and_the_simulator_run_a_recorded_round_alike(engines: int) -> None:
    cfg = RunConfig.load(EXAMPLE, steps=4)  # type: ignore[arg-type]
    cfg.job.spec.prompts_per_step = 12
    cfg.job.spec.data.num_prompts = PROMPTS
    cfg.job.spec.tail_batching.activation = TailBatchingActivation.ALWAYS
    length = _recorded()
    clock = Clock()
    drv = runtime.build_driver(cfg, [RecordedEngine(clock, length, r) for r in range(engines)])
    kinds = []
    for g in (4, 8, 4, 8, 4, 8, 4, 8):  # short rounds race and defer, then a long round
        before = copy.deepcopy(drv.planner)
        clock.t = 0
        clock.polled.clear()
        out = drv.run_round(g)
        steps = clock.t
        # the simulator: the same planner state, the same round, the same lengths
        planner = before
        plan = planner.start_round(g)
        lengths = [[length(p, i) for i in range(plan.responses_per_prompt)]
                   for p in plan.prompts]
        sim = RoundSimulator(STEP_CLOCK, engines, prompt_len=0, sat_batch=1)
        oc = sim.run(planner, list(plan.prompts), lengths)
        res = planner.finish_round()
        assert {p: sorted(k.idx for k in ks) for p, ks in out.kept.items()} == \
            {p: sorted(i) for p, i in res.kept.items()}
        assert drv.planner.long_queue_len == planner.long_queue_len
        assert drv.planner.state_dict() == planner.state_dict()  # queue, epoch, counters
        assert out.aborted == res.aborted_responses
        assert math.isclose(oc.rollout_s, steps), (oc.rollout_s, steps)
        kinds.append(out.kind)
        # every kept response is as long as recorded (the driver's own records)
        for p, ks in out.kept.items():
            assert all(len(k.tokens) == length(p, k.idx) for k in ks)
        if out.kind is RoundKind.LONG:
            break
    assert kinds.count(RoundKind.SHORT) >= 2 and kinds[-1] is RoundKind.LONG, kinds
    assert sorted(drv._served) == list(range(engines))  # every engine served responses
