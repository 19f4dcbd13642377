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
from rlpacer.sim.rollout import RoundSimulator, SideEngines
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


@pytest.mark.parametrize(("engines", "fill", "wide"),
                         [(1, None, False), (2, None, False), (3, None, False), (2, 4, False),
                          (2, 4, True)])
def test_the_driver_and_the_simulator_run_a_recorded_round_alike(
        engines: int, fill: int | None, wide: bool) -> None:
    """Also with ``fillPrompts`` 4 (the epoch's last fresh prompts): the long round's fill
    groups kept, and any aborted and queued, the same on both sides. ``wide``: replica 1 is
    a wide long-round engine (``tailBatching.longRound.tensorParallelSize``): short rounds
    run on replica 0 alone, the long round's queued prompts on replica 1 and its fill on
    replica 0 (the simulator's ``side`` engines, ``rlpacer bench --side-fill``)."""
    cfg = RunConfig.load(EXAMPLE, steps=4)  # type: ignore[arg-type]
    cfg.job.spec.prompts_per_step = 12
    cfg.job.spec.data.num_prompts = PROMPTS
    cfg.job.spec.tail_batching.activation = TailBatchingActivation.ALWAYS
    cfg.job.spec.tail_batching.long_round.fill_prompts = fill
    if wide:
        cfg.job.spec.rollout.replicas = 1
        cfg.job.spec.tail_batching.long_round.tensor_parallel_size = 1
        cfg.job.spec.tail_batching.long_round.rollout_replicas = engines
    length = _recorded()
    clock = Clock()
    drv = runtime.build_driver(cfg, [RecordedEngine(clock, length, r) for r in range(engines)])
    kinds = []
    for g in (4, 8, 4, 8, 4, 8, 4, 8):  # short rounds race and defer, then a long round
        before = copy.deepcopy(drv.planner)
        clock.t = 0
        clock.polled.clear()
        if wide:  # as Driver.use_plan sets it: a long round on the wide engine alone
            drv.active = [1] if drv.planner.next_round_kind is RoundKind.LONG else [0]
        out = drv.run_round(g)
        steps = clock.t
        # the simulator: the same planner state, the same round, the same lengths
        planner = before
        plan = planner.start_round(g)
        lengths = [[length(p, i) for i in range(plan.responses_per_prompt)]
                   for p in plan.prompts]
        side = None
        if wide and plan.kind is RoundKind.LONG:
            sim = RoundSimulator(STEP_CLOCK, engines - 1, prompt_len=0, sat_batch=1)
            side = SideEngines(STEP_CLOCK, 1, 1, frozenset(plan.fill))
        else:
            sim = RoundSimulator(STEP_CLOCK, 1 if wide else engines, prompt_len=0, sat_batch=1)
        oc = sim.run(planner, list(plan.prompts), lengths, side=side)
        if wide:  # each round on its engines: short ones on replica 0, long ones split
            want = {0} if plan.kind is RoundKind.SHORT else {0, 1}
            assert set(drv.active) == want, (plan.kind, drv.active)
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
            if fill:  # the fill ran in the long round, and what of it trained agrees
                assert plan.fill and len(plan.fill) == fill
                assert 0 < len(set(plan.fill) & set(res.kept)) <= fill, res.kept
                assert set(res.deferred) == set(plan.fill) - set(res.kept)
            break
    assert kinds.count(RoundKind.SHORT) >= 2 and kinds[-1] is RoundKind.LONG, kinds
    assert sorted(drv._served) == list(range(engines))  # every engine served responses


def _take(self: RecordedEngine, request_ids: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Live requests handed on with the tokens generated so far (one a step since submit)."""
    out = {}
    for rid in request_ids:
        if rid in self.live:
            t_end, n = self.live.pop(rid)
            out[rid] = (1,) * (n - (t_end - self.clock.t))
    return out


def _submit_continuing(self: RecordedEngine, requests: Sequence[GenRequest]) -> None:
    for r in requests:
        m = _RID.match(r.request_id)
        assert m, r.request_id
        n = int(self.length(int(m[1]), int(m[2])))
        self.live[r.request_id] = (self.clock.t + n - len(r.prefix), n)


class JoiningEngine(RecordedEngine):
    take = _take
    submit = _submit_continuing


def _joining_driver(engines: int, join_at: int, release: bool = False
                    ) -> tuple[Any, Clock, Any, list[int]]:
    """The driver on ``engines`` recorded engines, ``joinMidRound`` on (and
    ``releaseWhenFits`` with ``release``): one more engine is usable from ``join_at`` decode
    steps into a round, up as soon as the driver asks for it. Returns the driver, the clock,
    the recorded lengths and the steps at which the driver saw an engine join."""
    from concurrent.futures import Future

    from rlpacer.api.protocol import RolloutCapacity, RolloutState

    cfg = RunConfig.load(EXAMPLE, steps=4)  # type: ignore[arg-type]
    cfg.job.spec.prompts_per_step = 12
    cfg.job.spec.data.num_prompts = PROMPTS
    cfg.job.spec.tail_batching.activation = TailBatchingActivation.ALWAYS
    cfg.job.spec.tail_batching.long_round.join_mid_round = True
    cfg.job.spec.tail_batching.long_round.release_when_fits = release or None
    length = _recorded()
    clock = Clock()

    def factory(r: int) -> JoiningEngine:
        return JoiningEngine(clock, length, r)

    drv = runtime.build_driver(cfg, [JoiningEngine(clock, length, r) for r in range(engines)],
                               engine_factory=factory, offered_replicas=lambda: {engines})

    def start_now(replicas: Sequence[int]) -> None:  # the engine is up when asked for
        for r in replicas:
            fut: Future[Any] = Future()
            fut.set_result(factory(r))
            drv._joining[r] = fut

    class Cap:  # the plan's capacity: the new replica usable from join_at on
        def __init__(self) -> None:
            self.rollout: RolloutCapacity | None = None

    def plan() -> Any:
        usable = list(range(engines)) + ([engines] if clock.t >= join_at else [])
        c = Cap()
        c.rollout = RolloutCapacity(desired_replicas=engines + 1, ready_replicas=len(usable),
                                    state=RolloutState.SCALING_UP, usable_replicas=usable)
        return c

    joined_at: list[int] = []
    rebalance = drv._rebalance

    def seen_rebalance(new: Sequence[int], **kw: Any) -> None:
        joined_at.append(clock.t)  # the step at which the driver saw the engine up
        rebalance(new, **kw)

    drv._rebalance = seen_rebalance  # type: ignore[method-assign]
    drv._start_in_background = start_now  # type: ignore[method-assign]
    drv.controller.plan = plan  # type: ignore[method-assign]
    return drv, clock, length, joined_at


@pytest.mark.parametrize(("engines", "join_at"), [(1, 40), (2, 25), (2, 200)])
def test_a_mid_round_join_moves_as_many_requests_as_the_simulators(engines: int,
                                                                    join_at: int) -> None:
    """``joinMidRound``: an engine usable from ``join_at`` decode steps into a long round
    joins at the driver's next look at the plan (after the finishes of the step its clock
    reached); joined at that point in the simulator's round too, it takes as many unfinished
    requests from the driver's engines as the simulator's join moves (the quota: unfinished
    over engines, rounded down), and the round keeps the same responses and lasts the same
    steps (the shared clock: a moved response continues at the step it reached). Joined
    later in the round (step 200) fewer are left to move, on both sides alike."""
    drv, clock, length, joined_at = _joining_driver(engines, join_at)
    import rlpacer_trainer.driver as driver_mod

    mp = pytest.MonkeyPatch()
    mp.setattr(driver_mod, "MID_ROUND_POLL_S", 0.0)
    try:
        for g in (4, 8, 4, 8, 4, 8, 4, 8):
            before = copy.deepcopy(drv.planner)
            long = drv.planner.next_round_kind is RoundKind.LONG
            clock.t = 0
            clock.polled.clear()
            drv._moved = 0
            out = drv.run_round(g)
            steps = clock.t
            if not long:
                assert drv._moved == 0
                continue
            planner = before
            plan_ = planner.start_round(g)
            lengths = [[length(p, i) for i in range(plan_.responses_per_prompt)]
                       for p in plan_.prompts]
            # the driver sees the plan between two polls: the join comes after the finishes
            # of the step the clock reached (>= join_at), before the next step's
            at = joined_at[0] + 1e-6 if joined_at else float(join_at)
            sim = RoundSimulator(STEP_CLOCK, engines, prompt_len=0, sat_batch=1)
            oc = sim.run(planner, list(plan_.prompts), lengths, join_engines=1, join_at=at)
            res = planner.finish_round()
            assert {p: sorted(k.idx for k in ks) for p, ks in out.kept.items()} == \
                {p: sorted(i) for p, i in res.kept.items()}
            assert math.isclose(oc.rollout_s, steps, abs_tol=1e-3), (oc.rollout_s, steps)
            assert drv._moved == oc.moved, (drv._moved, oc.moved)
            print(f"{engines} engine(s), usable at step {join_at}, joined at {joined_at}:"
                  f" {drv._moved} moved of a {steps}-step round")
            if join_at < steps:
                assert drv._moved > 0
                assert engines in drv._served  # the joined engine answered some
            for p, ks in out.kept.items():
                assert all(len(k.tokens) == length(p, k.idx) for k in ks)
            break
        else:
            raise AssertionError("no long round")
    finally:
        mp.undo()


@pytest.mark.parametrize(("engines", "join_at"), [(1, 0), (2, 25)])
def test_a_release_gives_the_joined_engine_back_at_the_simulators_step(engines: int,
                                                                        join_at: int) -> None:
    """``releaseWhenFits`` after a mid-round join: the driver gives the joined engine back at
    the first step where the unfinished requests fit on its own engines at the load each held
    after the join (``Driver._release_if_fits``), and the simulator's ``release_base`` (what
    ``rlpacer bench --release-when-fits`` runs) does so at the same step of the same recorded
    round, moving back about as many unfinished requests (which ones the join moved is
    placement, each side's own); the round keeps the same responses and lasts the same
    steps. The release happens only when the next round is short, on both
    sides (``TailBatchingPlanner.long_round_follows``)."""
    drv, clock, length, joined_at = _joining_driver(engines, join_at, release=True)
    assert drv.release_when_fits
    released_at: list[int] = []
    moved_back: list[int] = []
    submit_moved, release = drv._submit_moved, drv.controller.release
    moves: list[tuple[int, int]] = []  # (step, requests) of each move: joins and release

    def seen_moves(batches: dict[int, list[GenRequest]]) -> None:
        moves.append((clock.t, sum(len(b) for b in batches.values())))
        submit_moved(batches)

    def seen_release(attempt: int, step: int) -> bool:
        released_at.append(clock.t)  # asked right after the release's move
        moved_back.append(moves[-1][1])
        return bool(release(attempt, step))

    drv._submit_moved = seen_moves  # type: ignore[method-assign]
    drv.controller.release = seen_release  # type: ignore[method-assign]
    import rlpacer_trainer.driver as driver_mod

    mp = pytest.MonkeyPatch()
    mp.setattr(driver_mod, "MID_ROUND_POLL_S", 0.0)
    try:
        for g in (4, 8, 4, 8, 4, 8, 4, 8):
            before = copy.deepcopy(drv.planner)
            long = drv.planner.next_round_kind is RoundKind.LONG
            clock.t = 0
            clock.polled.clear()
            drv._released_mid = []
            out = drv.run_round(g)
            steps = clock.t
            if not long:
                assert not released_at
                continue
            planner = before
            plan_ = planner.start_round(g)
            next_long = planner.long_round_follows()
            lengths = [[length(p, i) for i in range(plan_.responses_per_prompt)]
                       for p in plan_.prompts]
            at = joined_at[0] + 1e-6 if joined_at else float(join_at)
            sim = RoundSimulator(STEP_CLOCK, engines, prompt_len=0, sat_batch=1)
            oc = sim.run(planner, list(plan_.prompts), lengths, join_engines=1, join_at=at,
                         release_base=0 if next_long else engines)
            res = planner.finish_round()
            assert {p: sorted(k.idx for k in ks) for p, ks in out.kept.items()} == \
                {p: sorted(i) for p, i in res.kept.items()}
            assert math.isclose(oc.rollout_s, steps, abs_tol=1e-3), (oc.rollout_s, steps)
            assert drv._moved == oc.moved, (drv._moved, oc.moved)
            print(f"{engines} engine(s), joined at {joined_at}, released at {released_at}"
                  f" (simulator {oc.released_at}) moving {moved_back} back (simulator"
                  f" {oc.moved_back}) of a {steps}-step round; next round long: {next_long}")
            if next_long:
                assert not released_at and oc.released_at is None
            else:
                assert released_at and oc.released_at is not None
                assert math.isclose(oc.released_at, released_at[0], abs_tol=1e-3)
                # how many are still on the joined engine then depends on which requests
                # the join moved there (placement: the count agrees, the choice is each
                # side's own), so the two may differ by one or two of a dozen
                assert len(moved_back) == 1 and oc.moved_back > 0
                assert abs(moved_back[0] - oc.moved_back) <= max(1, oc.moved_back // 10)
                assert 0 < released_at[0] < steps
                assert engines in drv._served and engines not in drv.pool
            break
        else:
            raise AssertionError("no long round")
    finally:
        mp.undo()
