"""Tail batching's over-provisioning gate (``activation="adaptive"``): off without a tail
(every short round plain), on within its window once short rounds straggle, off again when
probes show the tail gone; its state restores exactly and older states still load."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest

from rlpacer.control.errors import ConfigError, StateError
from rlpacer.control.tail_batching import (
    OverprovisionGate,
    PlannerError,
    RoundKind,
    RoundResult,
    TailBatchingConfig,
    TailBatchingPlanner,
)

pytestmark = pytest.mark.unit

P0, G = 8, 4
Lengths = Callable[[int, int, int], int]  # (round index, prompt, response index) -> tokens


def _cfg(**kw: Any) -> TailBatchingConfig:
    base: dict[str, Any] = {"prompts_per_step": P0, "prompt_overprovision": 1.5,
                            "extra_responses": 1, "activation": "adaptive",
                            "straggler_ratio": 4.0}
    return TailBatchingConfig(**{**base, **kw})


def flat(rnd: int, p: int, i: int) -> int:
    """No tail: 20-29 tokens."""
    return 20 + random.Random(f"{rnd}/{p}/{i}").randrange(10)


def tailed(rnd: int, p: int, i: int) -> int:
    """A long tail: one response in 10 is 200-399 tokens, the rest 20-29."""
    r = random.Random(f"{rnd}/{p}/{i}")
    return 200 + r.randrange(200) if r.random() < 0.1 else 20 + r.randrange(10)


def run_round(planner: TailBatchingPlanner, lengths: Lengths,
              with_lengths: bool = True) -> RoundResult:
    """One round as an engine runs it: responses finish in length order; aborts applied."""
    plan = planner.start_round(G)
    events = sorted((lengths(plan.index, p, i), p, i) for p in plan.prompts
                    for i in range(plan.responses_per_prompt))
    aborted: set[tuple[int, int]] = set()
    for n, p, i in events:
        if (p, i) in aborted:
            continue
        d = planner.on_response_finished(p, i, n if with_lengths else None)
        aborted.update(d.abort_responses)
        for q in d.abort_prompts:
            aborted.update((q, j) for j in range(plan.responses_per_prompt))
        if d.round_complete:
            break
    return planner.finish_round()


def short_rounds(planner: TailBatchingPlanner, lengths: Lengths, n: int) -> list[RoundResult]:
    out = []
    while len(out) < n:
        res = run_round(planner, lengths)
        if res.kind is RoundKind.SHORT:
            out.append(res)
    return out


def test_no_tail_every_round_stays_plain() -> None:
    planner = TailBatchingPlanner(_cfg(), num_prompts=4096, seed=1)
    for res in short_rounds(planner, flat, 60):
        assert not res.overprovisioned and res.straggled is False
        assert res.deferred == [] and res.aborted_responses == 0
        assert len(res.kept) == P0 and all(len(v) == G for v in res.kept.values())
    assert not planner.gate.active and planner.gate.switches == 0
    assert planner.long_rounds == 0 and planner.long_queue_len == 0
    assert planner.position == 60 * P0  # exactly P0 fresh prompts a round, none deferred


def test_a_plain_round_is_exactly_the_disabled_planners_round() -> None:
    off = TailBatchingPlanner(_cfg(enabled=False), num_prompts=100, seed=3)
    gated = TailBatchingPlanner(_cfg(), num_prompts=100, seed=3)
    for _ in range(5):
        a, b = off.start_round(G), gated.start_round(G)
        assert (a.prompts, a.responses_per_prompt, a.target_prompts) == \
            (b.prompts, b.responses_per_prompt, b.target_prompts)
        assert not b.overprovisioned
        off.abort_round()
        gated.abort_round()
        run_round(off, flat)
        run_round(gated, flat)


def test_a_tail_turns_the_gate_on_within_its_window() -> None:
    cfg = _cfg()
    planner = TailBatchingPlanner(cfg, num_prompts=4096, seed=2)
    results = short_rounds(planner, tailed, 12)
    first_on = next(k for k, r in enumerate(results) if r.overprovisioned)
    assert first_on <= cfg.gate_window
    assert all(r.straggled for r in results[:first_on])  # the plain rounds measured the tail
    assert all(r.aborted_responses > 0 and r.deferred for r in results[first_on:]
               if r.overprovisioned)
    assert planner.gate.active
    # the deferred prompts fill the queue and a long round runs them
    kinds = [run_round(planner, tailed).kind for _ in range(12)]
    assert RoundKind.LONG in kinds and planner.long_rounds >= 1


def test_one_odd_straggling_round_does_not_switch_it_on() -> None:
    gate = OverprovisionGate(_cfg())
    for k in range(40):
        lengths = [20] * 31 + ([200] if k % 5 == 0 else [25])  # 1 round in 5 straggles
        gate.observe(lengths, overprovisioned=gate.overprovision_next())
        assert not gate.active


def test_tail_gone_turns_it_off_through_probes() -> None:
    cfg = _cfg(probe_every=4)
    planner = TailBatchingPlanner(cfg, num_prompts=20000, seed=4)
    short_rounds(planner, tailed, 6)
    assert planner.gate.active
    kinds: list[bool] = []  # overprovisioned per short round once the tail is gone
    while planner.gate.active:
        res = run_round(planner, flat)
        if res.kind is RoundKind.SHORT:
            kinds.append(res.overprovisioned)
        assert len(kinds) <= cfg.gate_off * (cfg.probe_every + 1)
    # off after gate_off clean probes (plain rounds), each after at most probe_every quiet
    # raced rounds (the quiet count may have started before the tail went)
    assert kinds.count(False) == cfg.gate_off and kinds[-1] is False and True in kinds
    after = short_rounds(planner, flat, 20)
    assert not any(r.overprovisioned for r in after) and not planner.gate.active


def test_while_the_tail_stays_the_gate_stays_on() -> None:
    planner = TailBatchingPlanner(_cfg(probe_every=2), num_prompts=20000, seed=5)
    results = short_rounds(planner, tailed, 60)
    assert planner.gate.switches == 1 and planner.gate.active
    first_on = next(k for k, r in enumerate(results) if r.overprovisioned)
    probes = [r for r in results[first_on:] if not r.overprovisioned]
    assert all(r.straggled for r in probes)  # every probe still saw the tail


def test_always_races_every_short_round_and_never_probes() -> None:
    planner = TailBatchingPlanner(_cfg(activation="always"), num_prompts=4096, seed=6)
    results = short_rounds(planner, flat, 20)
    assert all(r.overprovisioned and r.deferred and r.straggled is None for r in results)


def test_without_lengths_the_adaptive_gate_observes_nothing() -> None:
    planner = TailBatchingPlanner(_cfg(), num_prompts=4096, seed=6)
    for _ in range(10):
        res = run_round(planner, tailed, with_lengths=False)
        assert not res.overprovisioned and res.straggled is None
    assert planner.gate.history == []


def _drive(planner: TailBatchingPlanner, k: int) -> list[tuple[Any, ...]]:
    lengths = tailed if k % 40 < 20 else flat
    out = []
    for _ in range(k):
        res = run_round(planner, lengths)
        out.append((res.kind, res.overprovisioned, res.straggled, sorted(res.kept),
                    res.deferred))
    return out


@pytest.mark.parametrize("at", [0, 1, 3, 7, 15, 26])
def test_state_round_trip_continues_identically(at: int) -> None:
    cfg = _cfg(probe_every=3)
    a = TailBatchingPlanner(cfg, num_prompts=3000, seed=7)
    b = TailBatchingPlanner(cfg, num_prompts=3000, seed=7)
    rng_rounds = [tailed if (k // 10) % 2 == 0 else flat for k in range(40)]
    for k in range(at):
        run_round(a, rng_rounds[k])
        run_round(b, rng_rounds[k])
    state = json.loads(json.dumps(a.state_dict()))
    assert state["version"] == 3 and "gate" in state and "yield" in state
    c = TailBatchingPlanner.from_state_dict(state)
    assert c.state_dict() == a.state_dict()
    for k in range(at, 40):
        rb, rc = run_round(b, rng_rounds[k]), run_round(c, rng_rounds[k])
        assert (rb.kind, rb.overprovisioned, rb.straggled, rb.kept, rb.deferred) == \
            (rc.kind, rc.overprovisioned, rc.straggled, rc.kept, rc.deferred)
    assert b.state_dict() == c.state_dict()
    assert b.gate.switches >= 1


def test_a_state_written_before_the_gate_loads_and_races_every_round() -> None:
    """A version-1 state (no gate, a config without activation): loads with ``always``, so a
    resumed old run keeps racing every short round, as it did."""
    old = {"kind": "tail_batching", "version": 1,
           "config": {"prompts_per_step": P0, "prompt_overprovision": 1.5,
                      "extra_responses": 1, "enabled": True},
           "num_prompts": 500, "seed": 3, "epochs": 1, "epoch": 0, "position": 24,
           "queue": [5, 9], "rounds": 2, "long_rounds": 0, "consumed": 16}
    planner = TailBatchingPlanner.from_state_dict(old)
    assert planner.config.activation == "always" and planner.long_queue == [5, 9]
    res = run_round(planner, flat)
    assert res.overprovisioned and len(res.deferred) == 4


@pytest.mark.parametrize("mutate", [
    lambda s: s["gate"].update(active="yes"),
    lambda s: s["gate"].update(history=[True] * 9),
    lambda s: s["gate"].update(quiet=-1),
    lambda s: s["gate"].pop("switches"),
    lambda s: s.update(version=4),
    lambda s: s["yield"].update(retired_rounds="many"),
    lambda s: s.update(retired=11),  # more than the 10 prompts
])
def test_corrupt_gate_state_is_rejected(mutate: Any) -> None:
    state = TailBatchingPlanner(_cfg(), num_prompts=10).state_dict()
    mutate(state)
    with pytest.raises(StateError):
        TailBatchingPlanner.from_state_dict(state)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"activation": "sometimes"}, "activation"),
    ({"straggler_ratio": 0.5}, "straggler_ratio"),
    ({"gate_window": 0}, "gate_window"),
    ({"gate_on": 5, "gate_window": 4}, "gate_on"),
    ({"gate_off": 0}, "gate_off"),
    ({"probe_every": 0}, "probe_every"),
])
def test_bad_gate_config(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(**kwargs)
    assert e.value.field == field


def test_a_bad_length_is_refused() -> None:
    planner = TailBatchingPlanner(_cfg(), num_prompts=10)
    plan = planner.start_round(G)
    with pytest.raises(PlannerError):
        planner.on_response_finished(plan.prompts[0], 0, -1)
