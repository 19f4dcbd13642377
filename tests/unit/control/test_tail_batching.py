"""Tail batching: exactly-once training, long rounds at P0, aborts at any event, state."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlpacer.control.errors import ConfigError, StateError
from rlpacer.control.tail_batching import (
    PlannerError,
    RoundKind,
    TailBatchingConfig,
    TailBatchingPlanner,
)

pytestmark = pytest.mark.unit


def _events(planner: TailBatchingPlanner, rng: random.Random) -> list[tuple[int, int]]:
    plan = planner.current_round
    assert plan is not None
    events = [(p, i) for p in plan.prompts for i in range(plan.responses_per_prompt)]
    rng.shuffle(events)
    return events


def run_round(
    planner: TailBatchingPlanner, g: int, rng: random.Random, abort_at: int | None = None
) -> dict[int, list[int]] | None:
    """Start a round and feed it shuffled finish events, applying aborts as a driver would.
    Returns the kept groups, or None when the round was aborted after ``abort_at`` events."""
    planner.start_round(g)
    return feed_round(planner, rng, abort_at)


def feed_round(
    planner: TailBatchingPlanner, rng: random.Random, abort_at: int | None = None
) -> dict[int, list[int]] | None:
    """Feed the round in progress shuffled finish events (see :func:`run_round`)."""
    plan = planner.current_round
    assert plan is not None
    aborted: set[tuple[int, int]] = set()
    for n, (p, i) in enumerate(_events(planner, rng)):
        if abort_at is not None and n == abort_at:
            planner.abort_round()
            return None
        if (p, i) in aborted and rng.random() < 0.8:
            continue  # mostly the abort wins; sometimes the response finished first
        d = planner.on_response_finished(p, i)
        aborted.update(d.abort_responses)
        for q in d.abort_prompts:
            aborted.update((q, j) for j in range(plan.responses_per_prompt))
        if d.round_complete:
            break
    return planner.finish_round().kept


def train_all(
    planner: TailBatchingPlanner, g: int, seed: int, abort_prob: float = 0.0
) -> tuple[Counter[tuple[int, int]], list[RoundKind]]:
    """Run rounds until done; returns (epoch, prompt) training counts and the round kinds."""
    rng = random.Random(seed)
    trained: Counter[tuple[int, int]] = Counter()
    kinds = []
    while not planner.done:
        abort_at = None
        if rng.random() < abort_prob:
            abort_at = rng.randrange(0, 40)
        epoch = planner.epoch
        kind = planner.next_round_kind
        kept = run_round(planner, g, rng, abort_at)
        if kept is None:
            continue
        kinds.append(kind)
        for p, idx in kept.items():
            assert len(idx) == g and len(set(idx)) == g
            trained[(epoch, p)] += 1
    return trained, kinds


# --- configuration errors -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompts_per_step": 0}, "prompts_per_step"),
        ({"prompt_overprovision": 0.9}, "prompt_overprovision"),
        ({"prompt_overprovision": float("inf")}, "prompt_overprovision"),
        ({"extra_responses": -1}, "extra_responses"),
        ({"enabled": 1}, "enabled"),
        ({"prompts_per_step": 8, "long_round_prompts": 7}, "long_round_prompts"),
        ({"long_round_prompts": 64.0}, "long_round_prompts"),
        ({"long_round_fill": -1}, "long_round_fill"),
        ({"long_round_fill": 2.0}, "long_round_fill"),
    ],
)
def test_bad_config(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        TailBatchingConfig(**kwargs)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"num_prompts": 0}, "num_prompts"), ({"epochs": 0}, "epochs"), ({"seed": -3}, "seed")],
)
def test_bad_planner_arguments(kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"num_prompts": 10, "seed": 0, "epochs": 1} | kwargs
    with pytest.raises(ConfigError, match=field):
        TailBatchingPlanner(TailBatchingConfig(), **args)


def test_launch_count_is_ceil_eta_p0() -> None:
    assert TailBatchingConfig(prompts_per_step=32, prompt_overprovision=1.25).launched_prompts == 40
    assert TailBatchingConfig(prompts_per_step=10, prompt_overprovision=1.21).launched_prompts == 13
    assert TailBatchingConfig(prompts_per_step=7, enabled=False).launched_prompts == 7


# --- a short round, step by step ------------------------------------------------------------
def test_short_round_keeps_first_finishers_and_defers_the_rest() -> None:
    cfg = TailBatchingConfig(prompts_per_step=2, prompt_overprovision=1.5, extra_responses=1)
    planner = TailBatchingPlanner(cfg, num_prompts=6, seed=0)
    plan = planner.start_round(group_size=2)
    assert plan.kind is RoundKind.SHORT
    assert len(plan.prompts) == 3 and plan.responses_per_prompt == 3
    assert plan.keep_per_prompt == 2 and plan.target_prompts == 2
    a, b, c = plan.prompts
    assert planner.on_response_finished(a, 2).keep
    d = planner.on_response_finished(a, 0)  # a's group is complete: abort its straggler
    assert d.keep and d.abort_responses == [(a, 1)] and not d.round_complete
    late = planner.on_response_finished(a, 1)  # it raced the abort: discarded
    assert not late.keep
    with pytest.raises(PlannerError, match="twice"):
        planner.on_response_finished(a, 1)
    assert planner.on_response_finished(c, 1).keep
    planner.on_response_finished(b, 0)  # b has one finished response; it will be deferred
    d = planner.on_response_finished(c, 2)
    assert d.round_complete and d.abort_prompts == [b] and d.abort_responses == [(c, 0)]
    assert not planner.on_response_finished(b, 1).keep  # after completion: discarded
    res = planner.finish_round()
    assert res.kept == {a: [2, 0], c: [1, 2]}
    assert res.deferred == [b]
    assert res.aborted_responses == 9 - 4
    assert planner.long_queue == [b]
    assert planner.consumed == 2


def test_calls_out_of_order_raise() -> None:
    planner = TailBatchingPlanner(TailBatchingConfig(prompts_per_step=2), num_prompts=4)
    with pytest.raises(PlannerError, match="no round"):
        planner.on_response_finished(0, 0)
    with pytest.raises(PlannerError, match="no round"):
        planner.finish_round()
    plan = planner.start_round(2)
    with pytest.raises(PlannerError, match="in progress"):
        planner.start_round(2)
    outsider = next(p for p in range(4) if p not in plan.prompts)
    with pytest.raises(PlannerError, match="not in round"):
        planner.on_response_finished(outsider, 0)
    with pytest.raises(PlannerError, match="outside"):
        planner.on_response_finished(plan.prompts[0], plan.responses_per_prompt)
    with pytest.raises(PlannerError, match="not complete"):
        planner.finish_round()
    with pytest.raises(ConfigError, match="group_size"):
        TailBatchingPlanner(TailBatchingConfig(), num_prompts=4).start_round(0)


def test_start_after_done_raises() -> None:
    planner = TailBatchingPlanner(TailBatchingConfig(prompts_per_step=4), num_prompts=3)
    train_all(planner, 2, seed=0)
    assert planner.done
    with pytest.raises(PlannerError, match="nothing left"):
        planner.start_round(2)


# --- long rounds ------------------------------------------------------------------------------
def test_long_round_exactly_when_the_queue_reaches_p0() -> None:
    # P0=4, eta=1.25: each full short round launches 5 and defers exactly 1.
    cfg = TailBatchingConfig(prompts_per_step=4, prompt_overprovision=1.25, extra_responses=1)
    planner = TailBatchingPlanner(cfg, num_prompts=100, seed=1)
    rng = random.Random(0)
    kinds = []
    for _ in range(10):
        queue_before = planner.long_queue_len
        expected = RoundKind.LONG if queue_before >= 4 else RoundKind.SHORT
        assert planner.next_round_kind is expected
        plan = planner.start_round(3)
        assert plan.kind is expected
        kinds.append(plan.kind)
        planner.abort_round()
        run_round(planner, 3, rng)
    assert kinds == [RoundKind.SHORT] * 4 + [RoundKind.LONG] + [RoundKind.SHORT] * 4 + [
        RoundKind.LONG
    ]


def test_long_rounds_of_l_prompts_wait_for_l_and_take_l() -> None:
    # P0=4, eta=1.25, L=12: each full short round defers exactly 1, so the queue reaches 12
    # after 12 short rounds, and the long round takes all 12 (FIFO), trained once each
    cfg = TailBatchingConfig(prompts_per_step=4, prompt_overprovision=1.25, extra_responses=1,
                             long_round_prompts=12)
    assert cfg.long_prompts == 12
    planner = TailBatchingPlanner(cfg, num_prompts=200, seed=1)
    rng = random.Random(0)
    kinds, forecasts = [], []
    for _ in range(26):
        forecasts.append(planner.rounds_until_long())
        queue = planner.long_queue
        plan = planner.start_round(3)
        kinds.append(plan.kind)
        if plan.kind is RoundKind.LONG:
            assert plan.prompts == queue[:12] and plan.target_prompts == 12
        feed_round(planner, rng)
    assert kinds == ([RoundKind.SHORT] * 12 + [RoundKind.LONG]) * 2
    # the forecast counts down to the long round at L, not at P0 (after a first round's rate)
    assert forecasts[1:13] == list(range(11, -1, -1))
    assert planner.long_rounds == 2 and planner.long_queue_len == 0


def test_long_rounds_of_l_prompts_flush_at_the_epoch_end_and_train_every_prompt_once() -> None:
    # L beyond what an epoch defers: one long round an epoch, at its end, with every deferred
    # prompt; every prompt of every epoch still trained exactly once
    cfg = TailBatchingConfig(prompts_per_step=4, prompt_overprovision=1.5, extra_responses=1,
                             long_round_prompts=1000)
    planner = TailBatchingPlanner(cfg, num_prompts=60, seed=2, epochs=3)
    trained, kinds = train_all(planner, 3, seed=5, abort_prob=0.2)
    assert set(trained) == {(e, p) for e in range(3) for p in range(60)}
    assert set(trained.values()) == {1}
    assert kinds.count(RoundKind.LONG) == planner.long_rounds == 3
    small = TailBatchingPlanner(TailBatchingConfig(prompts_per_step=4, prompt_overprovision=1.5,
                                                   extra_responses=1), 60, seed=2, epochs=3)
    _, small_kinds = train_all(small, 3, seed=5, abort_prob=0.2)
    assert small_kinds.count(RoundKind.LONG) > 3 * 2  # the default runs several an epoch


def test_state_keeps_long_round_prompts_only_when_set() -> None:
    plain = TailBatchingPlanner(TailBatchingConfig(prompts_per_step=4), 20)
    assert "long_round_prompts" not in plain.state_dict()["config"]  # older trainers read it
    assert TailBatchingPlanner.from_state_dict(plain.state_dict()).config.long_prompts == 4
    big = TailBatchingPlanner(TailBatchingConfig(prompts_per_step=4, long_round_prompts=9), 20)
    state = json.loads(json.dumps(big.state_dict()))
    assert state["config"]["long_round_prompts"] == 9
    assert TailBatchingPlanner.from_state_dict(state).config.long_prompts == 9


def test_retiring_a_long_round_of_l_prompts_takes_l() -> None:
    cfg = TailBatchingConfig(prompts_per_step=2, prompt_overprovision=2.0, extra_responses=1,
                             long_round_prompts=4, min_yield_ratio=0.5)
    planner = TailBatchingPlanner(cfg, num_prompts=40, seed=0)
    rng = random.Random(3)
    def shorts_until_long() -> None:
        while planner.next_round_kind is not RoundKind.LONG:
            run_round(planner, 2, rng)
            planner.observe_yield(RoundKind.SHORT, 2, 10.0)

    shorts_until_long()
    assert planner.long_queue_len == 4  # 2 deferred a round: due at L = 4, not at P0 = 2
    run_round(planner, 2, rng)  # the first long round always runs (it measures the yield)
    planner.observe_yield(RoundKind.LONG, 0, 100.0)  # it taught nothing
    shorts_until_long()
    queue = planner.long_queue
    assert planner.retire_due_long_rounds() == queue and len(queue) == 4
    assert planner.retired == 4 and planner.long_queue_len == 0


def test_long_round_runs_everything_to_completion() -> None:
    cfg = TailBatchingConfig(prompts_per_step=2, prompt_overprovision=2.0, extra_responses=2)
    planner = TailBatchingPlanner(cfg, num_prompts=4, seed=0)
    run_round(planner, 3, random.Random(0))
    assert planner.next_round_kind is RoundKind.LONG
    plan = planner.start_round(3)
    assert plan.responses_per_prompt == 3 and plan.keep_per_prompt == 3
    for n, (p, i) in enumerate(_events(planner, random.Random(1))):
        d = planner.on_response_finished(p, i)
        assert d.keep and not d.abort_prompts and not d.abort_responses
        assert d.round_complete == (n == 5)
    assert planner.finish_round().deferred == []
    assert planner.long_queue_len == 0 and planner.done


def test_final_flush_trains_every_prompt() -> None:
    cfg = TailBatchingConfig(prompts_per_step=8, prompt_overprovision=1.5)
    planner = TailBatchingPlanner(cfg, num_prompts=37, seed=4, epochs=2)
    trained, kinds = train_all(planner, 4, seed=2)
    assert set(trained) == {(e, p) for e in range(2) for p in range(37)}
    assert set(trained.values()) == {1}
    assert planner.consumed == 74 and planner.long_queue_len == 0
    assert kinds.count(RoundKind.LONG) == planner.long_rounds > 0


def test_disabled_is_a_plain_synchronous_batcher() -> None:
    cfg = TailBatchingConfig(prompts_per_step=5, enabled=False, extra_responses=3)
    planner = TailBatchingPlanner(cfg, num_prompts=12, seed=0)
    sizes = []
    rng = random.Random(0)
    while not planner.done:
        plan = planner.start_round(4)
        assert plan.kind is RoundKind.SHORT and plan.responses_per_prompt == 4
        sizes.append(len(plan.prompts))
        for p, i in _events(planner, rng):
            d = planner.on_response_finished(p, i)
            assert d.keep and not d.abort_prompts and not d.abort_responses
        res = planner.finish_round()
        assert res.deferred == [] and res.aborted_responses == 0
    assert sizes == [5, 5, 2]
    assert planner.long_rounds == 0


# --- properties -----------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 50),
    p0=st.integers(1, 10),
    eta=st.floats(1.0, 2.0),
    extra=st.integers(0, 3),
    epochs=st.integers(1, 3),
    enabled=st.booleans(),
    g=st.integers(1, 4),
    abort_prob=st.sampled_from([0.0, 0.3]),
    seed=st.integers(0, 1000),
)
def test_every_prompt_trained_exactly_once_despite_aborts(
    n: int, p0: int, eta: float, extra: int, epochs: int, enabled: bool, g: int,
    abort_prob: float, seed: int,
) -> None:
    cfg = TailBatchingConfig(
        prompts_per_step=p0, prompt_overprovision=eta, extra_responses=extra, enabled=enabled
    )
    planner = TailBatchingPlanner(cfg, num_prompts=n, seed=seed, epochs=epochs)
    trained, kinds = train_all(planner, g, seed, abort_prob)
    assert set(trained) == {(e, p) for e in range(epochs) for p in range(n)}
    assert set(trained.values()) == {1}
    assert planner.consumed == n * epochs
    if not enabled:
        assert RoundKind.LONG not in kinds


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(5, 40),
    p0=st.integers(1, 8),
    rounds_before=st.integers(0, 12),
    seed=st.integers(0, 1000),
    mid_round=st.booleans(),
)
def test_state_round_trip_continues_identically(
    n: int, p0: int, rounds_before: int, seed: int, mid_round: bool
) -> None:
    cfg = TailBatchingConfig(prompts_per_step=p0, prompt_overprovision=1.5, extra_responses=1)
    planner = TailBatchingPlanner(cfg, num_prompts=n, seed=seed, epochs=2)
    rng = random.Random(seed)
    for _ in range(rounds_before):
        if planner.done:
            break
        run_round(planner, 2, rng)
    if mid_round and not planner.done:
        plan = planner.start_round(2)
        planner.on_response_finished(plan.prompts[0], 0)  # a round in flight at the checkpoint
    state = json.loads(json.dumps(planner.state_dict()))
    clone = TailBatchingPlanner.from_state_dict(state)
    planner.abort_round()  # restoring mid-round is the same as aborting that round
    assert clone.state_dict() == planner.state_dict()
    a, b = random.Random(7), random.Random(7)
    while not planner.done:
        assert clone.next_round_kind is planner.next_round_kind
        assert run_round(clone, 2, a) == run_round(planner, 2, b)
    assert clone.done and clone.state_dict() == planner.state_dict()


def test_epoch_orders_are_permutations_and_differ() -> None:
    planner = TailBatchingPlanner(TailBatchingConfig(), num_prompts=50, seed=3, epochs=2)
    o0, o1 = planner.epoch_order(0), planner.epoch_order(1)
    assert sorted(o0) == sorted(o1) == list(range(50))
    assert o0 != o1
    assert TailBatchingPlanner(TailBatchingConfig(), 50, seed=3).epoch_order(0) == o0


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s.update(kind="sagc"),
        lambda s: s.update(version=0),
        lambda s: s.update(queue=[1, 1]),
        lambda s: s.update(queue=[999]),
        lambda s: s.update(position=-1),
        lambda s: s.pop("epoch"),
    ],
)
def test_corrupt_state_is_rejected(mutate: Any) -> None:
    state = TailBatchingPlanner(TailBatchingConfig(), num_prompts=10).state_dict()
    mutate(state)
    with pytest.raises((StateError, ConfigError)):
        TailBatchingPlanner.from_state_dict(state)


# --- a long round deferred while its capacity is not there ------------------------------
@given(seed=st.integers(0, 10_000), defer_prob=st.floats(0.0, 1.0), epochs=st.integers(1, 3))
@settings(max_examples=40, deadline=None)
def test_deferring_due_long_rounds_still_trains_every_prompt_exactly_once(
    seed: int, defer_prob: float, epochs: int
) -> None:
    """A driver whose long rounds' replicas are not ready runs short rounds in their place
    (defer_long_round) as often as it likes: every prompt of every epoch still trains once,
    and a deferral is refused (nothing changed) when no fresh prompt is left in the epoch."""
    cfg = TailBatchingConfig(prompts_per_step=3, prompt_overprovision=1.67, extra_responses=1)
    planner = TailBatchingPlanner(cfg, num_prompts=20, seed=seed, epochs=epochs)
    rng = random.Random(seed)
    trained: Counter[tuple[int, int]] = Counter()
    deferred = refused = 0
    while not planner.done:
        if planner.next_round_kind is RoundKind.LONG and rng.random() < defer_prob:
            fresh_left = planner.position < planner.num_prompts
            queue = planner.long_queue
            if planner.defer_long_round():
                assert fresh_left and planner.next_round_kind is RoundKind.SHORT
                deferred += 1
            else:
                assert not fresh_left and planner.next_round_kind is RoundKind.LONG
                refused += 1
            epoch = planner.epoch
            plan = planner.start_round(2)
            if plan.kind is RoundKind.SHORT:
                assert not set(plan.prompts) & set(queue)  # fresh prompts, queue kept
            kept = feed_round(planner, rng)
        else:
            epoch = planner.epoch
            kept = run_round(planner, 2, rng)
        assert kept is not None
        for p in kept:
            trained[(epoch, p)] += 1
    assert set(trained) == {(e, p) for e in range(epochs) for p in range(20)}
    assert set(trained.values()) == {1}
    if defer_prob == 1.0:
        assert deferred and refused  # deferred while it could; the flushes could not wait


def test_defer_long_round_only_applies_to_a_due_long_round_between_rounds() -> None:
    cfg = TailBatchingConfig(prompts_per_step=2, prompt_overprovision=1.5, extra_responses=1)
    planner = TailBatchingPlanner(cfg, num_prompts=40, seed=1)
    assert planner.next_round_kind is RoundKind.SHORT
    assert planner.defer_long_round() is False  # nothing due
    planner.start_round(2)
    with pytest.raises(PlannerError, match="between rounds"):
        planner.defer_long_round()
    planner.abort_round()
    rng = random.Random(0)
    while planner.next_round_kind is not RoundKind.LONG:
        run_round(planner, 2, rng)
    assert planner.defer_long_round() is True
    assert planner.next_round_kind is RoundKind.SHORT
    planner.start_round(2)
    planner.abort_round()  # an aborted round drops the deferral with it
    assert planner.next_round_kind is RoundKind.LONG


# --- filled long rounds ---------------------------------------------------------------------
def _fill_cfg(**kw: Any) -> TailBatchingConfig:
    return TailBatchingConfig(prompts_per_step=4, prompt_overprovision=1.25, extra_responses=1,
                              long_round_fill=6, **kw)


def test_a_filled_long_round_launches_the_next_fresh_prompts_and_ends_with_its_queued_ones(
) -> None:
    """F = 6: the long round launches its 4 queued prompts and the epoch's next 6 fresh ones;
    it completes when the queued prompts' groups have (whatever the fill's state), the fill
    groups complete by then are kept, the others aborted and queued; the data position moves
    past the fill."""
    planner = TailBatchingPlanner(_fill_cfg(), num_prompts=200, seed=3)
    rng = random.Random(1)
    while planner.next_round_kind is RoundKind.SHORT:
        run_round(planner, 2, rng)
    queue, pos = planner.long_queue, planner.position
    order = planner.epoch_order(0)
    plan = planner.start_round(2)
    assert plan.kind is RoundKind.LONG and plan.queued_prompts == queue[:4]
    assert plan.fill == order[pos:pos + 6] and plan.prompts == [*queue[:4], *plan.fill]
    assert plan.target_prompts == 4 and plan.responses_per_prompt == 2
    # fill 0 and 1 finish first, then the queued prompts; the rest of the fill is slower
    f = plan.fill
    order_ = [(f[0], 0), (f[0], 1), (f[1], 0), (f[1], 1), (f[2], 0)]
    order_ += [(q, i) for q in plan.queued_prompts for i in (0, 1)]
    decisions = [planner.on_response_finished(p, i) for p, i in order_]
    assert all(d.keep for d in decisions)
    assert [d.round_complete for d in decisions] == [False] * (len(order_) - 1) + [True]
    assert sorted(decisions[-1].abort_prompts) == sorted(f[2:])
    # a fill response finishing after the round completed is discarded
    assert not planner.on_response_finished(f[3], 0).keep
    res = planner.finish_round()
    assert sorted(res.kept) == sorted([*plan.queued_prompts, f[0], f[1]])
    assert sorted(res.deferred) == sorted(f[2:])
    assert res.aborted_responses == 2 * 4 + 0  # the 4 deferred fill prompts' 2 responses each
    assert planner.long_queue == [*queue[4:], *res.deferred]
    assert planner.position == pos + 6 and planner.consumed == 4 * 4 + 6


def test_filled_long_rounds_train_every_prompt_once_an_epoch_under_aborts() -> None:
    planner = TailBatchingPlanner(_fill_cfg(), num_prompts=60, seed=2, epochs=3)
    trained, kinds = train_all(planner, 3, seed=7, abort_prob=0.2)
    assert set(trained) == {(e, p) for e in range(3) for p in range(60)}
    assert set(trained.values()) == {1}
    plain = TailBatchingPlanner(TailBatchingConfig(prompts_per_step=4, prompt_overprovision=1.25,
                                                   extra_responses=1), 60, seed=2, epochs=3)
    _, plain_kinds = train_all(plain, 3, seed=7, abort_prob=0.2)
    # the fill trains fresh prompts in the long rounds: fewer rounds for the same prompts
    assert len(kinds) < len(plain_kinds)


def test_no_fill_once_the_epochs_fresh_prompts_are_gone() -> None:
    planner = TailBatchingPlanner(_fill_cfg(long_round_prompts=1000), num_prompts=40, seed=0)
    rng = random.Random(2)
    while planner.next_round_kind is RoundKind.SHORT:
        run_round(planner, 2, rng)
    assert planner.position == 40  # the flush: one long round at the epoch's end
    plan = planner.start_round(2)
    assert plan.kind is RoundKind.LONG and plan.fill == [] and plan.target_prompts == len(
        plan.prompts)


def test_state_keeps_long_round_fill_only_when_set() -> None:
    plain = TailBatchingPlanner(TailBatchingConfig(prompts_per_step=4), 20)
    assert "long_round_fill" not in plain.state_dict()["config"]  # older trainers read it
    filled = TailBatchingPlanner(_fill_cfg(), 20)
    state = json.loads(json.dumps(filled.state_dict()))
    assert state["config"]["long_round_fill"] == 6
    assert TailBatchingPlanner.from_state_dict(state).config.long_round_fill == 6


def test_a_long_round_follows_counts_the_queue_beyond_the_rounds_queued_prompts() -> None:
    """``long_round_follows`` (what releaseWhenFits keeps the added replicas for), during a
    filled long round: the queue beyond its 4 queued prompts, not beyond its 10 launched."""
    planner = TailBatchingPlanner(_fill_cfg(), num_prompts=200, seed=3)
    rng = random.Random(1)
    while planner.long_queue_len < 8:  # two long rounds' worth queued
        if planner.next_round_kind is RoundKind.LONG:
            assert planner.long_round_follows()
            planner.defer_long_round()
        run_round(planner, 2, rng)
    plan = planner.start_round(2)
    assert plan.kind is RoundKind.LONG and len(plan.prompts) == 10
    # 4 or more left beyond its 4 queued (counting its 10 launched would say none)
    assert planner.long_queue_len - 10 < 4 and planner.long_round_follows()
    feed_round(planner, rng)
    assert planner.next_round_kind is RoundKind.LONG  # as forecast


# --- keep_near_cap: a round that reached the cap defers nothing -----------------------------
def _cap_cfg(**kw: Any) -> TailBatchingConfig:
    base: dict[str, Any] = {"prompts_per_step": 4, "prompt_overprovision": 1.5,
                            "extra_responses": 0, "keep_near_cap": 0.1, "response_cap": 100}
    return TailBatchingConfig(**(base | kw))


def _finish_in(planner: TailBatchingPlanner, lengths: dict[int, list[int]]
               ) -> list[tuple[int, int, Any]]:
    """Report every launched response in order of its length (lockstep decode: the shorter
    finishes first), applying aborts as a driver would; returns (prompt, index, decision)."""
    plan = planner.current_round
    assert plan is not None
    events = sorted(((n, p, i) for p, ns in lengths.items() for i, n in enumerate(ns)))
    aborted: set[tuple[int, int]] = set()
    out = []
    for n, p, i in events:
        if (p, i) in aborted:
            continue
        d = planner.on_response_finished(p, i, n)
        out.append((p, i, d))
        aborted.update(d.abort_responses)
        aborted.update((q, j) for q in d.abort_prompts for j in range(plan.responses_per_prompt))
        if d.round_complete:
            break
    return out


def test_a_round_whose_last_group_needed_the_cap_keeps_every_launched_prompt() -> None:
    """6 prompts race for 4 groups; 3 of them have a response that runs to the cap (100), so
    the 4th group completes only at the cap: the round waits for the other two (they end
    there too) and trains all 6 instead of deferring 2 to a long round."""
    planner = TailBatchingPlanner(_cap_cfg(), num_prompts=24, seed=0)
    plan = planner.start_round(group_size=2)
    assert len(plan.prompts) == 6 and plan.target_prompts == 4
    a, b, c, d, e, f = plan.prompts
    lengths = {a: [10, 12], b: [11, 14], c: [13, 9], d: [15, 100], e: [100, 20], f: [8, 100]}
    events = _finish_in(planner, lengths)
    assert events[-1][2].round_complete and not any(x.abort_prompts for _, _, x in events)
    res = planner.finish_round()
    assert res.kept_near_cap and res.deferred == [] and planner.long_queue == []
    assert sorted(res.kept) == sorted(plan.prompts) and planner.consumed == 6
    assert all(len(v) == 2 for v in res.kept.values())


def test_without_keep_near_cap_the_same_round_defers_two_prompts() -> None:
    """The same lengths with the option off: RollPacker's race defers the two prompts whose
    groups were not complete when the 4th one was (what the test above would do if the
    option did nothing)."""
    planner = TailBatchingPlanner(_cap_cfg(keep_near_cap=None, response_cap=None),
                                  num_prompts=24, seed=0)
    plan = planner.start_round(group_size=2)
    a, b, c, d, e, f = plan.prompts
    lengths = {a: [10, 12], b: [11, 14], c: [13, 9], d: [15, 100], e: [100, 20], f: [8, 100]}
    _finish_in(planner, lengths)
    res = planner.finish_round()
    assert not res.kept_near_cap and len(res.kept) == 4 and len(res.deferred) == 2
    assert planner.long_queue == res.deferred


def test_a_round_that_ends_short_of_the_cap_still_defers() -> None:
    """The 4th group completes at 60 tokens, well short of 0.9 x 100: the race defers as
    before, the prompts with a response at the cap go to the long queue."""
    planner = TailBatchingPlanner(_cap_cfg(), num_prompts=24, seed=0)
    plan = planner.start_round(group_size=2)
    a, b, c, d, e, f = plan.prompts
    lengths = {a: [10, 12], b: [11, 14], c: [13, 9], d: [15, 60], e: [100, 20], f: [8, 100]}
    _finish_in(planner, lengths)
    res = planner.finish_round()
    assert not res.kept_near_cap and sorted(res.deferred) == sorted([e, f])
    # f = 0.1: a completing response of 90 tokens is near the cap, 89 is not
    for last, near in ((90, True), (89, False)):
        p = TailBatchingPlanner(_cap_cfg(), num_prompts=24, seed=0)
        plan = p.start_round(group_size=2)
        a, b, c, d, e, f = plan.prompts
        _finish_in(p, {a: [10, 12], b: [11, 14], c: [13, 9], d: [15, last], e: [100, 95],
                       f: [8, 100]})
        assert p.finish_round().kept_near_cap is near


def test_keep_near_cap_only_acts_on_over_provisioned_rounds_and_needs_lengths() -> None:
    """A plain round (tail batching off, or the gate's plain round) and a long round have
    nothing to defer; a round reported without lengths cannot tell and defers as before."""
    planner = TailBatchingPlanner(_cap_cfg(enabled=False), num_prompts=24, seed=0)
    plan = planner.start_round(group_size=2)
    assert len(plan.prompts) == 4
    _finish_in(planner, {p: [100, 100] for p in plan.prompts})
    assert not planner.finish_round().kept_near_cap
    planner = TailBatchingPlanner(_cap_cfg(), num_prompts=24, seed=0)
    plan = planner.start_round(group_size=2)
    for p in plan.prompts[:4]:
        for i in range(2):
            d = planner.on_response_finished(p, i)  # no length
    assert d.round_complete
    assert len(planner.finish_round().deferred) == 2


@settings(max_examples=60, deadline=None)
@given(n=st.integers(6, 40), epochs=st.integers(1, 2), extra=st.integers(0, 2),
       capped=st.floats(0.0, 0.8), seed=st.integers(0, 1000))
def test_keep_near_cap_still_trains_every_prompt_exactly_once(
        n: int, epochs: int, extra: int, capped: float, seed: int) -> None:
    """Any mix of rounds that reach the cap and rounds that do not, with aborts at random:
    every prompt of every epoch is trained exactly once, every kept group has G responses."""
    cfg = _cap_cfg(extra_responses=extra)
    planner = TailBatchingPlanner(cfg, num_prompts=n, seed=seed, epochs=epochs)
    rng = random.Random(seed)
    trained: Counter[tuple[int, int]] = Counter()
    kept_all = 0
    while not planner.done:
        epoch = planner.epoch
        plan = planner.start_round(2)
        if rng.random() < 0.15:
            planner.abort_round()
            continue
        lengths = {p: [100 if rng.random() < capped else rng.randrange(1, 90)
                       for _ in range(plan.responses_per_prompt)] for p in plan.prompts}
        _finish_in(planner, lengths)
        res = planner.finish_round()
        kept_all += res.kept_near_cap
        if res.kept_near_cap:
            assert sorted(res.kept) == sorted(plan.prompts) and not res.deferred
        for p, idx in res.kept.items():
            assert len(idx) == 2
            trained[(epoch, p)] += 1
    assert set(trained) == {(e, p) for e in range(epochs) for p in range(n)}
    assert set(trained.values()) == {1}


def test_keep_near_cap_is_validated_and_kept_in_the_state_only_when_set() -> None:
    with pytest.raises(ConfigError) as err:
        TailBatchingConfig(keep_near_cap=0.1)
    assert err.value.field == "response_cap"
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ConfigError) as err:
            TailBatchingConfig(keep_near_cap=bad, response_cap=100)
        assert err.value.field == "keep_near_cap"
    plain = TailBatchingPlanner(TailBatchingConfig(prompts_per_step=4), 20)
    assert not {"keep_near_cap", "response_cap"} & set(plain.state_dict()["config"])
    state = json.loads(json.dumps(TailBatchingPlanner(_cap_cfg(), 20).state_dict()))
    cfg = TailBatchingPlanner.from_state_dict(state).config
    assert (cfg.keep_near_cap, cfg.response_cap) == (0.1, 100)
