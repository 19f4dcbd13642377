"""Elastic long rounds in the bench: small pool, large pool, elastic and early on one schedule.

The four set-ups come from one run of the production planner and controller: every long
round is simulated on the small pool, on the large pool and elastically (the extra replicas
join ``scale_up_s`` after they were requested and take a share of the unfinished requests);
early asks for them at the report the planner's long-round forecast picks
(``tail_batching.ask_early``), so they can be there when the long round starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from rlpacer.control.tail_batching import TailBatchingConfig, TailBatchingPlanner
from rlpacer.sim.bench import (
    Policy,
    PolicyRun,
    format_elastic_table,
    policies,
    run_bench,
    run_policy,
)
from rlpacer.sim.cost import fit_cpu_profile
from rlpacer.sim.rollout import RoundSimulator
from rlpacer.sim.workload import Scenario, Workload, scenario

pytestmark = pytest.mark.unit

STEPS = 100
LATENCIES = (0.0, 5.0, 30.0, 90.0, 150.0, 300.0, 1e6)
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
        assert plain["early"][key] == plain["small"][key]
    assert plain["elastic"]["scale_ups"] == 0 == plain["early"]["scale_ups"]
    assert plain["early"]["reports_asked_early"] == 0
    assert plain["early_vs_small"]["long_round_rollout_ratio"] is None
    assert plain["early_targets"]["met"] is None
    same = _setups(_run(SCN.with_steps(20).with_elastic(long_round_engines=2), POL["tail8"]))
    for key in ("wall_clock_s", "rollout_gpu_s"):
        assert same["elastic"][key] == same["small"][key] == same["large"][key]
        assert same["early"][key] == same["small"][key]
    assert same["early"]["reports_asked_early"] == 0 == same["early"]["long_rounds_waited"]


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


# --- early scale-up ---------------------------------------------------------------------------


def _longs(run: PolicyRun) -> list[int]:
    return [i for i, k in enumerate(run.kind) if k == "Long"]


def test_early_without_latency_is_elastic_and_runs_long_rounds_as_the_large_pool(
    sweep: dict[float, PolicyRun],
) -> None:
    run = sweep[0.0]
    st = _setups(run)
    assert not any(run.asked_early)  # lead 0: never ahead of the report before a long round
    assert run.step_s_early == run.step_s_elastic and run.early_held_s == run.extra_held_s
    assert run.early_scale_ups == run.scale_ups > 0
    for i in _longs(run):
        assert run.join_s_early[i] == 0.0
        assert run.rollout_s_early[i] == run.rollout_s_large[i] < run.rollout_s[i]
    long_s = {k: st[k]["long_round_rollout_s"] for k in ("small", "large", "elastic", "early")}
    assert long_s["early"] == long_s["large"] == long_s["elastic"] < long_s["small"]
    assert st["early"]["rollout_gpu_s"] == st["elastic"]["rollout_gpu_s"]
    assert st["early_vs_large"]["long_round_rollout_ratio"] == 1.0
    assert st["early_vs_large"]["wall_ratio"] == 1.0
    assert st["early"]["long_rounds_waited"] == 0 == st["elastic"]["long_rounds_waited"]


@pytest.mark.parametrize("lat", [5.0, 30.0, 90.0])
def test_an_early_ask_has_every_long_rounds_replicas_ready_at_its_start(
    sweep: dict[float, PolicyRun], lat: float
) -> None:
    """The forecast reaches each long round at least ``lat`` ahead, the first one included
    (its queue fills from step 0's report on): no long round waits, and each runs exactly as
    on the large pool, where elastic's replicas join ``lat`` into the round or never."""
    run = sweep[lat]
    st = _setups(run)
    longs = _longs(run)
    assert any(run.asked_early) and len(longs) == 20
    assert st["early"]["long_rounds_waited"] == 0 and st["early"]["long_rounds_joined"] == 0
    assert st["elastic"]["long_rounds_waited"] == len(longs)
    for i in longs:
        assert run.join_s_early[i] == 0.0 and run.join_s[i] != 0.0
        assert run.rollout_s_early[i] == run.rollout_s_large[i] <= run.rollout_s_elastic[i]
    long_s = {k: st[k]["long_round_rollout_s"] for k in ("small", "large", "elastic", "early")}
    assert long_s["early"] == long_s["large"] < long_s["elastic"] <= long_s["small"]
    assert st["early_vs_small"]["long_round_rollout_ratio"] == pytest.approx(
        long_s["large"] / long_s["small"])
    # Asked one step ahead, the extras are never up at a short step's start: short rounds
    # run as on the small pool, so early's wall clock is the large pool's.
    assert st["early"]["short_rounds_on_extras"] == 0
    assert st["early"]["wall_clock_s"] == st["large"]["wall_clock_s"]
    assert st["early"]["wall_clock_s"] < st["elastic"]["wall_clock_s"]


@pytest.mark.parametrize("lat", [5.0, 30.0, 90.0, 150.0])
def test_early_pays_for_its_held_extras_between_elastic_and_the_large_pool(
    sweep: dict[float, PolicyRun], lat: float
) -> None:
    run = sweep[lat]
    st = _setups(run)
    gpu = {k: st[k]["rollout_gpu_s"] for k in ("small", "large", "elastic", "early")}
    assert gpu["small"] < gpu["elastic"] < gpu["early"] < gpu["large"]
    # the small pool's replicas all run, the extras from each request to its release
    assert gpu["early"] == pytest.approx(
        2 * 2 * st["early"]["wall_clock_s"] + 2 * 2 * run.early_held_s)
    assert run.early_held_s > run.extra_held_s
    assert st["early"]["extra_replica_held_s"] == run.early_held_s
    assert st["early_vs_small"]["gpu_s_ratio"] == pytest.approx(gpu["early"] / gpu["small"])
    assert st["early_vs_large"]["gpu_s_ratio"] == pytest.approx(gpu["early"] / gpu["large"])
    # asked earlier and released no earlier: never more requests than elastic's
    assert 0 < st["early"]["scale_ups"] <= st["elastic"]["scale_ups"]


def test_a_latency_beyond_the_earliest_forecast_joins_mid_round_no_later_than_elastic(
    sweep: dict[float, PolicyRun],
) -> None:
    """150 s: step 0's report already asks (the earliest forecast: the first long round is
    step 4), yet three short steps take less than 150 s, so the first long round starts
    before the replicas are ready; they join it a few seconds in and take work, where
    elastic's never join it (the round ends first). No long round gets them later than
    elastic's, or runs longer."""
    run = sweep[150.0]
    st = _setups(run)
    longs = _longs(run)
    first = longs[0]
    assert run.asked_early[0] and first == 4
    join = run.join_s_early[first]
    assert join is not None and 0.0 < join < run.rollout_s[first] and run.join_s[first] is None
    assert run.rollout_s_large[first] < run.rollout_s_early[first] < run.rollout_s_elastic[first]
    for i in longs:
        ej, elj = run.join_s_early[i], run.join_s[i]
        assert ej is not None and (elj is None or ej <= elj)
        assert run.rollout_s_early[i] <= run.rollout_s_elastic[i]
    # the rounds that waited all got their replicas mid-round (none ended before them); the
    # first one, at least
    waited = st["early"]["long_rounds_waited"]
    assert waited == st["early"]["long_rounds_joined"] >= 1
    assert waited < st["elastic"]["long_rounds_waited"] == len(longs)
    assert st["early"]["requests_moved"] > 0 == st["elastic"]["requests_moved"]
    assert (st["large"]["long_round_rollout_s"] < st["early"]["long_round_rollout_s"]
            < st["elastic"]["long_round_rollout_s"])


def test_extras_that_never_join_cost_early_more_than_the_large_pool(
    sweep: dict[float, PolicyRun],
) -> None:
    """Never ready: every report asks, so early holds the extras nearly all run for nothing
    (the small pool's wall clock) and pays more than the large pool, which at least uses them."""
    st = _setups(sweep[1e6])
    assert st["early"]["wall_clock_s"] == pytest.approx(st["small"]["wall_clock_s"])
    assert st["early"]["long_rounds_waited"] == len(_longs(sweep[1e6]))
    assert st["early"]["scale_ups"] == 1
    assert st["early"]["rollout_gpu_s"] > st["large"]["rollout_gpu_s"]


def test_the_bench_report_and_table_carry_the_early_setup() -> None:
    report, _ = run_bench(SCN.with_steps(12), seed=0)
    st = report["policies"]["tail8"]["setups"]
    for k in ("small", "large", "elastic", "early"):
        assert st[k]["long_round_rollout_s"] > 0
    for key in ("wall_ratio", "gpu_s_ratio", "long_round_rollout_ratio"):
        assert key in st["early_vs_small"] and key in st["early_vs_large"]
    assert set(st["early_targets"]) == {"long_rounds", "gpu_s", "wall", "met"}
    assert st["early"]["reports_asked_early"] > 0
    table = format_elastic_table(report)
    assert "elastic/large" in table and "GPU-s/pr" in table  # the elastic table, unchanged
    row = next(line for line in table.splitlines()[::-1] if line.startswith("tail8"))
    vs = st["early_vs_small"]
    assert f"{vs['long_round_rollout_ratio']:.3f}x" in row and f"{vs['wall_ratio']:.3f}x" in row
    assert "early/small" in table and "waited" in table


def test_held_extras_up_at_a_short_steps_start_serve_its_round(
    sweep: dict[float, PolicyRun],
) -> None:
    """150 s: asked from step 0's report, the extras are up before the first long round ends
    and, asked again at nearly every report (each short step is shorter than the lead), held
    on: every short round of a step that starts with them up runs on all four replicas, as the
    driver admits them at a step boundary. Those rounds are faster than on the small pool, so
    early beats the large pool, whose short rounds leave its extras idle; a lead of 0 holds
    no extras through short rounds (none served, the elastic clock)."""
    run = sweep[150.0]
    st = _setups(run)
    served = st["early"]["short_rounds_on_extras"]
    shorts = [i for i, k in enumerate(run.kind) if k == "Short"]
    assert served >= len(shorts) // 2, (served, len(shorts))
    faster = [i for i in shorts if run.rollout_s_early[i] < run.rollout_s[i]]
    assert len(faster) >= served - 2  # a round may tie (its longest response decides it)
    assert all(run.rollout_s_early[i] <= run.rollout_s[i] for i in shorts)
    assert st["early"]["short_round_s_saved"] == pytest.approx(
        sum(run.rollout_s[i] - run.rollout_s_early[i] for i in shorts))
    assert st["early"]["short_round_s_saved"] > 0
    assert st["early"]["wall_clock_s"] < st["large"]["wall_clock_s"]
    zero = _setups(sweep[0.0])
    assert zero["early"]["short_rounds_on_extras"] == 0
    assert zero["early"]["short_round_s_saved"] == 0.0


# --- releaseWhenFits --------------------------------------------------------------------------


def test_round_simulator_gives_the_added_engine_back_once_the_rest_fits() -> None:
    """``release_base``: one short-lived and one long response a prompt on 2 engines, the
    second added: once the unfinished requests fit on engine 0 at the load it began with,
    engine 1's go there with their tokens and it leaves; the round keeps every response, its
    tail runs on one engine (no shorter than on two), and the given-back engine's idle tail
    no longer counts in the busy fraction."""
    lengths = [[50, 50, 50, 2000]] * 4
    both = _round(lengths, engines=2)
    rel = _round(lengths, engines=2, release_base=1)
    assert rel.released_at is not None and 0.0 < rel.released_at < rel.rollout_s
    assert rel.moved_back == 2  # engine 1's two long responses, with their tokens
    assert sorted(rel.kept_lengths) == sorted(both.kept_lengths)
    assert rel.rollout_s >= both.rollout_s
    assert rel.busy_fraction > both.busy_fraction
    assert both.released_at is None and both.moved_back == 0
    # nothing to give back: one engine, or the own engines are all there are
    assert _round(lengths, engines=1, release_base=1).released_at is None
    assert _round(lengths, engines=2, release_base=2).released_at is None
    with pytest.raises(ValueError, match="release_base"):
        _round(lengths, release_base=-1)


def test_a_joined_engine_is_given_back_only_after_it_joined() -> None:
    """After a mid-round join the rule measures by the share each engine then held, and no
    release comes while the join is pending."""
    lengths = [[50, 50, 50, 2000]] * 4
    alone = _round(lengths)
    late = _round(lengths, join_engines=1, join_at=alone.rollout_s / 4, release_base=1)
    assert late.joined == 1 and late.moved > 0
    assert late.released_at is not None and late.released_at > alone.rollout_s / 4
    assert sorted(late.kept_lengths) == sorted(alone.kept_lengths)


@pytest.fixture(scope="module")
def released() -> dict[bool, PolicyRun]:
    return {rel: _run(dataclasses.replace(SCN, release_when_fits=rel), POL["tail8"])
            for rel in (False, True)}


def test_release_when_fits_holds_the_extras_less_on_the_same_schedule(
        released: dict[bool, PolicyRun]) -> None:
    """``rlpacer bench --release-when-fits``: the same rounds, G and kept responses; the early
    set-up gives its extras back in long rounds (those followed by a short one) and holds
    them fewer seconds, so its rollout GPU-seconds fall, while each long round runs no faster
    than with the extras to its end."""
    held, rel = released[False], released[True]
    assert rel.kind == held.kind and rel.kept == held.kept and rel.group_size == held.group_size
    assert rel.step_s == held.step_s  # the small pool's schedule and clock are untouched
    n_long = len(_longs(rel))
    st, st0 = _setups(rel), _setups(held)
    assert 0 < st["early"]["long_rounds_released"] <= n_long
    assert st0["early"]["long_rounds_released"] == 0
    assert 0.0 < st["early"]["released_at_fraction"] < 1.0
    assert st["early"]["requests_moved_back"] > 0
    assert rel.early_held_s < held.early_held_s
    assert st["early"]["rollout_gpu_s"] < st0["early"]["rollout_gpu_s"]
    assert st["early"]["long_round_rollout_s"] >= st0["early"]["long_round_rollout_s"] - 1e-6


def test_the_bench_report_says_release_when_fits() -> None:
    scn = dataclasses.replace(scenario("default").with_steps(40), release_when_fits=True)
    report, _ = run_bench(scn, seed=0)
    assert report["release_when_fits"] is True
    table = format_elastic_table(report)
    assert "release when fits" in table and "long rounds, at" in table
