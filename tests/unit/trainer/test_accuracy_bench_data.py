"""The accuracy bench's data: the same held-out problems for every seed, none seen in training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlpacer_trainer import bench_accuracy, hfrecipe, wordproblems


def _questions(p: Path) -> list[str]:
    return [json.loads(x)["question"] for x in p.read_text().splitlines()]


def test_heldout_problems_are_unseen_and_the_same_every_time(tmp_path: Path) -> None:
    warm = {"examples": 2048, "data_seed": hfrecipe.WARM_START_DATA_SEED}
    train, held, dropped = bench_accuracy.write_data(tmp_path / "a", 2048, 300, 0, [warm])
    tq, hq = _questions(train), _questions(held)
    assert len(tq) == 2048 and len(hq) == 300 == len(set(hq))
    seen = set(tq) | {r["question"] for r in wordproblems.make(2048, warm["data_seed"])}
    assert not seen & set(hq)
    # the small "boxes" template repeats: some candidates were dropped, and counted
    assert dropped > 0
    again = bench_accuracy.write_data(tmp_path / "b", 2048, 300, 0, [warm])
    assert again[1].read_text() == held.read_text() and again[2] == dropped
    # without the warm start's data only the training file is excluded: fewer drops
    assert bench_accuracy.write_data(tmp_path / "c", 2048, 300, 0, [])[2] < dropped
    # a model fine-tuned from another: both warm starts' problems are kept out
    base = {"examples": 2048, "data_seed": hfrecipe.WARM_START_DATA_SEED + 1}
    both = bench_accuracy.write_data(tmp_path / "d", 2048, 300, 0, [warm, base])
    assert both[2] > dropped
    assert not {r["question"] for r in wordproblems.make(2048, base["data_seed"])} & set(
        _questions(both[1]))


def test_the_shipped_warm_start_names_its_recipe() -> None:
    shipped = Path(hfrecipe.__file__).parent / "assets" / "wordproblems-qwen2"
    meta = json.loads((shipped / "rlpacer_recipe.json").read_text())
    ws = meta["warm_start"]
    assert ws["data_seed"] == hfrecipe.WARM_START_DATA_SEED + ws["seed"]
    assert ws["system_prompt"] == hfrecipe.SYSTEM_PROMPT
    # the example names it, with the system prompt it was fine-tuned with
    doc = yaml.safe_load((bench_accuracy.EXAMPLE).read_text())
    assert (bench_accuracy.ROOT / doc["spec"]["model"]["source"]).resolve() == shipped.resolve()
    assert doc["spec"]["data"]["systemPrompt"] == hfrecipe.SYSTEM_PROMPT
    cfg = json.loads((shipped / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["vocab_size"] == hfrecipe.VOCAB_SIZE


def _row(seed: int, start: float, end: float, same: bool = True) -> dict[str, object]:
    return {"seed": seed, "start": start, "end": end, "gain": end - start,
            "checkpoint_scores_the_same": same}


def test_met_needs_the_mean_gain_and_every_checkpoint_scoring_the_same() -> None:
    rows = [_row(0, 0.30, 0.40), _row(1, 0.30, 0.34), _row(2, 0.32, 0.38)]
    res = bench_accuracy.summarize(rows, 0.05)
    assert res["gain"]["mean"] == pytest.approx(0.0667, abs=1e-4)
    assert res["gain"]["min"] == pytest.approx(0.04) and res["gain"]["stdev"] > 0
    assert res["seeds"] == [0, 1, 2] and res["met"]
    assert not bench_accuracy.summarize(rows, 0.07)["met"]  # the mean is under the bar
    rows[1]["checkpoint_scores_the_same"] = False  # a checkpoint that scores differently
    assert not bench_accuracy.summarize(rows, 0.05)["met"]


def test_warm_start_fine_tunes_the_recipe_model_in_place(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = hfrecipe.make(tmp_path / "m")
    before = load_file(model / "model.safetensors")
    meta = hfrecipe.warm_start(model, steps=40, batch=16, examples=256, log=lambda _: None)
    log = meta["warm_start"]["log"]
    assert [e["step"] for e in log] == [1, 40] and log[-1]["loss"] < 0.7 * log[0]["loss"]
    after = load_file(model / "model.safetensors")
    assert set(after) == set(before) and any(not (after[k] == before[k]).all() for k in after)
    assert json.loads((model / "rlpacer_recipe.json").read_text()) == json.loads(json.dumps(meta))


def test_rambling_targets_recheck_their_kinds_and_leave_the_others_alone() -> None:
    import random

    recs = wordproblems.make(2000, seed=7)
    rng = random.Random(0)
    checks: list[int] = []
    for r in recs:
        t = hfrecipe.ramble_target(r, 0.9, rng)
        if r["meta"]["kind"] not in hfrecipe.RAMBLE_KINDS:
            assert t == r["solution"]
            continue
        work, boxed = r["solution"].rsplit(". ", 1)
        n = t.count(" Check: ")
        # the worked solution, then n re-checks of it, then the same boxed answer
        assert t == work + "." + f" Check: {work}." * n + " " + boxed
        checks.append(n)
    assert len(checks) > 500 and min(checks) == 1
    assert max(checks) == hfrecipe.RAMBLE_MAX_CHECKS  # capped: 0.9**15 of them reach it
    # geometric: the mean of min(1 + Geom(0.1), 16) is about 8.1
    assert 7.0 < sum(checks) / len(checks) < 9.0
    one = [hfrecipe.ramble_target(r, 0.0, rng) for r in recs[:50]]
    assert all(t.count(" Check: ") == (r["meta"]["kind"] in hfrecipe.RAMBLE_KINDS)
               for t, r in zip(one, recs, strict=False))


def test_the_shipped_rambling_warm_start_names_its_recipe_and_its_base() -> None:
    assets = Path(hfrecipe.__file__).parent / "assets"
    shipped, base = assets / "wordproblems-ramble-qwen2", assets / "wordproblems-qwen2"
    meta = json.loads((shipped / "rlpacer_recipe.json").read_text())
    ws = meta["warm_start"]
    assert ws["ramble"] == 0.9 and ws["ramble_kinds"] == list(hfrecipe.RAMBLE_KINDS)
    assert ws["data_seed"] == hfrecipe.WARM_START_DATA_SEED + ws["seed"] != \
        hfrecipe.WARM_START_DATA_SEED
    assert meta["base"] == json.loads((base / "rlpacer_recipe.json").read_text())
    # fine-tuned from the base: the same tokenizer, other weights
    assert (shipped / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    assert (shipped / "model.safetensors").read_bytes() != (base / "model.safetensors").read_bytes()
    # the bench keeps both warm starts' problems out of its held-out set
    seeds = [w["data_seed"] for w in bench_accuracy.warm_starts(shipped / "rlpacer_recipe.json")]
    assert seeds == [ws["data_seed"], hfrecipe.WARM_START_DATA_SEED]
    example = bench_accuracy.ROOT / "examples" / "wordproblems-ramble-local.yaml"
    doc = yaml.safe_load(example.read_text())
    assert (bench_accuracy.ROOT / doc["spec"]["model"]["source"]).resolve() == shipped.resolve()
    assert doc["spec"]["data"]["systemPrompt"] == hfrecipe.SYSTEM_PROMPT
    # the recipe the example's header gives is the one recorded
    header = example.read_text().split("apiVersion")[0]
    assert (f"--ramble {ws['ramble']} --warm-start-steps {ws['steps']} --lr 1e-3 "
            f"--seed {ws['seed']}") in header and ws["lr"] == 1e-3


def test_the_recipe_fine_tunes_a_copy_with_rambling_targets(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = hfrecipe.make(tmp_path / "base")
    refused = {  # each bad command line, and what its error names
        "x": (["--from", str(base), "--ramble", "1.0", "--warm-start-steps", "2"],
              "--ramble 1.0: a probability in [0, 1)"),
        "y": (["--from", str(tmp_path / "nowhere"), "--ramble", "0.5", "--warm-start-steps", "2"],
              "not a model directory"),
        # the warm start's own flags without a warm start would do nothing: refused
        "z": (["--from", str(base), "--ramble", "0.5"],
              "--ramble 0.5 shapes the warm start: give --warm-start-steps N too"),
        "w": (["--lr", "1e-4"], "--lr 0.0001 shapes the warm start: give --warm-start-steps"),
        "v": (["--warm-start-steps", "2", "--lr", "0"], "--lr 0.0: a learning rate above 0"),
        "u": (["--warm-start-steps", "-1"], "--warm-start-steps -1: a number of steps"),
    }
    for name, (argv, message) in refused.items():
        with pytest.raises(SystemExit):
            hfrecipe.main([str(tmp_path / name), *argv])
        assert message in capsys.readouterr().err, name
        assert not (tmp_path / name).exists(), name
    (base / "rlpacer_recipe.json").write_text('{"warm_start": {"steps": 1}}')
    out = tmp_path / "out"
    assert hfrecipe.main([str(out), "--from", str(base), "--ramble", "0.5",
                          "--warm-start-steps", "2", "--seed", "3", "--lr", "1e-4"]) == 0
    meta = json.loads((out / "rlpacer_recipe.json").read_text())
    ws = meta["warm_start"]
    assert (ws["ramble"], ws["lr"], ws["steps"], ws["data_seed"]) == (0.5, 1e-4, 2, 1003)
    assert meta["base"] == {"warm_start": {"steps": 1}}
    assert (out / "model.safetensors").read_bytes() != (base / "model.safetensors").read_bytes()
