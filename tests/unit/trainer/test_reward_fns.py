"""The built-in rewards: MathAnswer's extraction and comparison, Regex, the tiny task's, and
how a reward named in the spec is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpacer.api.job import BUILTIN_REWARDS
from rlpacer_trainer import reward_fns, task
from rlpacer_trainer.reward_fns import (
    answers_match,
    boxed,
    final_answer,
    math_answer,
    regex_reward,
    to_number,
)

pytestmark = pytest.mark.unit


def test_the_registry_is_the_apis() -> None:
    assert tuple(reward_fns.BUILTINS) == BUILTIN_REWARDS


@pytest.mark.parametrize(("text", "want"), [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{\frac{3}{4}}", r"\frac{3}{4}"),
    (r"first \boxed{1} then \boxed{ {2}+{3} }", " {2}+{3} "),
    (r"\boxed{\sqrt{\frac{1}{2}}} and more", r"\sqrt{\frac{1}{2}}"),
    (r"\boxed 7 apples", "7"),
    (r"\fbox{x}", "x"),
    (r"\boxed{unclosed", None),
    ("no box", None),
])
def test_boxed(text: str, want: str | None) -> None:
    assert boxed(text) == want


@pytest.mark.parametrize(("text", "want"), [
    (r"Total: 3 + 4 = 7, so the answer is \boxed{7}. Check: 8 is wrong", "7"),
    ("She has 12 apples, gives 5 away, and keeps 7.", "7"),
    ("The cost is $1,234.50 in total", "1,234.50"),
    ("Natalia sold 48/2 = 24 clips\n#### 72", "72"),
    ("3/4", "3/4"),
    ("-12", "-12"),
    ("no digits here", None),
])
def test_final_answer(text: str, want: str | None) -> None:
    assert final_answer(text) == want


@pytest.mark.parametrize(("text", "value"), [
    ("1,234", 1234), ("1,234.5", 1234.5), ("-0.25", -0.25), ("3/4", 0.75), ("3 / 4", 0.75),
    (r"\frac{3}{4}", 0.75), (r"-\dfrac{1}{8}", -0.125), ("$5", 5), (r"50\%", 50),
    (r"10\text{ cm}", None), ("1e3", 1000), ("7.", 7), (".5", 0.5),
    ("x", None), ("1/0", None), ("inf", None), ("12,34", None),
])
def test_to_number(text: str, value: float | None) -> None:
    got = to_number(text)
    assert (got is None) if value is None else float(got) == pytest.approx(value)


@pytest.mark.parametrize(("got", "want", "same"), [
    ("0.75", "3/4", True),
    (r"\frac{3}{4}", "0.75", True),
    ("1,000", "1000", True),
    ("1000.0000001", "1000", True),  # within the relative tolerance (1e-6)
    ("1001", "1000", False),
    ("0.3333333", "1/3", True),
    ("0.33", "1/3", False),
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", True),  # symbolic (sympy)
    ("2x+2", "2(x+1)", True),
    (r"\pi/2", r"\frac{\pi}{2}", True),
    ("x+1", "x+2", False),
    (r"\text{Monday}", "Monday", True),
    ("Tuesday", "Monday", False),
])
def test_answers_match(got: str, want: str, same: bool) -> None:
    assert answers_match(got, want) is same


def test_math_answer() -> None:
    assert math_answer(r"... so she pays \boxed{\$1,250}.", "1250") == 1.0
    assert math_answer("He runs 3 laps of 400 m: 1200 m.", "#### 1,200") == 1.0
    assert math_answer(r"\boxed{0.5}", r"\boxed{\frac{1}{2}}") == 1.0
    assert math_answer("I think 12", "13") == 0.0
    assert math_answer("no number at all", "13") == 0.0
    assert math_answer("", "") == 0.0
    p = task.Problem(0, 47, 9)  # the tiny task: the chain ends in the answer, 47 mod 9
    assert math_answer("38,29,20,11,2,", p.reference) == 1.0
    assert math_answer("38,29,20,11,3,", p.reference) == 0.0


def test_regex_without_an_answer_group_is_a_search() -> None:
    r = regex_reward(r"<answer>\d+</answer>")
    assert r("blah <answer>12</answer> blah", "99") == 1.0
    assert r("blah <answer>x</answer>", "99") == 0.0
    full = regex_reward(r"\A\d+(,\d+)*,\Z")  # anchored: a full match
    assert full("38,29,", "") == 1.0 and full("38,29, and more", "") == 0.0


def test_regex_with_an_answer_group_compares_the_last_match() -> None:
    r = regex_reward(r"answer is (?P<answer>[^.\s]+)")
    assert r("The answer is 7.", " 7 ") == 1.0
    assert r("The answer is 6. No wait, the answer is 7.", "7") == 1.0
    assert r("The answer is 7. No wait, the answer is 6.", "7") == 0.0
    assert r("no match", "7") == 0.0


def test_tiny_task_rewards_take_text() -> None:
    p = task.Problem(0, 47, 9)
    exact = reward_fns.load("ExactMatch")
    prefix = reward_fns.load("ChainPrefix")
    assert exact("38,29,20,11,2,", p.reference, p.prompt) == 1.0
    assert exact("38,29,20,11,", p.reference, p.prompt) == 0.0
    assert prefix("38,29,21,11,2,", p.reference, p.prompt) == pytest.approx(0.5 * 2 / 5)
    assert prefix("38,29,21,11,2,", p.reference) == task.prefix_reward("38,29,21,11,2,", p)


def test_load_user_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "rlpacer_test_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text(
        "def score(response, answer, prompt, **meta):\n"
        "    return float(len(response) + len(prompt))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = reward_fns.load("rlpacer_test_pkg.scoring:score")
    assert fn("abc", "", "pp") == 5.0
    with pytest.raises(reward_fns.RewardLoadError, match="no callable 'nope'"):
        reward_fns.load("rlpacer_test_pkg.scoring:nope")


@pytest.mark.parametrize("evil", [
    "__import__('os').system('touch /tmp/rlpacer-pwned')",
    "x.real", "open('f')", "9^9^9", "2^100000", "lambda: 1",
])
def test_symbolic_comparison_reads_only_plain_arithmetic(evil: str) -> None:
    assert answers_match(evil, "1") is False
    assert not Path("/tmp/rlpacer-pwned").exists()
