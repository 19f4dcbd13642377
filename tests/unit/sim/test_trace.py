"""Trace replay (`rlpacer bench --trace`): reading both trace formats, the replayed lengths,
and the lengths reaching every policy of the bench."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rlpacer.api.trace import ResponseRecord, TraceError, header, read_trace
from rlpacer.cli import main
from rlpacer.sim.bench import run_bench
from rlpacer.sim.trace import (
    TraceWorkload,
    load_trace,
    recorded_order_calibration,
    trace_scenario,
)
from rlpacer.sim.workload import scenario

pytestmark = pytest.mark.unit

DAPO = Path(__file__).resolve().parents[3] / "traces" / "dapo-qwen2.5-32b.jsonl"


def _verl_lines(groups: list[list[int]], prompt: int = 100) -> list[str]:
    return [json.dumps({"step": 0, "input": prompt, "output": g, "n_sampling": len(g)})
            for g in groups]


def _write(tmp_path: Path, name: str, lines: list[str]) -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


# --- reading -------------------------------------------------------------------------------
def test_the_shipped_dapo_trace_reads_as_576_groups_of_8() -> None:
    t = load_trace(DAPO)
    assert t.kind == "verl" and len(t.groups) == 576 and t.group_size == 8
    first = json.loads(DAPO.read_text().splitlines()[0])
    assert t.groups[0].lengths == tuple(first["output"])
    assert t.groups[0].prompt_tokens == first["input"]
    assert max(max(g.lengths) for g in t.groups) == 10112


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"input": 5, "output": [3, 4]}', "{not json"], r"t\.jsonl:2: not JSON"),
        (['{"input": 5, "output": [3, 0]}'], r":1: 'output' holds 0"),
        (['{"input": 5, "output": []}'], r":1: 'output' must be a non-empty list"),
        (['{"input": -1, "output": [3]}'], r":1: 'input' must be an integer >= 0"),
        (['{"kept_prompt_indices": [1], "prompt_count": 96}'], r"dynamic-sampling filter log"),
        (['{"hello": 1}'], r":1: neither a recorded rlpacer trace"),
        (["[1, 2]"], r":1: a line must be a JSON object"),
        (['{"format": "rlpacer-response-trace", "version": 9}'], r"version 9 is not supported"),
        ([], r"empty"),
    ],
)
def test_a_malformed_trace_is_refused_with_the_line_named(
    tmp_path: Path, lines: list[str], message: str
) -> None:
    with pytest.raises(TraceError, match=message):
        load_trace(_write(tmp_path, "t.jsonl", lines))


def _rec(**kw: object) -> str:
    base: dict[str, object] = dict(attempt=0, step=0, round=0, kind="short", epoch=0, prompt=0,
                                   index=0, engine=0, prompt_tokens=20, length=10,
                                   start_s=0.0, finish_s=1.0, outcome="kept")
    base.update(kw)
    return ResponseRecord(**base).to_json()  # type: ignore[arg-type]


def test_a_recorded_trace_replays_the_round_each_prompt_was_kept_in() -> None:
    lines = [
        header(max_tokens=256, prompts=3, prompts_per_step=2, seed=0),
        # prompt 0: kept in round 0 (two kept, one finished late, one aborted)
        _rec(prompt=0, index=0, length=10), _rec(prompt=0, index=1, length=30),
        _rec(prompt=0, index=2, length=50, outcome="discarded"),
        _rec(prompt=0, index=3, length=None, outcome="aborted"),
        # prompt 1: deferred in round 0, kept in the long round 1
        _rec(prompt=1, index=0, length=None, outcome="deferred"),
        _rec(prompt=1, index=1, length=12, outcome="discarded"),
        _rec(prompt=1, round=1, step=1, kind="long", index=0, length=200),
        _rec(prompt=1, round=1, step=1, kind="long", index=1, length=240),
        # prompt 2: kept in attempt 0, then again after a resume (attempt 1): the last wins
        _rec(prompt=2, index=0, length=7), _rec(prompt=2, index=1, length=9),
        _rec(attempt=1, prompt=2, index=0, length=70),
        _rec(attempt=1, prompt=2, index=1, length=90),
        # prompt 3: a run resumed in the same attempt ran its round again: the later line wins
        _rec(prompt=3, round=2, index=0, length=5), _rec(prompt=3, round=2, index=0, length=55),
    ]
    t = read_trace(lines, "rec.jsonl")
    assert t.kind == "rlpacer" and t.max_tokens == 256
    by_key = {g.key: g.lengths for g in t.groups}
    assert by_key == {"epoch 0 prompt 0": (10, 30, 50), "epoch 0 prompt 1": (200, 240),
                      "epoch 0 prompt 2": (70, 90), "epoch 0 prompt 3": (55,)}
    assert t.censored == 1  # prompt 0's aborted response (prompt 1's deferral is not replayed)
    # each group knows its prompt, its epoch and its round's responses without a length
    assert [(g.prompt, g.epoch, g.censored) for g in t.groups] == [
        (0, 0, 1), (2, 0, 0), (3, 0, 0), (1, 0, 0)]


def test_a_recorded_trace_with_a_bad_line_names_it() -> None:
    lines = [header(max_tokens=8, prompts=1, prompts_per_step=1, seed=0),
             _rec(), _rec(outcome="kept", length=None)]
    with pytest.raises(TraceError, match=r"rec\.jsonl:3: 'length' must be an integer >= 1"):
        read_trace(lines, "rec.jsonl")
    with pytest.raises(TraceError, match=r":2: 'outcome' must be one of"):
        read_trace([lines[0], _rec(outcome="lost")], "rec.jsonl")


# --- replay --------------------------------------------------------------------------------
def _heavy_groups(n: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        level = rng.lognormal(6.0, 0.4)
        g = np.clip(level * rng.lognormal(0.0, 0.8, size=8), 1, 16000).astype(int).tolist()
        out.append(g)
    return out


def test_the_recorded_group_size_replays_the_recorded_lengths_exactly() -> None:
    groups = _heavy_groups(40)
    t = read_trace(_verl_lines(groups), "t")
    wl = TraceWorkload(t, epochs=2, seed=0)
    assert wl.lengths_many(list(range(40)), [0] * 40, 8, 0.0, epoch=0) == groups
    assert wl.lengths_many([3], [0], 4, 0.0, epoch=0) == [groups[3][:4]]
    # a later epoch resamples: not the same list, but the same prompt's level
    again = wl.lengths_many(list(range(40)), [0] * 40, 8, 0.0, epoch=1)
    assert again != groups
    lvl = np.log(np.asarray(groups, dtype=float)).mean(axis=1)
    lvl2 = np.log(np.asarray(again, dtype=float)).mean(axis=1)
    assert np.corrcoef(lvl, lvl2)[0, 1] > 0.6  # a prompt that ran long runs long again


def test_resampled_draws_keep_each_groups_log_mean_and_spread() -> None:
    groups = _heavy_groups(200, seed=2)
    t = read_trace(_verl_lines(groups), "t")
    wl = TraceWorkload(t, epochs=1, seed=3)
    extra = np.asarray(wl.lengths_many(list(range(200)), [8] * 200, 56, 0.0), dtype=float)
    rec = np.log(np.asarray(groups, dtype=float))
    got = np.log(extra)
    # variance-preserving smoothed bootstrap: per group, mean and sd match (up to 56 draws' noise)
    assert np.abs(got.mean(axis=1) - rec.mean(axis=1)).mean() < 0.15
    assert abs(got.std(axis=1).mean() / rec.std(axis=1).mean() - 1.0) < 0.1
    assert extra.max() <= max(max(g) for g in groups)  # capped at the longest recorded
    # and unlike a plain bootstrap, a draw can exceed the group's longest recorded length
    assert (extra.max(axis=1) > np.asarray(groups).max(axis=1)).mean() > 0.2


def test_the_same_seed_gives_the_same_draws_and_another_seed_others() -> None:
    t = read_trace(_verl_lines(_heavy_groups(10)), "t")
    a = TraceWorkload(t, 2, seed=5).lengths_many([1, 2], [8, 8], 8, 0.0, epoch=1)
    assert a == TraceWorkload(t, 2, seed=5).lengths_many([1, 2], [8, 8], 8, 0.0, epoch=1)
    assert a != TraceWorkload(t, 2, seed=6).lengths_many([1, 2], [8, 8], 8, 0.0, epoch=1)


def test_trace_scenario_takes_the_traces_prompt_length_cap_and_epochs() -> None:
    t = read_trace(_verl_lines([[10, 20, 30, 900]] * 100, prompt=77), "t")
    scn, epochs = trace_scenario(scenario("default"), t, steps=10)
    assert epochs == 4  # 10 steps x 32 prompts over 100 groups
    assert scn.prompt_len == 77 and scn.cap == 900 and scn.name == "trace:t"


# --- the bench drives every policy with the replayed lengths -------------------------------
def test_the_bench_reacts_to_the_traces_tail() -> None:
    """Flat groups: no straggler at tau, and tail batching (always on in the bench) only costs
    its deferrals. The same prompts with one response in 16 rambling 40x: stragglers, and tail
    batching wins by far. Neither would differ if the bench ignored the trace."""
    rng = np.random.default_rng(0)
    flat = [[int(v) for v in rng.integers(400, 520, size=8)] for _ in range(128)]
    tail = [[v * 40 if (i * 8 + j) % 16 == 5 else v for j, v in enumerate(g)]
            for i, g in enumerate(flat)]
    scn = scenario("default").with_steps(16)
    flat_r, _ = run_bench(scn, seed=0, trace=read_trace(_verl_lines(flat), "flat"))
    tail_r, _ = run_bench(scn, seed=0, trace=read_trace(_verl_lines(tail), "tail"))
    for r in (flat_r, tail_r):
        assert {p["prompts_trained"] for p in r["policies"].values()} == {512}
        assert r["workload"]["kind"] == "trace" and r["workload"]["epochs"] == 4
    fp, tp = flat_r["policies"], tail_r["policies"]
    assert fp["fixed16"]["straggler_rate"] == 0.0
    assert fp["tail8"]["wall_clock_s"] > fp["fixed8"]["wall_clock_s"]  # 572 s vs 466 s
    assert tp["fixed16"]["straggler_rate"] > 0.5
    assert tp["tail8"]["wall_clock_s"] < 0.6 * tp["fixed8"]["wall_clock_s"]  # 1871 vs 4372


def test_cli_replays_the_dapo_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert main(["bench", "--trace", str(DAPO), "--steps", "40", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "workload: verl trace" in text and "576 prompt groups of 8 x 3 epochs" in text
    rep = json.loads(out.read_text())
    assert rep["workload"]["file"] == str(DAPO) and rep["workload"]["cap"] == 10112
    pol = rep["policies"]
    assert pol["sagc_tail"]["speedup_vs_fixed16"] > 1.5
    assert pol["tail8"]["long_rounds"] > 0


def test_cli_refuses_a_bad_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _write(tmp_path, "bad.jsonl", ['{"input": 1, "output": [2]}', '{"input": 1}'])
    assert main(["bench", "--trace", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "--trace" in err and "bad.jsonl:2" in err and "'output'" in err
    assert main(["bench", "--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "cannot read the trace" in capsys.readouterr().err


def test_the_bench_measures_each_use_of_the_length_prior_alone() -> None:
    """--prior adds routing, dispatch and both; each trains the same prompts, routing sends
    prompts straight to long rounds (none before a prompt is seen: epoch 0), and the prior's
    calibration comes with the report."""
    rep, runs = run_bench(scenario("default").with_steps(36), seed=0,
                          trace=load_trace(DAPO), prior=True)
    pol = rep["policies"]
    assert {"sagc_tail_route", "sagc_tail_dispatch", "sagc_tail_prior"} <= set(pol)
    assert {p["prompts_trained"] for p in pol.values()} == {2 * 576}
    assert pol["sagc_tail_route"]["routed_prompts"] > 0
    assert pol["sagc_tail_dispatch"]["routed_prompts"] == 0
    assert pol["sagc_tail"]["routed_prompts"] == 0 and "length_prior" not in pol["sagc_tail"]
    cal = pol["sagc_tail_route"]["length_prior"]
    assert cal["seen"]["responses"] > 0 and cal["unseen"]["responses"] > 0
    assert 0.35 < cal["seen"]["below_p50"] < 0.65
    assert runs["sagc_tail_route"].long_replicas == runs["sagc_tail"].long_replicas
    # the prior as SAGC's context: every report after the first names the next round's risk,
    # SAGC draws from the context's posteriors once it has history, and files each step
    for name in ("sagc_tail_context", "sagc_context"):
        ctx = pol[name]
        assert ctx["routed_prompts"] == 0 and ctx["context_decisions"] > 0
        filed = sum(n for n, _ in ctx["context_counts"])
        assert filed >= ctx["steps"] - ctx["long_rounds"] - 3
    assert pol["sagc_tail"]["context_decisions"] == 0


# --- the length prior in a job's own order -----------------------------------------------------
def _drifting_trace(prompts: int = 40, epochs: int = 3, per_step: int = 10) -> list[str]:
    """A recorded trace whose every prompt answers e^2 times shorter after its first epoch
    (a policy that learned to stop rambling): lognormal lengths, a level per prompt."""
    rng = np.random.default_rng(0)
    levels = rng.normal(5.0, 0.5, size=prompts)
    lines = [header(max_tokens=4096, prompts=prompts, prompts_per_step=per_step, seed=0)]
    for ep in range(epochs):
        for p in range(prompts):
            step = ep * (prompts // per_step) + p // per_step
            for i in range(8):
                n = max(1, round(float(np.exp(levels[p] - (2.0 if ep else 0.0)
                                              + 0.4 * rng.standard_normal()))))
                lines.append(_rec(step=step, round=step, epoch=ep, prompt=p, index=i, length=n))
    return lines


def test_the_prior_replayed_in_the_jobs_order_shows_what_forgetting_predicts() -> None:
    trace = read_trace(_drifting_trace(), "drift.jsonl")
    stale = recorded_order_calibration(trace)
    fresh = recorded_order_calibration(trace, half_life=160.0)  # four epochs of 40 prompts
    assert stale["half_life"] is None and fresh["half_life"] == 160.0
    assert set(stale["seen_by_epoch"]) == {"1", "2"}  # nothing is seen before epoch 1
    # the third epoch: nearly every response below the median a prior of every epoch alike
    # predicts; about half with forgetting
    assert stale["seen_by_epoch"]["2"]["below_p50"] > 0.9
    assert abs(fresh["seen_by_epoch"]["2"]["below_p50"] - 0.5) < 0.15
    assert fresh["calibration"]["level_skill"] > stale["calibration"]["level_skill"]
    assert stale["calibration"]["groups"] == 120
    with pytest.raises(TraceError, match="no prompt ids"):
        recorded_order_calibration(load_trace(DAPO))


def test_cli_prints_the_prior_in_the_jobs_order_at_each_half_life(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = _write(tmp_path, "drift.jsonl", _drifting_trace())
    out = tmp_path / "r.json"
    assert main(["bench", "--trace", str(rec), "--steps", "12", "--prior",
                 "--prior-half-life", "160", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "in the job's own order, no forgetting" in text
    assert "in the job's own order, half-life 160 groups" in text
    rows = json.loads(out.read_text())["length_prior_recorded_order"]
    assert [r["half_life"] for r in rows] == [None, 160.0]
    for argv, message in (
            (["--trace", str(rec), "--prior-half-life", "160"], "needs --prior"),
            (["--trace", str(DAPO), "--prior", "--prior-half-life", "160"], "recorded by rlpacer"),
            (["--trace", str(rec), "--prior", "--prior-half-life", "0.5"], "1 group or more")):
        assert main(["bench", *argv]) == 2
        assert message in capsys.readouterr().err, argv



def test_long_rounds_of_an_epochs_deferred_prompts_reach_3x_on_the_dapo_trace() -> None:
    """#35's target on the DAPO trace (200 fixed-16 steps' prompts, 12 epochs): long rounds of
    RollPacker's size (P0 = 32 prompts) leave SAGC + tail batching at 2.37x fixed G=16; long
    rounds of 128 prompts (``tailBatching.longRound.prompts``; more than an epoch defers, so one
    long round an epoch) run a quarter as many long rounds, each about as long, and reach 3.0x
    for the same prompts (the fixed cost of each step's worth of updates still paid)."""
    trace = load_trace(DAPO)
    scn = scenario("default")
    base, _ = run_bench(scn, seed=0, trace=trace)
    big, _ = run_bench(scn.with_long_round_prompts(128), seed=0, trace=trace)
    b, g = base["policies"]["sagc_tail"], big["policies"]["sagc_tail"]
    assert big["long_round_prompts"] == 128 and base["long_round_prompts"] == 32
    assert b["prompts_trained"] == g["prompts_trained"] == big["policies"]["fixed16"][
        "prompts_trained"]
    assert g["long_rounds"] == 12 and b["long_rounds"] == 48
    assert b["speedup_vs_fixed16"] < 2.6
    assert g["speedup_vs_fixed16"] >= 3.0, g["speedup_vs_fixed16"]
    # policies without tail batching have no long rounds: the field changes nothing there
    assert big["policies"]["fixed16"]["wall_clock_s"] == base["policies"]["fixed16"][
        "wall_clock_s"]


def test_cli_refuses_long_rounds_smaller_than_a_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--long-round-prompts", "16"]) == 2
    assert "long-round prompts must be >= prompts per step (32), got 16" in (
        capsys.readouterr().err)


def test_filled_long_rounds_beat_larger_ones_on_the_dapo_trace() -> None:
    """``--long-round-fill``: long rounds of 64 queued prompts that also launch 256 fresh
    ones train the same prompts faster than long rounds of 64 alone (2.80x) and than the best
    long rounds without fill (128 prompts, one an epoch: 3.11x), in fewer steps; the fill
    changes nothing without tail batching."""
    trace = load_trace(DAPO)
    scn = scenario("default").with_long_round_prompts(64)
    plain, _ = run_bench(scn, seed=0, trace=trace)
    filled, _ = run_bench(scn.with_long_round_fill(256), seed=0, trace=trace)
    p, f = plain["policies"]["sagc_tail"], filled["policies"]["sagc_tail"]
    assert filled["long_round_fill"] == 256 and plain["long_round_fill"] == 0
    assert p["prompts_trained"] == f["prompts_trained"] == filled["policies"]["fixed16"][
        "prompts_trained"]
    assert f["steps"] < p["steps"]
    assert p["speedup_vs_fixed16"] < 2.9
    assert f["speedup_vs_fixed16"] >= 3.4, f["speedup_vs_fixed16"]
    assert f["bubble_fraction"] < p["bubble_fraction"]
    assert filled["policies"]["fixed16"]["wall_clock_s"] == plain["policies"]["fixed16"][
        "wall_clock_s"]


def test_cli_refuses_a_negative_fill(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--long-round-fill", "-1"]) == 2
    assert "long-round fill must be a prompt count >= 0, got -1" in capsys.readouterr().err


def test_racing_more_prompts_empties_the_short_rounds_bubble_not_the_runs() -> None:
    """Where the DAPO trace's bubble goes (``bubble_by_round``): with filled long rounds
    (64 + 256) the short rounds' bubble is 0.60 at eta 1.25, their batches under the engines'
    saturation batch. Racing 3 x P0 prompts (``--prompt-overprovision 3``) fills those batches
    (short-round bubble 0.01), but more prompts are deferred, SAGC sees fewer stragglers and
    raises G, and long rounds (bubble 0.5) take the time: the run is slower and its bubble
    stays above 0.4."""
    trace = load_trace(DAPO)
    scn = scenario("default").with_long_round_prompts(64).with_long_round_fill(256)
    base, _ = run_bench(scn, seed=0, trace=trace)
    wide, _ = run_bench(scn.with_overprovision(3.0), seed=0, trace=trace)
    b, w = base["policies"]["sagc_tail"], wide["policies"]["sagc_tail"]
    assert base["prompt_overprovision"] == 1.25 and wide["prompt_overprovision"] == 3.0
    bb, wb = b["bubble_by_round"], w["bubble_by_round"]
    assert bb["short"]["bubble"] > 0.5 and wb["short"]["bubble"] < 0.05, (bb, wb)
    assert wb["long"]["rounds"] > bb["long"]["rounds"]
    assert wb["long"]["idle_s"] > 0.9 * (wb["long"]["idle_s"] + wb["short"]["idle_s"])
    assert w["bubble_fraction"] > 0.4
    assert w["mean_group_size"] > b["mean_group_size"] + 2
    assert w["speedup_vs_fixed16"] < 0.85 * b["speedup_vs_fixed16"]
    # the split adds up to the whole
    for run in (b, w):
        by = run["bubble_by_round"]
        roll = by["short"]["rollout_s"] + by["long"]["rollout_s"]
        assert (by["short"]["idle_s"] + by["long"]["idle_s"]) / roll == pytest.approx(
            run["bubble_fraction"])
    assert "short" in base["policies"]["fixed16"]["bubble_by_round"]
    assert "long" not in base["policies"]["fixed16"]["bubble_by_round"]


def test_one_rollout_replica_halves_the_short_rounds_gpus_and_their_bubble(
        tmp_path: Path) -> None:
    """``--rollout-replicas 1``: the same schedule's short rounds on one engine hold twice the
    sequences an engine (bubble down) and take longer (every policy's wall clock up)."""
    args = ["bench", "--trace", str(DAPO), "--steps", "36", "--long-round-prompts", "64",
            "--long-round-fill", "256"]
    assert main([*args, "--json", str(tmp_path / "two.json")]) == 0
    assert main([*args, "--rollout-replicas", "1", "--json", str(tmp_path / "one.json")]) == 0
    two = json.loads((tmp_path / "two.json").read_text())
    one = json.loads((tmp_path / "one.json").read_text())
    assert two["elastic"]["short_replicas"] == 2 and one["elastic"]["short_replicas"] == 1
    for name in ("fixed16", "sagc_tail"):
        a, b = two["policies"][name], one["policies"][name]
        assert b["wall_clock_s"] > a["wall_clock_s"]
        assert b["bubble_by_round"]["short"]["bubble"] < a["bubble_by_round"]["short"][
            "bubble"] - 0.1


def test_cli_refuses_overprovision_outside_the_fields_range(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--prompt-overprovision", "0.5"]) == 2
    assert "prompt over-provisioning (eta) must be in [1, 16], got 0.5" in (
        capsys.readouterr().err)
    assert main(["bench", "--extra-responses", "65"]) == 2
    assert "extra responses per prompt must be in 0-64, got 65" in capsys.readouterr().err
    assert main(["bench", "--rollout-replicas", "0"]) == 2
    assert "rollout replicas must be >= 1, got 0" in capsys.readouterr().err
