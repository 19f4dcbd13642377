"""The built-in rewards and the signature every reward has.

A reward is a plain function of text::

    def reward(response: str, answer: str, prompt: str, **meta: Any) -> float

``response`` is the model's decoded response (without EOS), ``answer`` the problem's reference
text (the tiny task's chain; a data set's answer field), ``prompt`` the prompt as the model saw
it; ``meta`` is empty today (later versions may pass more keywords, so accept ``**meta``). It
returns a finite number (``bool`` counts); anything else, or an exception, scores
``spec.reward.failureScore`` and is counted. Rewards run in worker processes
(:mod:`rlpacer_trainer.rewards`), so a user reward may hang or crash without harm.

This module is what the workers import: it stays light (no torch); sympy is imported on the
first symbolic comparison only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from rlpacer_trainer import task

RewardFn = Callable[..., float]


# --- ExactMatch, ChainPrefix ------------------------------------------------------------------
def exact_match(response: str, answer: str, prompt: str = "", **meta: Any) -> float:
    """1.0 when the response equals the answer (surrounding whitespace ignored), else 0.0."""
    return 1.0 if response.strip() == answer.strip() else 0.0


def chain_prefix(response: str, answer: str, prompt: str = "", **meta: Any) -> float:
    """The tiny task's partial credit (:func:`rlpacer_trainer.task.chain_prefix`)."""
    return task.chain_prefix(response, answer)


# --- MathAnswer -------------------------------------------------------------------------------
#: A number as people write it: thousands separators, decimals, a fraction a/b.
_NUM = (r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*(?:\d{1,3}(?:,\d{3})+|\d+))?"
        r"|[-+]?\.\d+")
_NUM_RE = re.compile(_NUM)
_FRAC_RE = re.compile(r"^([-+]?)\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}$")
_STRIP = (r"\!", r"\,", r"\;", r"\:", r"\ ", r"\$", r"\%", "$", "%", r"\left", r"\right",
          r"^\circ", r"^{\circ}", r"\displaystyle")


def boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces kept;
    ``\\boxed 5`` (no braces) gives ``5``. None when there is none or it is unclosed."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)", text)]
    if not starts:
        return None
    i = starts[-1]
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] != "{":
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def _clean(s: str) -> str:
    s = s.strip()
    for tok in _STRIP:
        s = s.replace(tok, "")
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    return s.strip().rstrip(".").strip()


def to_number(s: str) -> Fraction | float | None:
    """``s`` as a number when it is exactly one: ``1,234``, ``-0.5``, ``3/4``, ``\\frac{3}{4}``,
    ``1e3``; None otherwise."""
    s = _clean(s)
    m = _FRAC_RE.match(s)
    if m:
        num, den = to_number(m.group(2)), to_number(m.group(3))
        if num is None or den is None or den == 0:
            return None
        q = Fraction(num) / Fraction(den)
        return -q if m.group(1) == "-" else q
    if not re.fullmatch(_NUM, s):
        try:
            x = float(s)  # 1e3, inf is refused below
        except ValueError:
            return None
        return x if math.isfinite(x) else None
    s = s.replace(",", "").replace(" ", "")
    if "/" in s:
        a, b = s.split("/")
        if float(b) == 0:
            return None
        return Fraction(a) / Fraction(b)
    return Fraction(s)


def final_answer(text: str) -> str | None:
    """A text's final answer: the last ``\\boxed{}``; else what follows the last ``####``
    (GSM8K's marker); else the whole text when it is one number; else its last number."""
    b = boxed(text)
    if b is not None:
        return b.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    if to_number(text) is not None:
        return text.strip()
    nums = _NUM_RE.findall(text)
    return nums[-1] if nums else None


def _sympy_expr(s: str) -> Any:
    """A short LaTeX-ish answer as a sympy expression (``\\frac``, ``\\sqrt``, ``\\pi``, ``^``)."""
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    s = _clean(s)
    for _ in range(8):  # innermost first: \frac{\sqrt{2}}{2}
        t = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
        t = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", t)
        if t == s:
            break
        s = t
    s = (s.replace(r"\pi", "pi").replace(r"\cdot", "*").replace(r"\times", "*")
         .replace("{", "(").replace("}", ")").replace(",", ""))
    # parse_expr evaluates Python: only arithmetic on numbers, one-letter symbols, sqrt and pi
    # reach it (no names, attributes or calls from a response), and no large powers
    words = set(re.findall(r"[A-Za-z]+", s))
    if (not re.fullmatch(r"[0-9A-Za-z+\-*/^().\s]*", s) or re.search(r"[A-Za-z]\.|\.[A-Za-z]", s)
            or any(len(w) > 1 and w not in ("sqrt", "pi") for w in words)
            or s.count("^") > 1 or re.search(r"\^\s*\(?\s*\d{3,}", s)):
        raise ValueError(f"not a plain expression: {s!r}")
    return parse_expr(s, transformations=(*standard_transformations, convert_xor,
                                          implicit_multiplication_application), evaluate=True)


def answers_match(got: str, want: str, *, rel_tol: float = 1e-6, symbolic: bool = True) -> bool:
    """Whether two final answers agree: numerically (``rel_tol``, absolute 1e-9 near zero),
    else symbolically with sympy for short expressions (``symbolic``), else as cleaned text."""
    a, b = to_number(got), to_number(want)
    if a is not None and b is not None:
        return a == b or math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=1e-9)
    if _clean(got) == _clean(want):
        return True
    if symbolic and max(len(got), len(want)) <= 64:
        try:
            import sympy

            d = sympy.simplify(_sympy_expr(got) - _sympy_expr(want))
            return bool(d == 0)
        except Exception:  # anything sympy cannot read is simply not equal
            return False
    return False


def math_answer(response: str, answer: str, prompt: str = "", **meta: Any) -> float:
    """1.0 when the response's final answer (:func:`final_answer`) equals the problem's,
    numerically or symbolically (:func:`answers_match`); else 0.0."""
    got, want = final_answer(response), final_answer(answer)
    if got is None or want is None:
        return 0.0
    return 1.0 if answers_match(got, want) else 0.0


# --- Regex ------------------------------------------------------------------------------------
def regex_reward(pattern: str) -> RewardFn:
    """The ``Regex`` reward for ``spec.reward.pattern``: the pattern is searched for in the
    response (``re.search``; anchor with ``\\A...\\Z`` for a full match). Without a group named
    ``answer``: 1.0 when it matches. With ``(?P<answer>...)``: 1.0 when the group of the last
    match equals the problem's answer (both stripped)."""
    rx = re.compile(pattern)

    def reward(response: str, answer: str, prompt: str = "", **meta: Any) -> float:
        last = None
        for last in rx.finditer(response):  # noqa: B007 - the last match is wanted
            pass
        if last is None:
            return 0.0
        if "answer" not in rx.groupindex:
            return 1.0
        return 1.0 if (last.group("answer") or "").strip() == answer.strip() else 0.0

    return reward


#: ``spec.reward.type`` -> the reward (Regex is built from ``spec.reward.pattern``).
BUILTINS: dict[str, Callable[[str | None], RewardFn]] = {
    "ExactMatch": lambda _: exact_match,
    "ChainPrefix": lambda _: chain_prefix,
    "MathAnswer": lambda _: math_answer,
    "Regex": lambda pattern: regex_reward(pattern or ""),
}


class RewardLoadError(ValueError):
    """``spec.reward.type`` names a function that cannot be loaded."""


def load(type_: str, pattern: str | None = None) -> RewardFn:
    """The reward ``type_`` names: a built-in, or ``module:function`` imported here (in a
    worker process)."""
    import importlib

    if type_ in BUILTINS:
        return BUILTINS[type_](pattern)
    module, _, name = type_.partition(":")
    try:
        mod = importlib.import_module(module)
    except Exception as err:
        raise RewardLoadError(f"spec.reward.type: {type_!r}: cannot import {module!r}:"
                              f" {type(err).__name__}: {err}") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise RewardLoadError(f"spec.reward.type: {type_!r}: module {module!r} has no callable"
                              f" {name!r}")
    return fn  # type: ignore[no-any-return]
