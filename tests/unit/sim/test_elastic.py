"""Elastic long rounds in the bench: small pool, large pool and elastic on one schedule.

The three set-ups come from one run of the production planner and controller: every long
round is simulated on the small pool, on the large pool and elastically (the extra replicas
join ``scale_up_s`` after they were requested and take a share of the unfinished requests).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from rlpacer.control.tail_batching import TailBatchingConfig, TailBatchingPlanner
from rlpacer.sim.bench import Policy, PolicyRun, policies, run_policy
from rlpacer.sim.cost import fit_cpu_profile
from rlpacer.sim.rollout import RoundSimulator
from rlpacer.sim.workload import Scenario, Workload, scenario

pytestmark = pytest.mark.unit

STEPS = 100
LATENCIES = (0.0, 5.0, 30.0, 90.0, 300.0, 1e6)
SCN = scenario("default").with_steps(STEPS)
POL = {p.name: p for p in policies()}


def _run(scn: Scenario, pol: Policy) -> PolicyRun:
    wl = Workload(scn, scn.steps * scn.prompts_per_step, 0)
    return run_policy(scn, pol, 0, wl)


@pytest.fixture(scope="module")
def sweep() -> dict[float, PolicyRun]:
    return {lat: _run(SCN.with_elastic(scale_up_s=lat), POL["tail8"]) for lat in LATENCIES}


def _setups(run: PolicyRun) -> dict[str, Any]:
    return run.setups()


def test_the_three_setups_share_one_schedule(sweep: dict[float, PolicyRun]) -> None:
    run = sweep[90.0]
    assert run.kind.count("Long") > 0 and run.scale_ups > 0
    assert run.long_replicas == 4 and run.short_replicas == 2
    for kind, s, big, el in zip(
        run.kind, run.step_s, run.step_s_large, run.step_s_elastic, strict=True
    ):
        if kind == "Short":  # short rounds are the same rounds on the same replicas
            assert s == big == el
        else:  # more replicas never slow a long round down here
            assert big <= s and big <= el <= s
    # The schedule does not depend on the latency: same rounds, same small and large pools.
    for other in sweep.values():
        assert other.kind == run.kind and other.group_size == run.group_size
        assert other.step_s == run.step_s and other.step_s_large == run.step_s_large
        assert other.prompts_trained == run.prompts_trained == STEPS * SCN.prompts_per_step


def test_elastic_gpu_seconds_lie_strictly_between_the_pools(
    sweep: dict[float, PolicyRun],
) -> None:
    for lat, run in sweep.items():
        st = _setups(run)
        small, large, el = (st[k]["rollout_gpu_s"] for k in ("small", "large", "elastic"))
        assert small < el < large, lat
        # elastic pays the small pool all run plus the extras from request to release
        walls = {k: st[k]["wall_clock_s"] for k in ("small", "large", "elastic")}
        assert el == pytest.approx(2 * 2 * walls["elastic"] + 2 * 2 * run.extra_held_s)
        assert small == pytest.approx(2 * 2 * walls["small"])
        assert large == pytest.approx(4 * 2 * walls["large"])
        assert st["small"]["rollout_gpu_s_per_prompt"] == pytest.approx(
            small / run.prompts_trained
        )


def test_wall_clock_is_monotone_in_the_scale_up_latency(sweep: dict[float, PolicyRun]) -> None:
    walls = [_setups(sweep[lat])["elastic"]["wall_clock_s"] for lat in LATENCIES]
    assert walls == sorted(walls)
    zero, never = _setups(sweep[0.0]), _setups(sweep[1e6])
    # Replicas ready at once: the long rounds run exactly as on the large pool.
    assert zero["elastic"]["wall_clock_s"] == zero["large"]["wall_clock_s"]
    assert zero["elastic_vs_large"]["wall_ratio"] == 1.0
    # Never ready: the small pool's wall clock, paying for replicas it never used.
    assert never["elastic"]["wall_clock_s"] == pytest.approx(never["small"]["wall_clock_s"])
    assert never["elastic"]["rollout_gpu_s"] > never["small"]["rollout_gpu_s"]
    assert zero["large"]["wall_clock_s"] < zero["small"]["wall_clock_s"]


def test_replicas_that_join_mid_round_take_work(sweep: dict[float, PolicyRun]) -> None:
    st = _setups(sweep[5.0])
    assert st["elastic"]["requests_moved"] > 0 and st["elastic"]["long_rounds_joined"] > 0
    assert st["elastic"]["wall_clock_s"] < st["small"]["wall_clock_s"]
    assert st["elastic"]["wall_clock_s"] > st["large"]["wall_clock_s"]


def test_without_long_rounds_elastic_is_the_small_pool() -> None:
    plain = _setups(_run(SCN.with_steps(20), POL["fixed8"]))  # no tail batching
    assert plain["large"]["rollout_replicas"] == plain["small"]["rollout_replicas"] == 2
    for key in ("wall_clock_s", "rollout_gpu_s"):
        assert plain["elastic"][key] == plain["small"][key] == plain["large"][key]
    assert plain["elastic"]["scale_ups"] == 0
    same = _setups(_run(SCN.with_steps(20).with_elastic(long_round_engines=2), POL["tail8"]))
    for key in ("wall_clock_s", "rollout_gpu_s"):
        assert same["elastic"][key] == same["small"][key] == same["large"][key]


def test_scenario_validates_the_elastic_parameters() -> None:
    assert SCN.long_round_engines == 4 and SCN.scale_up_s > 0 and SCN.gpus_per_engine == 2
    with pytest.raises(ValueError, match="scale_up_s"):
        SCN.with_elastic(scale_up_s=-1.0)
    with pytest.raises(ValueError, match="long_round_engines"):
        SCN.with_elastic(long_round_engines=0)


CPU = fit_cpu_profile()


def _round(lengths: list[list[int]], **kw: Any) -> Any:
    n = len(lengths)
    planner = TailBatchingPlanner(TailBatchingConfig(prompts_per_step=n, enabled=False), n)
    plan = planner.start_round(len(lengths[0]))
    sim = RoundSimulator(CPU, engines=1, prompt_len=10, sat_batch=100)
    return sim.run(planner, plan.prompts, lengths, **kw)


def test_round_simulator_join_moves_a_share_and_finishes_everything() -> None:
    lengths = [[1000] * 8, [1000] * 8]
    alone = _round(lengths)
    both = _round(lengths, join_engines=1, join_at=0.0)
    late = _round(lengths, join_engines=1, join_at=alone.rollout_s / 2)
    never = _round(lengths, join_engines=1, join_at=alone.rollout_s + 1.0)
    assert both.rollout_s < late.rollout_s < alone.rollout_s
    assert late.moved == 8 and late.joined == 1  # 16 unfinished // 2 engines
    assert sorted(late.kept_lengths) == [1000] * 16
    assert never.rollout_s == alone.rollout_s and never.joined == 0 and never.moved == 0
    assert both.moved == 0 and both.joined == 0
    # Both engines count in the busy fraction from the moment each was there.
    assert 0.0 < late.busy_fraction <= 1.0
    with pytest.raises(ValueError):
        _round(lengths, join_engines=-1)


def test_a_cpu_scenario_run_reports_the_setups() -> None:
    cpu = dataclasses.replace(scenario("cpu"), steps=6)
    run = _run(cpu, POL["tail8"])
    st = _setups(run)
    assert st["large"]["rollout_replicas"] == 2 and st["small"]["rollout_replicas"] == 1
    assert run.gpus_per_replica == 1 and run.scale_up_s == cpu.scale_up_s
