"""Time-to-accuracy analysis (rlpacer_trainer.tta) and bench-train's arms."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rlpacer_trainer import tta
from rlpacer_trainer.cli import format_tta, parse_arm, split_extra, split_fill

pytestmark = pytest.mark.unit


def curve(*pts: tuple[float, float]) -> list[dict[str, float]]:
    return [{"train_s": t, "step": i, "accuracy": a} for i, (t, a) in enumerate(pts)]


def test_time_to_interpolates_the_first_crossing() -> None:
    c = curve((0, 0.30), (10, 0.34), (20, 0.40), (30, 0.38), (40, 0.45))
    assert tta.time_to(c, 0.37) == pytest.approx(15.0)  # halfway between 10 s and 20 s
    assert tta.time_to(c, 0.30) == 0.0  # the warm start is already there
    assert tta.time_to(c, 0.45) == pytest.approx(40.0)
    assert tta.time_to(c, 0.46) is None  # never reached


def test_accuracy_at_is_the_last_evaluation_at_or_before() -> None:
    c = curve((0, 0.30), (10, 0.34), (20, 0.40))
    assert tta.accuracy_at(c, 9.99) == 0.30
    assert tta.accuracy_at(c, 10.0) == 0.34
    assert tta.accuracy_at(c, 1e9) == 0.40


def test_a_curve_whose_clock_runs_backwards_is_refused() -> None:
    with pytest.raises(ValueError, match="must not decrease"):
        tta.time_to(curve((0, 0.1), (5, 0.2), (4, 0.3)), 0.2)


def test_intervals() -> None:
    mean, lo, hi = tta.interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and hi - mean == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert tta.interval([0.5]) == (0.5, 0.5, 0.5)
    g, lo, hi = tta.log_ratio_interval([0.5, 0.5])
    assert g == pytest.approx(0.5) and lo == pytest.approx(0.5) and hi == pytest.approx(0.5)
    with pytest.raises(ValueError):
        tta.log_ratio_interval([0.5, 0.0])


def test_summary_pairs_seeds_against_the_baseline() -> None:
    curves = {
        # the baseline reaches 0.40 at 100 s (seed 0) and 0.50 at 80 s (seed 1)
        "fixed16": {0: curve((0, 0.30), (50, 0.35), (100, 0.40)),
                    1: curve((0, 0.30), (40, 0.45), (80, 0.50))},
        # twice as fast on seed 0, 4x on seed 1; ahead at the baseline's wall clock
        "sagc_tb": {0: curve((0, 0.30), (25, 0.35), (50, 0.40), (100, 0.44)),
                    1: curve((0, 0.30), (20, 0.50), (80, 0.52))},
        # never gets there on seed 1
        "fixed8": {0: curve((0, 0.30), (60, 0.40)), 1: curve((0, 0.30), (60, 0.40))},
    }
    s = tta.summarize(curves, "fixed16")
    base = s["arms"]["fixed16"]
    assert base["ratio_to_baseline"]["geomean"] == pytest.approx(1.0)
    assert base["delta_at_baseline_wall"]["mean"] == pytest.approx(0.0)
    prod = s["arms"]["sagc_tb"]
    assert prod["per_seed"]["0"]["seconds_to_target"] == pytest.approx(50.0)
    assert prod["per_seed"]["1"]["seconds_to_target"] == pytest.approx(20.0)
    assert prod["ratio_to_baseline"]["geomean"] == pytest.approx(math.sqrt(0.5 * 0.25))
    assert prod["delta_at_baseline_wall"]["mean"] == pytest.approx((0.04 + 0.02) / 2)
    slow = s["arms"]["fixed8"]
    assert slow["reached_target"] == "1/2" and slow["ratio_to_baseline"] is None
    assert slow["per_seed"]["0"]["ratio_to_baseline"] == pytest.approx(0.6)
    table = format_tta(s)
    assert "sagc_tb" in table and "0.35x" in table and "1/2" in table


def test_summary_needs_the_baselines_seeds() -> None:
    with pytest.raises(ValueError, match="seed 3"):
        tta.summarize({"fixed16": {0: curve((0, 0.1))}, "sagc": {3: curve((0, 0.1))}},
                      "fixed16")


def test_rollout_seconds_per_informative_group_by_round_kind() -> None:
    recs = [
        {"round_kind": "Short", "seconds_rollout": 2.0, "informative_groups": 10},
        {"round_kind": "Short", "seconds_rollout": 2.0, "informative_groups": 6},
        {"round_kind": "Long", "seconds_rollout": 3.0, "informative_groups": 0},
        {"round_kind": "Long", "seconds_rollout": 1.0},  # an older record: skipped
    ]
    out = tta.seconds_per_informative_group(recs)
    assert out["Short"]["rollout_s_per_informative_group"] == pytest.approx(4.0 / 16)
    assert out["Long"]["rounds"] == 1 and out["Long"]["rollout_s_per_informative_group"] is None


@pytest.mark.parametrize(("name", "want"), [
    ("fixed16", (16, False, None)), ("tb8", (8, True, None)), ("sagc", (None, False, None)),
    ("sagc_tb", (None, True, None)), ("fixed16-mb1", (16, False, 1)),
    ("sagc_tb-mb4", (None, True, 4))])
def test_arms(name: str, want: tuple[int | None, bool, int | None]) -> None:
    assert parse_arm(name) == want


@pytest.mark.parametrize("name", ["fixed", "fixed0", "tbx", "sagc-tb", "g16", "x-mb1"])
def test_unknown_arms_are_refused_naming_the_forms(name: str) -> None:
    with pytest.raises(ValueError, match="fixed<N>, tb<N>, sagc or sagc_tb"):
        parse_arm(name)


@pytest.mark.parametrize("name", ["fixed16-mb0", "sagc-mbx", "tb8-mb"])
def test_bad_mini_batches_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="-mb<K> needs K >= 1"):
        parse_arm(name)


def test_an_arms_mini_batches_reach_the_learner() -> None:
    """What bench-train loads for ``fixed16-mb1``: the learner takes one optimizer step per
    training step; an arm without ``-mb`` keeps the run's default."""
    from pathlib import Path

    from rlpacer_trainer.config import RunConfig

    example = Path(__file__).resolve().parents[3] / "examples" / "tiny-local.yaml"
    fixed, tb, mb = parse_arm("fixed16-mb1")
    kw = {} if mb is None else {"mini_batches": mb}
    assert RunConfig.load(example, fixed_group_size=fixed, tail_batching=tb,
                          **kw).learner_config().mini_batches == 1
    assert RunConfig.load(example).learner_config().mini_batches == 2


@pytest.mark.parametrize(("name", "want"), [
    ("sagc_tb-fill64", ("sagc_tb", 64)), ("tb8-mb1-fill0", ("tb8-mb1", 0)),
    ("sagc_tb", ("sagc_tb", None))])
def test_an_arms_fill(name: str, want: tuple[str, int | None]) -> None:
    assert split_fill(name) == want


def test_a_bad_fill_is_refused() -> None:
    with pytest.raises(ValueError, match="-fill<F> needs F >= 0"):
        split_fill("sagc_tb-fillx")


def test_an_arms_fill_reaches_the_planner_and_a_fill_without_tail_batching_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What bench-train loads for ``sagc_tb-fill64``: the planner's long rounds launch 64
    fresh prompts (the manifest's value otherwise); ``fixed16-fill64`` has no long rounds to
    fill and is refused before anything runs."""
    from rlpacer.cli import main
    from rlpacer_trainer.config import RunConfig

    example = Path(__file__).resolve().parents[3] / "examples" / "tiny-local.yaml"
    assert RunConfig.load(example, long_round_fill=64).planner_config().long_round_fill == 64
    assert RunConfig.load(example).planner_config().long_round_fill == 0
    rc = main(["bench-train", str(example), "--arms", "fixed16", "fixed16-fill64",
                       "--out", str(tmp_path)])
    assert rc == 2
    assert "arm 'fixed16-fill64': -fill<F> fills tail batching's long rounds" in (
        capsys.readouterr().out)


@pytest.mark.parametrize(("name", "want"), [
    ("sagc_tb-extra0", ("sagc_tb", 0)), ("tb8-mb1-fill4-extra2", ("tb8-mb1-fill4", 2)),
    ("sagc_tb", ("sagc_tb", None))])
def test_an_arms_extra_responses(name: str, want: tuple[str, int | None]) -> None:
    assert split_extra(name) == want


def test_an_arms_extra_responses_reach_the_planner_and_are_refused_without_tail_batching(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``sagc_tb-extra0-persec``: the planner launches G responses per prompt in a short
    round (the manifest's extraResponsesPerPrompt otherwise); a bad K, or K on an arm
    without tail batching, is refused before anything runs."""
    from rlpacer.cli import main
    from rlpacer_trainer.config import RunConfig

    example = Path(__file__).resolve().parents[3] / "examples" / "tiny-local.yaml"
    assert RunConfig.load(example, extra_responses=0).planner_config().extra_responses == 0
    assert RunConfig.load(example).planner_config().extra_responses == 1
    with pytest.raises(ValueError, match="-extra<K> needs K >= 0"):
        split_extra("sagc_tb-extrax")
    for arm, want in (("fixed16-extra0", "-extra<K> sets tail batching's extra responses"),
                      ("sagc-extra0-persec", "use it on tb<N> or sagc_tb")):
        assert main(["bench-train", str(example), "--arms", "fixed16", arm,
                     "--out", str(tmp_path)]) == 2
        assert f"arm {arm!r}: " in (out := capsys.readouterr().out) and want in out


@pytest.mark.parametrize(("name", "want"), [("trl16", 16), ("trl8", 8), ("fixed16", None),
                                            ("sagc_tb", None)])
def test_trl_arms(name: str, want: int | None) -> None:
    from rlpacer_trainer import trl_arm

    assert trl_arm.parse(name) == want


@pytest.mark.parametrize("name", ["trl", "trl1", "trlx", "trl16-mb1"])
def test_bad_trl_arms_are_refused(name: str) -> None:
    from rlpacer_trainer import trl_arm

    with pytest.raises(ValueError, match="trl<N> with N >= 2"):
        trl_arm.parse(name)


def test_bench_train_refuses_a_trl_arm_it_cannot_run(capsys: object, tmp_path: object) -> None:
    """Before any engine starts: a trl arm as the baseline is an error naming what to change,
    and so are a model TRL cannot load (a folder with no Hugging Face config) and a job with
    overlong shaping (TRL cannot match it)."""
    import argparse
    from pathlib import Path
    from types import SimpleNamespace

    from rlpacer_trainer import trl_arm
    from rlpacer_trainer.cli import cmd_bench_train

    root = Path(__file__).resolve().parents[3]
    args = argparse.Namespace(manifest=root / "examples" / "tiny-local.yaml", arms=["trl16"],
                              baseline="trl16", seeds=[0], steps=2, eval_every=1,
                              eval_prompts=8, equal_wall_clock=False, out=Path("unused"))
    assert cmd_bench_train(args) == 2
    assert "a trl<N> arm cannot be the baseline" in capsys.readouterr().out  # type: ignore[attr-defined]
    cfg = SimpleNamespace(model_path=Path(str(tmp_path)), overlong_buffer=0,
                          spec=SimpleNamespace(model=SimpleNamespace(source="pvc://m/x")))
    with pytest.raises(ValueError, match=r"needs a Hugging Face-format model folder in"
                       r" spec.model.source \(got 'pvc://m/x', no config.json\)"):
        trl_arm.check(cfg)
    cfg.overlong_buffer = 16  # DAPO's shaping: TRL has none, so no like-for-like arm
    with pytest.raises(ValueError, match=r"overlongPenalty\.enabled: false"):
        trl_arm.check(cfg)


def test_a_persec_arm_sets_sagcs_objective_and_a_fixed_arm_refuses_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What bench-train loads for ``sagc_tb-persec``: SAGC maximises log2(G) per second of a
    step (the manifest's objective otherwise); ``fixed16-persec`` has no G to choose and is
    refused before anything runs."""
    from rlpacer.cli import main
    from rlpacer_trainer.cli import split_objective
    from rlpacer_trainer.config import RunConfig

    assert split_objective("sagc_tb-fill8-persec") == ("sagc_tb-fill8", "second")
    assert split_objective("sagc_tb") == ("sagc_tb", None)
    example = Path(__file__).resolve().parents[3] / "examples" / "tiny-local.yaml"
    assert RunConfig.load(example, sagc_objective="second").controller_config(
        ).sagc.objective == "second"
    assert RunConfig.load(example).controller_config().sagc.objective == "step"
    rc = main(["bench-train", str(example), "--arms", "fixed16", "fixed16-persec",
               "--out", str(tmp_path)])
    assert rc == 2
    assert "arm 'fixed16-persec': -persec sets SAGC's objective" in capsys.readouterr().out


def test_a_target_from_the_baselines_last_evaluations_and_below_its_plateau() -> None:
    """``--target-evals K`` (the mean of the baseline's last K evaluations) and
    ``--target-gain F`` (the warm start plus F of the gain to that): on curves that rise at a
    cure and level off, the final evaluation is one noisy draw from the plateau, and a first
    crossing of the plateau is decided by noise; 90% of the gain puts the target on the rise."""
    # the baseline rises at 16 s and levels off at about 0.58 (a peak, then noise)
    base = curve((0, 0.24), (9, 0.25), (16, 0.60), (21, 0.56), (26, 0.58), (31, 0.57))
    # the arm rises at 6-8 s, to the same plateau, but its noise never reaches 0.57 again
    arm = curve((0, 0.24), (4, 0.24), (6, 0.50), (8, 0.565), (10, 0.56), (12, 0.565))
    curves = {"fixed16": {0: base}, "sagc_tb": {0: arm}}
    final = tta.summarize(curves, "fixed16")
    assert final["arms"]["sagc_tb"]["reached_target"] == "0/1"  # 0.57: a coin toss
    assert tta.target_of(base, 3) == pytest.approx((0.56 + 0.58 + 0.57) / 3)
    level = tta.target_of(base, 1)
    assert level == pytest.approx(0.57)
    want = 0.24 + 0.9 * (0.57 - 0.24)  # 0.537
    assert tta.target_of(base, 1, 0.9) == pytest.approx(want)
    s = tta.summarize(curves, "fixed16", gain_fraction=0.9)
    assert s["gain_fraction"] == 0.9 and s["target_evals"] == 1
    row = s["arms"]["sagc_tb"]["per_seed"]["0"]
    b_time = 9 + 7 * (want - 0.25) / (0.60 - 0.25)
    t = 6 + 2 * (want - 0.50) / (0.565 - 0.50)
    assert row["target"] == pytest.approx(want)
    assert row["baseline_seconds_to_target"] == pytest.approx(b_time)
    assert row["seconds_to_target"] == pytest.approx(t)
    assert row["ratio_to_baseline"] == pytest.approx(t / b_time)
    # accuracy at the baseline's wall clock is judged against its level, not the lower target
    assert row["baseline_level"] == pytest.approx(0.57)
    assert row["delta_at_baseline_wall"] == pytest.approx(0.565 - 0.57)
    table = format_tta(s)
    assert "warm start plus 90% of fixed16's gain to fixed16's final accuracy" in table
    assert f"{t / b_time:.2f}" in table.splitlines()[-1]  # the per-seed ratio
    # a baseline that never rose: the target is its level (nothing to take a fraction of)
    flat = curve((0, 0.30), (10, 0.29), (20, 0.28))
    assert tta.target_of(flat, 1, 0.5) == pytest.approx(0.28)
    # the warm start alone: it is the level
    assert tta.target_of(curve((0, 0.3)), 3) == pytest.approx(0.3)


@pytest.mark.parametrize(("kw", "match"), [({"target_evals": 0}, "target_evals must be >= 1"),
                                           ({"gain_fraction": 0.0}, "gain_fraction must be in"),
                                           ({"gain_fraction": 1.5}, "gain_fraction must be in")])
def test_bad_targets_are_refused(kw: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tta.target_of(curve((0, 0.3), (1, 0.4)), **kw)  # type: ignore[arg-type]


def test_rescore_summarises_a_recorded_run_again(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``bench-train --rescore DIR``: the table of a recorded run from its rows' curves, with
    another target, training nothing; a run cut short keeps the seeds its baseline finished;
    a missing folder or baseline is a clear error."""
    import argparse
    import json

    from rlpacer_trainer.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())

    base = curve((0, 0.24), (9, 0.25), (16, 0.60), (21, 0.56), (26, 0.58), (31, 0.57))
    arm = curve((0, 0.24), (4, 0.24), (6, 0.50), (8, 0.565), (10, 0.56), (12, 0.565))
    rows = [{"arm": "fixed16", "seed": 0, "curve": base}, {"arm": "sagc_tb", "seed": 0,
                                                           "curve": arm},
            {"arm": "fixed16", "seed": 1, "curve": base}]  # seed 1's sagc_tb never ran
    (tmp_path / "bench-train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def run(*argv: str) -> tuple[int, str]:
        args = parser.parse_args(["bench-train", *argv])
        rc = args.func(args)
        return rc, capsys.readouterr().out

    rc, out = run("--rescore", str(tmp_path))
    assert rc == 0 and "target: fixed16's final accuracy" in out
    assert "left out: sagc_tb (no curve for seed 1, which fixed16 has)" in out
    assert not any(ln.startswith("sagc_tb") for ln in out.splitlines())  # not paired
    rows.append({"arm": "sagc_tb", "seed": 1, "curve": arm})
    (tmp_path / "bench-train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, out = run("--rescore", str(tmp_path), "--target-gain", "0.9", "--target-evals", "3")
    assert rc == 0 and "mean of fixed16's last 3 evaluations" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("sagc_tb"))
    assert "2/2" in line
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"arm": "fixed16", "seed": 0}) + "\n")
    rc, out = run("--rescore", str(bad))
    assert rc == 2 and "row 1" in out and "arm, seed or curve" in out
    rc, out = run("--rescore", str(tmp_path / "nowhere"))
    assert rc == 2 and "--rescore" in out and "bench-train.jsonl" in out
    rc, out = run("--rescore", str(tmp_path), "--baseline", "fixed8")
    assert rc == 2 and "--baseline fixed8" in out and "fixed16, sagc_tb" in out
    rc, out = run("--rescore", str(tmp_path), "--target-gain", "0")
    assert rc == 2 and "--target-gain" in out
    rc, out = run("--rescore", str(tmp_path), "--target-evals", "0")
    assert rc == 2 and "--target-evals" in out
