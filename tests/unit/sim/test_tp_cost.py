"""Wider engines for long rounds: the tensor-parallel cost model (rlpacer.sim.cost.tp_profile)
and the bench's ``wide`` set-up (``rlpacer bench --long-round-tp N``).

The cost model re-splits the ``gpu`` profile (one 14B engine of TP 2 on H100) to TP ``t``:
the weights term and the compute split over ``t`` GPUs, the all-reduces grow with ``t``, the
KV cache grows with the GPUs. The wide set-up runs each long round of the same schedule on the
long round's GPUs re-formed as engines of TP ``t``; its GPU-seconds are the small pool's plus
the extra GPUs over the long rounds' steps.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from rlpacer.cli import main
from rlpacer.sim.bench import (
    EARLY_TARGET_GPU_MAX,
    EARLY_TARGET_LONG_CUT,
    EARLY_TARGET_WALL_CUT,
    PolicyRun,
    policies,
    run_bench,
    run_policy,
    wide_layout,
)
from rlpacer.sim.cost import QWEN25_14B_H100, CostProfile, gpu_profile, tp_profile
from rlpacer.sim.workload import Scenario, Workload, scenario

pytestmark = pytest.mark.unit

STEPS = 60
SCN = scenario("default").with_steps(STEPS)
POL = {p.name: p for p in policies()}
CTX = 1000.0
NUMERIC = ("base_s", "per_seq_s", "per_kv_token_s", "kv_capacity_tokens", "max_num_seqs",
           "prefill_s_per_token", "kv_watermark")


def _run(scn: Scenario, name: str, tp: int | None) -> PolicyRun:
    wl = Workload(scn, scn.steps * scn.prompts_per_step, 0)
    return run_policy(scn, POL[name], 0, wl, long_round_tp=tp)


def _wide(run: PolicyRun) -> dict[str, Any]:
    w = run.wide()
    assert w is not None
    return w


@pytest.fixture(scope="module")
def runs() -> dict[int | None, PolicyRun]:
    """tail8 on the default scenario: without the flag, and at TP 2, 4 and 8."""
    return {tp: _run(SCN, "tail8", tp) for tp in (None, 2, 4, 8)}


# --- the cost model ------------------------------------------------------------------------


def test_base_tp_reproduces_the_gpu_profile_exactly() -> None:
    gpu = gpu_profile()
    same = tp_profile(gpu, QWEN25_14B_H100.base_tp)
    for f in NUMERIC:
        assert getattr(same, f) == getattr(gpu, f), f
    assert dataclasses.replace(same, name=gpu.name, source=gpu.source) == gpu
    for b, kv in ((1, 0.0), (1, 1000.0), (64, 64e3), (256, 3e5)):
        assert same.step_s(b, kv) == gpu.step_s(b, kv)


def test_batch1_step_falls_with_tp_but_less_than_tp_fold() -> None:
    gpu = gpu_profile()
    t0 = QWEN25_14B_H100.base_tp
    steps = {t: tp_profile(gpu, t).step_s(1, CTX) for t in (1, 2, 4, 8)}
    assert steps[1] > steps[2] > steps[4] > steps[8]
    for t in (1, 4, 8):
        speedup = steps[t0] / steps[t]
        gpus = t / t0
        # faster with more GPUs, slower with fewer, never by the full GPU ratio
        assert (1.0 < speedup < gpus) if t > t0 else (gpus < speedup < 1.0)
    # the module doc's figures: 1.53x at TP 4, 1.99x at TP 8 against TP 2
    assert steps[2] / steps[4] == pytest.approx(1.53, abs=0.01)
    assert steps[2] / steps[8] == pytest.approx(1.99, abs=0.01)


def test_step_time_is_weights_over_tp_plus_all_reduces_by_formula() -> None:
    gpu, m = gpu_profile(), QWEN25_14B_H100
    n_ar = m.layers * m.all_reduces_per_layer
    for t in (1, 4, 8):
        p = tp_profile(gpu, t)
        weights = m.weight_bytes / (m.bandwidth_efficiency * m.hbm_bytes_per_s)
        expect = (gpu.base_s + weights / t - weights / 2
                  + n_ar * (m.all_reduce_s(t, 0.0) - m.all_reduce_s(2, 0.0)))
        assert p.base_s == pytest.approx(expect, rel=1e-12)
        # per sequence: the compute splits, each all-reduce carries hidden x 2 bytes more
        ar_bytes = n_ar * m.hidden * m.activation_bytes
        per_byte = (m.all_reduce_s(t, 1e6) - m.all_reduce_s(t, 0.0)) / 1e6
        per_byte0 = (m.all_reduce_s(2, 1e6) - m.all_reduce_s(2, 0.0)) / 1e6
        assert p.per_seq_s == pytest.approx(
            gpu.per_seq_s * 2 / t + ar_bytes * (per_byte - per_byte0), rel=1e-9)
        assert p.per_kv_token_s == pytest.approx(gpu.per_kv_token_s * 2 / t)
    # an all-reduce costs more on more GPUs, at a batch-1 message (10 kB) as at 1 MB
    for nbytes in (0.0, 1e4, 1e6):
        assert 0.0 == m.all_reduce_s(1, nbytes) < m.all_reduce_s(2, nbytes) < m.all_reduce_s(
            4, nbytes) < m.all_reduce_s(8, nbytes)


def test_kv_capacity_scales_at_least_with_tp() -> None:
    gpu, m = gpu_profile(), QWEN25_14B_H100
    caps = {t: tp_profile(gpu, t).kv_capacity_tokens for t in (1, 2, 4, 8)}
    for t in (1, 4, 8):
        # more GPUs, more memory, and each holds a smaller share of the weights: the capacity
        # grows faster than the GPUs (and falls faster at TP 1, whose GPU holds all of them)
        if t > 2:
            assert caps[t] > gpu.kv_capacity_tokens * t / 2
        else:
            assert caps[t] < gpu.kv_capacity_tokens * t / 2
        free_per_gpu = gpu.kv_capacity_tokens * m.kv_bytes_per_token / 2 + (
            m.weight_bytes / 2 - m.weight_bytes / t)
        assert caps[t] == pytest.approx(free_per_gpu * t / m.kv_bytes_per_token, abs=1)
    assert caps[1] == pytest.approx(200_000, rel=0.01)
    assert caps[8] == pytest.approx(2_650_000, rel=0.01)


def test_throughput_per_gpu_at_full_batch_falls_with_tp() -> None:
    gpu = gpu_profile()
    per_gpu = [tp_profile(gpu, t).throughput(256, CTX) / t for t in (1, 2, 4, 8)]
    assert per_gpu == sorted(per_gpu, reverse=True)


@pytest.mark.parametrize("tp", [0, 3, 16])
def test_unmodelled_tp_is_refused(tp: int) -> None:
    with pytest.raises(ValueError):
        tp_profile(gpu_profile(), tp)


# --- the bench's wide set-up ---------------------------------------------------------------


def test_the_flag_changes_no_other_set_up(runs: dict[int | None, PolicyRun]) -> None:
    off = runs[None]
    assert off.wide() is None and off.step_s_wide == []
    for tp in (2, 4, 8):
        on = runs[tp]
        for f in ("kind", "group_size", "step_s", "step_s_large", "step_s_elastic",
                  "step_s_early", "kept", "extra_held_s", "early_held_s"):
            assert getattr(on, f) == getattr(off, f), (tp, f)
        assert on.setups() == off.setups()


def test_wide_at_the_base_tp_is_the_large_pool_held_like_elastic_without_latency(
    runs: dict[int | None, PolicyRun],
) -> None:
    run = runs[2]
    assert run.kind.count("Long") > 0 and run.wide_engines == 4 and run.wide_gpus == 8
    assert run.step_s_wide == run.step_s_large
    assert run.rollout_s_wide == run.rollout_s_large
    w = run.wide()
    assert w is not None
    assert w["wall_clock_s"] == run.setups()["large"]["wall_clock_s"]
    # its GPU-seconds are elastic's with the extra replicas ready at once
    el = _run(SCN.with_elastic(scale_up_s=0.0), "tail8", None).setups()["elastic"]
    assert w["wall_clock_s"] == pytest.approx(el["wall_clock_s"])
    assert w["rollout_gpu_s"] == pytest.approx(el["rollout_gpu_s"])


def test_wider_engines_shorten_long_rounds_only(runs: dict[int | None, PolicyRun]) -> None:
    small = runs[None]
    wides = {tp: _wide(runs[tp]) for tp in (2, 4, 8)}
    longs = {tp: w["long_round_rollout_s"]["wide"] for tp, w in wides.items()}
    assert wides[2]["long_round_rollout_s"]["small"] > longs[2] > longs[4] > longs[8]
    for tp in (4, 8):
        run = runs[tp]
        for kind, s, w in zip(run.kind, small.step_s, run.step_s_wide, strict=True):
            if kind == "Short":
                assert w == s
            else:
                assert w < s
        # fewer, wider engines beat more narrow ones on the same 8 GPUs
        assert sum(run.step_s_wide) < sum(run.step_s_large)


def test_gpu_seconds_by_formula(runs: dict[int | None, PolicyRun]) -> None:
    for tp in (2, 4, 8):
        run = runs[tp]
        w = run.wide()
        assert w is not None
        longs = [k == "Long" for k in run.kind]
        wall = sum(run.step_s_wide)
        long_steps = sum(s for s, lg in zip(run.step_s_wide, longs, strict=True) if lg)
        held = sum(s for s, h, lg in zip(run.step_s_wide, run.early_hold, longs, strict=True)
                   if h or lg)
        # 2 replicas x 2 GPUs all run; the other 4 of the long round's 8 GPUs over long steps
        assert w["extra_gpus"] == 4 and w["gpus"] == 8 and w["engines"] == 8 // tp
        assert w["rollout_gpu_s"] == pytest.approx(4 * wall + 4 * long_steps)
        assert w["rollout_gpu_s_early_hold"] == pytest.approx(4 * wall + 4 * held)
        assert w["rollout_gpu_s_early_hold"] > w["rollout_gpu_s"]
        assert w["small_rollout_gpu_s"] == pytest.approx(4 * sum(run.step_s))
        vs = w["vs_small"]
        assert vs["gpu_s_ratio"] == pytest.approx(w["rollout_gpu_s"] / (4 * sum(run.step_s)))
        tg = w["targets"]
        assert tg["long_rounds"] == (vs["long_round_rollout_ratio"] <= 1 - EARLY_TARGET_LONG_CUT)
        assert tg["gpu_s"] == (vs["gpu_s_ratio"] <= EARLY_TARGET_GPU_MAX)
        assert tg["wall"] == (vs["wall_ratio"] <= 1 - EARLY_TARGET_WALL_CUT)
        assert w["switch_slack_s"] == pytest.approx(
            ((1 - EARLY_TARGET_WALL_CUT) * sum(run.step_s) - wall) / sum(longs))


def test_wide_on_the_small_pools_gpus_costs_no_extra_gpu() -> None:
    """--long-round-replicas 2: the long round's 4 GPUs (the small pool's) as 1 TP4 engine."""
    scn = SCN.with_elastic(long_round_engines=2)
    assert wide_layout(scn, 4) == (1, 4)
    run = _run(scn, "tail8", 4)
    w = run.wide()
    assert w is not None and w["extra_gpus"] == 0 and w["long_rounds"] > 0
    assert w["rollout_gpu_s"] == pytest.approx(4 * sum(run.step_s_wide))
    assert w["long_round_rollout_s"]["wide"] < w["long_round_rollout_s"]["small"]
    assert w["vs_small"]["gpu_s_ratio"] < 1.0


def test_no_long_rounds_no_wide_set_up() -> None:
    run = _run(scenario("default").with_steps(8), "fixed8", 4)
    w = run.wide()
    assert w is not None and w["long_rounds"] == 0 and w["extra_gpus"] == 0
    assert run.step_s_wide == run.step_s
    assert w["targets"]["met"] is None and w["switch_slack_s"] is None


def test_layout_is_refused_where_it_does_not_fit() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        wide_layout(SCN.with_elastic(long_round_engines=3), 4)  # 6 GPUs
    with pytest.raises(ValueError, match="gpu profile"):
        wide_layout(scenario("cpu"), 2)
    with pytest.raises(ValueError, match="one of"):
        wide_layout(SCN, 16)
    other = dataclasses.replace(SCN, profile_override=CostProfile("x", 1e-3, 0, 0, 10, 8, 0))
    with pytest.raises(ValueError, match="gpu profile"):
        wide_layout(other, 4)


def test_cli_table_and_json_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "bench.json"
    assert main(["bench", "--steps", "4", "--long-round-tp", "4", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "wider engines for long rounds" in printed and "TP 4" in printed
    data: dict[str, Any] = json.loads(out_json.read_text())
    wide = data["wide_long_rounds"]
    assert wide["tp"] == 4 and wide["engines"] == 2 and wide["gpus"] == 8
    assert wide["step_s_batch1"]["wide"] < wide["step_s_batch1"]["short"]
    assert set(wide["policies"]) == set(data["policies"])
    for d in wide["policies"].values():
        assert {"long_round_rollout_s", "wall_clock_s", "rollout_gpu_s", "vs_small",
                "targets"} <= set(d)
    assert main(["bench", "--steps", "4", "--json", str(out_json)]) == 0
    assert "wide_long_rounds" not in json.loads(out_json.read_text())
    assert "wider engines" not in capsys.readouterr().out
    for bad in (["--long-round-tp", "3"], ["--scenario", "cpu", "--long-round-tp", "2"],
                ["--long-round-replicas", "2", "--long-round-tp", "8"]):
        assert main(["bench", "--steps", "4", *bad]) == 2
        assert "--long-round-tp" in capsys.readouterr().err


def test_run_bench_reports_wide_only_when_asked() -> None:
    rep, _ = run_bench(scenario("default").with_steps(4), seed=0, long_round_tp=8)
    assert rep["wide_long_rounds"]["engines"] == 1
    assert rep["wide_long_rounds"]["kv_capacity_tokens"]["wide"] > 4 * 550_000


def test_the_operators_layout_pays_for_the_wide_engines_beside_the_waiting_pool(
        runs: dict[int | None, PolicyRun]) -> None:
    """--wide-replicas K (tailBatching.longRound.tensorParallelSize as the operator runs it):
    K engines of TP N on K x N GPUs of their own while the small pool's 4 wait. One TP8
    engine decodes the long round as the re-formed layout's one TP8 engine does (same
    seconds), but all 8 of its GPUs are extra, not 4: more GPU-seconds for the same time."""
    wl = Workload(SCN, SCN.steps * SCN.prompts_per_step, 0)
    own = run_policy(SCN, POL["tail8"], 0, wl, long_round_tp=8, wide_replicas=1)
    w, reformed = _wide(own), _wide(runs[8])
    assert (w["engines"], w["gpus"], w["extra_gpus"]) == (1, 8, 8)
    assert own.step_s_wide == pytest.approx(runs[8].step_s_wide)
    longs = [k == "Long" for k in own.kind]
    long_steps = sum(s for s, lg in zip(own.step_s_wide, longs, strict=True) if lg)
    assert w["rollout_gpu_s"] == pytest.approx(4 * sum(own.step_s_wide) + 8 * long_steps)
    assert w["rollout_gpu_s"] - reformed["rollout_gpu_s"] == pytest.approx(4 * long_steps)
    assert w["vs_small"]["gpu_s_ratio"] > reformed["vs_small"]["gpu_s_ratio"]
    # two TP4 engines on 8 GPUs of their own: the re-formed layout's engines, 4 GPUs more
    two = _wide(run_policy(SCN, POL["tail8"], 0, wl, long_round_tp=4, wide_replicas=2))
    assert (two["engines"], two["gpus"], two["extra_gpus"]) == (2, 8, 8)
    assert two["long_round_rollout_s"]["wide"] == pytest.approx(
        _wide(runs[4])["long_round_rollout_s"]["wide"])


def test_wide_replicas_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--steps", "4", "--long-round-tp", "8", "--wide-replicas", "1"]) == 0
    assert "1 engine(s) of TP 8 on 8 GPUs of their own" in capsys.readouterr().out
    assert main(["bench", "--steps", "4", "--wide-replicas", "1"]) == 2
    assert "--wide-replicas needs --long-round-tp" in capsys.readouterr().err
    assert main(["bench", "--steps", "4", "--long-round-tp", "8", "--wide-replicas", "0"]) == 2
    assert "--wide-replicas must be 1 or more" in capsys.readouterr().err


def test_side_fill_runs_the_fill_on_the_waiting_pool_and_shortens_only_long_rounds() -> None:
    """--side-fill: a filled long round's queued prompts run on the wide engine of its own
    GPUs, its fill on the short rounds' engines (which otherwise wait through it). The
    schedule and the short rounds are the same; each long round ends no later; the GPUs
    paid for are the same, held for less time."""
    scn = SCN.with_long_round_fill(32)

    def run(side_fill: bool) -> PolicyRun:
        wl = Workload(scn, scn.steps * scn.prompts_per_step, 0)
        return run_policy(scn, POL["tail8"], 0, wl, long_round_tp=4, wide_replicas=1,
                          side_fill=side_fill)

    plain, side = run(False), run(True)
    for f in ("kind", "group_size", "step_s", "step_s_large", "kept"):
        assert getattr(side, f) == getattr(plain, f), f
    longs = [k == "Long" for k in side.kind]
    assert sum(longs) > 0
    shorter = 0
    for lg, a, b in zip(longs, plain.rollout_s_wide, side.rollout_s_wide, strict=True):
        if lg:
            assert b <= a + 1e-9
            shorter += b < a - 1e-6
        else:
            assert b == a
    assert shorter > 0
    wp, ws = _wide(plain), _wide(side)
    assert not wp["side_fill"] and ws["side_fill"]
    assert ws["extra_gpus"] == wp["extra_gpus"] == 4
    assert ws["vs_small"]["wall_ratio"] < wp["vs_small"]["wall_ratio"]
    assert ws["vs_small"]["gpu_s_ratio"] < wp["vs_small"]["gpu_s_ratio"]


def test_side_fill_cli(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "--steps", "4", "--long-round-tp", "4", "--wide-replicas", "1"]
    assert main([*args, "--long-round-fill", "32", "--side-fill"]) == 0
    assert "the short rounds' 4 running the fill" in capsys.readouterr().out
    for bad in (["--side-fill"], ["--long-round-fill", "32", "--side-fill"]):
        base = args if bad[0] == "--side-fill" else args[:3]
        assert main([*base, *bad]) == 2
        assert "--side-fill needs --long-round-tp N, --wide-replicas K" in capsys.readouterr().err


def test_release_when_fits_holds_the_wide_engines_over_the_long_round_alone() -> None:
    """--release-when-fits with wide engines (the driver gives them back at the long round's
    end when the next round is short): their GPUs are paid over that round's rollout, not to
    the step's report; the schedule and the wall clock are the same."""
    scn = SCN.with_long_round_fill(32)
    rel = dataclasses.replace(scn, release_when_fits=True)

    def run(s: Scenario) -> PolicyRun:
        wl = Workload(s, s.steps * s.prompts_per_step, 0)
        return run_policy(s, POL["tail8"], 0, wl, long_round_tp=4, wide_replicas=1,
                          side_fill=True)

    held, given = run(scn), run(rel)
    assert given.step_s_wide == held.step_s_wide and given.kind == held.kind
    assert not any(held.wide_released)
    longs = [k == "Long" for k in given.kind]
    released = [r for r, lg in zip(given.wide_released, longs, strict=True) if lg]
    assert sum(released) > 0
    assert not any(r for r, lg in zip(given.wide_released, longs, strict=True) if not lg)
    w, w0 = _wide(given), _wide(held)
    paid = sum(r if rel_ else s for s, r, rel_, lg in zip(
        given.step_s_wide, given.rollout_s_wide, given.wide_released, longs, strict=True) if lg)
    assert w["released_at_round_end"] == sum(released)
    assert w["extra_gpu_held_s"] == pytest.approx(paid)
    assert w["rollout_gpu_s"] == pytest.approx(4 * sum(given.step_s_wide) + 4 * paid)
    assert w["rollout_gpu_s"] < w0["rollout_gpu_s"]
    assert w["wall_clock_s"] == w0["wall_clock_s"]
