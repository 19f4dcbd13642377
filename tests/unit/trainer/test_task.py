"""The tiny task: references, rewards, heavy-tailed lengths; the tokenizer round trip."""

from __future__ import annotations

import statistics

import pytest

from rlpacer_trainer import task, tiny

pytestmark = pytest.mark.unit


def test_reference_and_reward() -> None:
    p = task.Problem(0, 47, 9)
    assert p.prompt == "47-9:"
    assert p.reference == "38,29,20,11,2,"
    assert p.answer == 2
    assert task.reward("38,29,20,11,2,", p) == 1.0
    assert task.reward("38,29,20,11,", p) == 0.0
    assert task.reward("38,29,20,11,2,1,", p) == 0.0


def test_lengths_are_heavy_tailed_and_seeded() -> None:
    ps = task.make_problems(4000, seed=1)
    assert ps == task.make_problems(4000, seed=1)
    lengths = sorted(len(p.reference) + 1 for p in ps)
    med = statistics.median(lengths)
    assert lengths[-1] / med >= 10  # a few prompts need >10x the median response
    assert lengths[int(0.5 * len(lengths))] <= 12
    assert max(lengths) <= task.max_response_tokens()


def test_eval_and_train_sets_differ() -> None:
    train = {(p.n, p.k) for p in task.make_problems(500, task.TRAIN_SEED)}
    ev = task.make_problems(500, task.EVAL_SEED)
    assert sum((p.n, p.k) in train for p in ev) < 500


def test_tokenizer_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tiny.save_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "47-9:38,29,"
    assert tok.encode(text, add_special_tokens=False) == tiny.encode(text)
    assert tiny.decode([*tiny.encode("12,"), tiny.EOS_ID, 5]) == "12,"
    assert tok.eos_token_id == tiny.EOS_ID


def test_builtin_source() -> None:
    path = tiny.resolve_source("builtin://tiny-chain")
    assert (path / "config.json").exists() and (path / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="unknown builtin"):
        tiny.resolve_source("builtin://nope")


def test_prefix_reward() -> None:
    p = task.Problem(0, 47, 9)  # 38,29,20,11,2,
    assert task.prefix_reward("38,29,20,11,2,", p) == 1.0
    assert task.prefix_reward("38,29,21,11,2,", p) == pytest.approx(0.5 * 2 / 5)
    assert task.prefix_reward("38,29,20,11,2,1,", p) == pytest.approx(0.5)
    assert task.prefix_reward("", p) == 0.0
