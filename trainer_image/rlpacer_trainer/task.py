"""The tiny verifiable task: repeated subtraction with every intermediate value written out.

Why this task: RL needs a verifiable answer, and tail batching needs *heavy-tailed* response
lengths (DESIGN.md: plain 1-4 digit addition has max/median of only ~2). A prompt ``N-k:``
asks for the chain ``N-k, N-2k, ...`` down to ``N mod k`` (the first value below ``k``). The
number of terms ``T`` is drawn from a discrete Pareto law (median ~4, a few prompts hit the cap
of 40), so a handful of prompts need responses ~10x the median. Errors compound along the
chain, so difficulty grows with length, and sampling at temperature 1 sometimes rambles on.

Each term depends only on the previous term and ``k`` (a local rule), which a model of a few
hundred thousand parameters learns in minutes on a CPU; exactness over a long chain is what
stays hard, and that is what RL improves.

Example: prompt ``47-9:``; response ``38,29,20,11,2,`` then EOS; the answer is 2 = 47 mod 9.

Reward: 1.0 when the response is exactly the reference chain, else 0.0 (a pure function).
The scored rewards (``ExactMatch``, ``ChainPrefix``) see a problem as text: the prompt and
:attr:`Problem.reference`, the chain (:mod:`rlpacer_trainer.reward_fns`).
"""

from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass(frozen=True)
class Problem:
    """One prompt: start ``n``, step ``k``; ``pid`` is its index in its data set."""

    pid: int
    n: int
    k: int

    @property
    def prompt(self) -> str:
        return f"{self.n}-{self.k}:"

    @property
    def reference(self) -> str:
        return chain(self.n, self.k)

    @property
    def answer(self) -> int:
        return self.n % self.k

    @property
    def terms(self) -> int:
        return self.n // self.k


def chain(n: int, k: int) -> str:
    """The reference response (without EOS): ``n-k, n-2k, ..., n mod k``, comma-terminated."""
    out = []
    x = n
    while x >= k:
        x -= k
        out.append(f"{x},")
    return "".join(out)


def reward(response: str, problem: Problem) -> float:
    """1.0 for exactly the reference chain, else 0.0."""
    return 1.0 if response == problem.reference else 0.0


def prefix_reward(response: str, problem: Problem) -> float:
    """Partial credit (built-in reward ``ChainPrefix``): see :func:`chain_prefix`."""
    return chain_prefix(response, problem.reference)


def chain_prefix(response: str, reference: str) -> float:
    """1.0 for exactly the reference chain, else half the fraction of leading terms that are
    right. A full solution always beats any partial one, and a long chain that goes wrong late
    still tells the policy which prefix was good (exact match alone gives almost every
    long-chain group all-zero rewards, i.e. no signal)."""
    if response == reference:
        return 1.0
    want = reference.split(",")[:-1]
    got = response.split(",")
    ok = 0
    for w, g in zip(want, got, strict=False):
        if w != g:
            break
        ok += 1
    return 0.5 * ok / max(1, len(want))


def sample_terms(rng: random.Random, alpha: float, t_min: int, t_max: int) -> int:
    """Discrete Pareto: P(T >= t) = (t / t_min) ** -alpha for t >= t_min, capped at t_max."""
    u = 1.0 - rng.random()  # (0, 1]
    return min(t_max, int(t_min * u ** (-1.0 / alpha)))


def make_problems(
    count: int,
    seed: int,
    *,
    alpha: float = 1.1,
    t_min: int = 2,
    t_max: int = 40,
    uniform_frac: float = 0.0,
) -> list[Problem]:
    """``count`` seeded problems. ``uniform_frac`` of them draw ``T`` uniformly from
    ``t_min..t_max`` instead of the heavy-tailed law (the warm start uses this so the model
    has seen long chains)."""
    rng = random.Random(seed)
    out = []
    for pid in range(count):
        if rng.random() < uniform_frac:
            t = rng.randint(t_min, t_max)
        else:
            t = sample_terms(rng, alpha, t_min, t_max)
        k = rng.randint(2, 9)
        n = t * k + rng.randrange(k)
        out.append(Problem(pid, n, k))
    return out


def max_response_tokens(t_max: int = 40) -> int:
    """Tokens a correct response can need (3-digit terms and a comma each, plus EOS)."""
    return 4 * t_max + 1


# Seeds of the fixed data sets: RL training prompts and the held-out evaluation never share a
# seed, and the evaluation set is the same for every run.
TRAIN_SEED = 1234
EVAL_SEED = 999_001
