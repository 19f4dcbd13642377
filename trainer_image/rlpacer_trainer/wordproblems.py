"""Grade-school-style arithmetic word problems with ``\\boxed{}`` answers, as JSON Lines.

``python -m rlpacer_trainer.wordproblems OUT.jsonl --count N --seed S`` writes one object per
line::

    {"id": "wp-0", "question": "Mia has 12 apples ...", "solution": "... = 7. \\boxed{7}",
     "answer": "7", "meta": {"ops": 2, "kind": "buy"}}

Each problem is one of a few templates with one or two steps of + - * over small whole
numbers; the answer is a whole number >= 0. Seeded and deterministic: the same seed writes the
same file. The data the project's tests and examples use as "a user's dataset"
(``spec.data.promptField: question``, ``answerField: answer``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

NAMES = ["Mia", "Liam", "Ava", "Noah", "Zoe", "Omar", "Lena", "Ravi", "Sara", "Tom"]
ITEMS = ["apples", "pencils", "marbles", "stickers", "books", "cookies", "shells", "coins"]


def _one(rng: random.Random, i: int) -> dict[str, Any]:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.choice(["give", "buy", "share", "boxes", "two-step"])
    if kind == "give":
        a = rng.randint(5, 60)
        b = rng.randint(1, a)
        q = (f"{name} has {a} {item}. {name} gives {b} {item} to {other}. How many {item}"
             f" does {name} have now?")
        ans, work, ops = a - b, f"{a} - {b} = {a - b}", 1
    elif kind == "buy":
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        q = f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have?"
        ans, work, ops = a + b, f"{a} + {b} = {a + b}", 1
    elif kind == "share":
        per, k = rng.randint(1, 12), rng.randint(2, 6)
        q = (f"{name} shares {per * k} {item} equally among {k} friends. How many {item} does"
             " each friend get?")
        ans, work, ops = per, f"{per * k} / {k} = {per}", 1
    elif kind == "boxes":
        a, b = rng.randint(2, 9), rng.randint(2, 12)
        q = f"There are {a} boxes with {b} {item} in each box. How many {item} are there in all?"
        ans, work, ops = a * b, f"{a} * {b} = {a * b}", 1
    else:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        c = rng.randint(0, a * b)
        q = (f"{name} buys {a} bags of {item} with {b} in each bag, then gives {c} to {other}."
             f" How many {item} are left?")
        ans, work, ops = a * b - c, f"{a} * {b} = {a * b}, {a * b} - {c} = {a * b - c}", 2
    return {"id": f"wp-{i}", "question": q, "solution": f"{work}. \\boxed{{{ans}}}",
            "answer": str(ans), "meta": {"ops": ops, "kind": kind}}


def make(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [_one(rng, i) for i in range(count)]


def write(out: Path, count: int, seed: int = 0) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for rec in make(count, seed):
            f.write(json.dumps(rec) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--count", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    write(a.out, a.count, a.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
