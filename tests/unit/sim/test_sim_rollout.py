"""The event-driven rollout: timing, busy fraction, KV-bound preemption, planner aborts."""

from __future__ import annotations

import dataclasses

import pytest

from rlpacer.control.tail_batching import TailBatchingConfig, TailBatchingPlanner
from rlpacer.sim.cost import fit_cpu_profile
from rlpacer.sim.rollout import RoundSimulator, SideEngines
from rlpacer.sim.workload import Workload, scenario

pytestmark = pytest.mark.unit

CPU = fit_cpu_profile()
PROMPT = 10


def _plain(num_prompts: int, g: int) -> TailBatchingPlanner:
    cfg = TailBatchingConfig(prompts_per_step=num_prompts, enabled=False)
    planner = TailBatchingPlanner(cfg, num_prompts=num_prompts)
    planner.start_round(g)
    return planner


def test_single_sequence_time_and_busy_fraction() -> None:
    planner = _plain(1, 1)
    sim = RoundSimulator(CPU, engines=1, prompt_len=PROMPT, sat_batch=100)
    out = sim.run(planner, planner.current_round.prompts, [[500]])  # type: ignore[union-attr]
    prefill = CPU.prefill_s_per_token * PROMPT
    decode = 500 * CPU.step_s(1, 0)
    assert out.rollout_s == pytest.approx(prefill + decode)
    assert out.busy_fraction == pytest.approx((prefill + decode / 100) / (prefill + decode))
    assert out.kept_lengths == [500] and out.aborted == 0


def test_batch_shares_decode_steps() -> None:
    planner = _plain(1, 2)
    sim = RoundSimulator(CPU, engines=1, prompt_len=PROMPT, sat_batch=100)
    out = sim.run(planner, planner.current_round.prompts, [[100, 300]])  # type: ignore[union-attr]
    prefill = 2 * CPU.prefill_s_per_token * PROMPT
    expected = prefill + 100 * CPU.step_s(2, 0) + 200 * CPU.step_s(1, 0)
    assert out.rollout_s == pytest.approx(expected)
    assert sorted(out.kept_lengths) == [100, 300]


def test_kv_bound_preempts_and_still_finishes_everything() -> None:
    small = dataclasses.replace(CPU, kv_capacity_tokens=1200)
    lengths = [[400, 420, 440, 460]]
    free = RoundSimulator(CPU, engines=1, prompt_len=PROMPT, sat_batch=4)
    bound = RoundSimulator(small, engines=1, prompt_len=PROMPT, sat_batch=4)
    p1, p2 = _plain(1, 4), _plain(1, 4)
    a = free.run(p1, p1.current_round.prompts, lengths)  # type: ignore[union-attr]
    b = bound.run(p2, p2.current_round.prompts, lengths)  # type: ignore[union-attr]
    assert a.preemptions == 0 and b.preemptions > 0
    assert sorted(b.kept_lengths) == [400, 420, 440, 460]
    assert b.rollout_s > a.rollout_s


def test_planner_decisions_abort_the_rest_of_a_short_round() -> None:
    cfg = TailBatchingConfig(prompts_per_step=1, prompt_overprovision=2.0, extra_responses=1)
    planner = TailBatchingPlanner(cfg, num_prompts=2)
    plan = planner.start_round(1)
    sim = RoundSimulator(CPU, engines=1, prompt_len=PROMPT, sat_batch=100)
    out = sim.run(planner, plan.prompts, [[100, 500], [300, 700]])
    assert out.kept_lengths == [100]
    assert out.aborted == 3
    expected = 4 * CPU.prefill_s_per_token * PROMPT + 100 * CPU.step_s(4, 0)
    assert out.rollout_s == pytest.approx(expected)
    res = planner.finish_round()
    assert res.deferred == [plan.prompts[1]]


def test_workload_lengths_are_capped_deterministic_and_heavy_tailed() -> None:
    scn = scenario("default")
    a, b = Workload(scn, 2000, seed=3), Workload(scn, 2000, seed=3)
    assert a.lengths(5, 0, 16, 0.5) == b.lengths(5, 0, 16, 0.5)
    rows = a.lengths_many(list(range(2000)), [0] * 2000, 16, 0.0)
    flat = sorted(x for row in rows for x in row)
    median = flat[len(flat) // 2]
    assert max(flat) == scn.cap
    assert 0.02 < flat[int(0.75 * len(flat))] / scn.cap < 0.08  # P75: a few % of the cap
    assert max(flat) / median > 25
    later = a.lengths_many(list(range(2000)), [0] * 2000, 16, 1.0)
    assert sorted(x for row in later for x in row)[len(flat) // 2] > median  # drift upward


def test_length_aware_dispatch_splits_the_predicted_long_prompts() -> None:
    """Round-robin puts prompts 0 and 2 (both long, 200 responses each) on engine 0, over its
    256 running sequences, so half of them wait for a second wave; with their predicted work
    the two long prompts go to different engines (queued first) and the round ends sooner.
    (Below the engines' sequence limit, where decode is weight-bound, placement hardly
    matters: the round lasts as long as its longest response wherever it runs.)"""
    from rlpacer.control.tail_batching import TailBatchingConfig, TailBatchingPlanner
    from rlpacer.sim.cost import profile
    from rlpacer.sim.rollout import RoundSimulator

    prof = profile("gpu")
    lengths = [[4000] * 200, [50] * 200, [4000] * 200, [50] * 200]  # by position in the round
    out = {}
    for name, work in (("rr", None), ("lpt", [4000.0, 50.0, 4000.0, 50.0])):
        planner = TailBatchingPlanner(TailBatchingConfig(prompts_per_step=4, enabled=False), 4)
        plan = planner.start_round(200)
        sim = RoundSimulator(prof, 2, 100, 190)
        out[name] = sim.run(planner, plan.prompts, lengths, work=work).rollout_s
        planner.finish_round()
    assert out["lpt"] < 0.9 * out["rr"], out


def test_side_engines_serve_their_prompts_alone() -> None:
    """``side`` (a filled long round's fill on the short rounds' engines beside wide ones):
    the side's prompt runs on the side engine alone, at its profile's speed, and the other
    two share the round's own engine; the round lasts as long as the slower of the two."""
    slow = dataclasses.replace(CPU, base_s=4 * CPU.base_s, name="slow")
    planner = _plain(3, 1)
    prompts = planner.current_round.prompts  # type: ignore[union-attr]
    side = SideEngines(slow, 1, 100, frozenset({prompts[1]}))
    sim = RoundSimulator(CPU, engines=1, prompt_len=PROMPT, sat_batch=100)
    out = sim.run(planner, prompts, [[500], [300], [200]], side=side)
    own = 2 * CPU.prefill_s_per_token * PROMPT + 200 * CPU.step_s(2, 0) + 300 * CPU.step_s(1, 0)
    other = slow.prefill_s_per_token * PROMPT + 300 * slow.step_s(1, 0)
    assert other > own
    assert out.rollout_s == pytest.approx(other)
    assert sorted(out.kept_lengths) == [200, 300, 500]
    # without the side engine the three share the one engine: another round altogether
    p2 = _plain(3, 1)
    alone = sim.run(p2, p2.current_round.prompts, [[500], [300], [200]])  # type: ignore[union-attr]
    assert alone.rollout_s == pytest.approx(
        3 * CPU.prefill_s_per_token * PROMPT + 200 * CPU.step_s(3, 0)
        + 100 * CPU.step_s(2, 0) + 200 * CPU.step_s(1, 0))
    with pytest.raises(ValueError, match="side engines do not combine"):
        sim.run(_plain(3, 1), prompts, [[5], [3], [2]], side=side, join_engines=1, join_at=1.0)
    with pytest.raises(ValueError, match=r"side\.engines must be >= 1"):
        sim.run(_plain(3, 1), prompts, [[5], [3], [2]],
                side=dataclasses.replace(side, engines=0))
