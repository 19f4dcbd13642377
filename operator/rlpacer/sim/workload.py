"""Scenarios: the response-length workload, the cluster and the non-rollout step costs.

Response lengths (tokens) of response j of prompt p at training progress x in [0, 1]::

    L = min(cap, median_tokens * (1 + drift * x) * exp(d_p + response_sigma * z_pj) * R_pj)
    d_p ~ N(0, prompt_sigma)                      persistent difficulty of prompt p
    R_pj = 1                                      with probability 1 - q_p
         = tail_min * Pareto(tail_alpha)          with probability q_p ("rambling")
    q_p = min(0.5, tail_prob * exp(tail_coupling * d_p))

so a prompt that runs long runs long again (d_p, and hard prompts ramble more often), the
tail is heavy (Pareto), the typical length drifts upward over training, and the cap clips
the rest. The random draws (z, the tail coin, the Pareto variate) come from a per-prompt pool
fixed by the scenario seed, and every policy consumes the pool in the same order (response
j of a prompt's first launch uses pool entry j): policies see the same prompts and the same
responses (common random numbers), so their differences are the scheduling.

The default scenario (``default``) is calibrated to published figures:

* RollPacker (arXiv 2509.21009), Qwen2.5-14B traces: the longest response of a step is 25-32x
  the median, and the P75 length is a few percent of the maximum length (cap 16k here; P75
  about 4-6% of it). With ``tail_prob`` 0.0035 about one response in 150 rambles toward the
  cap, so large steps nearly always contain one and the longest lands at the cap, 25-32x the
  median.
* veRL's breakdown (quoted by RollPacker): rollout is 66-72% of step time. ``train_s_per_ktok``
  and ``sync_s`` are set so the fixed-G=16 baseline spends about 70% of its time in rollout.
* The cluster: 4 rollout engines of the ``gpu`` cost profile (14B, TP2 on H100; see
  rlpacer.sim.cost), 32 prompts per step, prompts of 512 tokens.
* tau = 12 and delta = 0.2, chosen as a user would (ALGORITHMS.md): near the typical
  max/median ratio at G=8, so that p(4) < delta < p(16) and the constraint binds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from rlpacer.sim.cost import CostProfile, profile

_POOL = 64  # response draws per prompt (more than any policy launches per prompt)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    cost_profile: str = "gpu"
    engines: int = 2
    long_round_engines: int | None = None
    """Rollout engines during a long round (None = same as short rounds)."""
    prompts_per_step: int = 32
    steps: int = 200
    """Steps of the fixed-G baseline; the dataset is steps * prompts_per_step prompts."""
    prompt_len: int = 512
    median_tokens: float = 450.0
    drift: float = 0.3
    prompt_sigma: float = 0.45
    response_sigma: float = 0.45
    tail_prob: float = 0.0015
    tail_coupling: float = 1.5
    tail_min: float = 8.0
    tail_alpha: float = 1.1
    cap: int = 16384
    reward_s: float = 2.0
    train_s_per_ktok: float = 0.050
    train_fixed_s: float = 4.0
    sync_s: float = 8.0
    tau: float = 16.0
    tail_tau: float = 2.8
    """tau of SAGC in a tail-batching job: it sees only short rounds, whose tails are cut."""
    delta: float = 0.2
    candidates: tuple[int, ...] = (4, 8, 16)
    initial: int = 8
    forgetting: float = 0.98
    decay_unchosen: bool = False
    dual_step: float = 2.0
    lambda_max: float = 20.0
    window: int = 50
    prompt_overprovision: float = 1.25
    extra_responses: int = 1

    def with_steps(self, steps: int) -> Scenario:
        return replace(self, steps=steps)

    @property
    def cost(self) -> CostProfile:
        return profile(self.cost_profile)

    @property
    def ctx_ref(self) -> float:
        """Typical context length, for the saturation batch (rlpacer.sim.cost)."""
        return self.prompt_len + self.median_tokens * (1 + self.drift / 2)


SCENARIOS: dict[str, Scenario] = {
    "default": Scenario(
        name="default",
        description="14B-like heavy-tailed reasoning workload on 4 H100 TP2 engines (gpu profile)",
    ),
    "cpu": Scenario(
        name="cpu",
        description="the same workload shape at the tiny model's scale on this CPU (cpu profile)",
        cost_profile="cpu",
        engines=1,
        prompts_per_step=16,
        prompt_len=24,
        median_tokens=24.0,
        cap=768,
        reward_s=0.05,
        train_s_per_ktok=0.25,
        train_fixed_s=0.1,
        sync_s=0.06,
    ),
    "light-tail": Scenario(
        name="light-tail",
        description="no rambling tail (max/median about 3): tail batching has little to win",
        tail_prob=0.0,
        prompt_sigma=0.2,
        response_sigma=0.3,
        tau=3.0,
    ),
}


def scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        known = sorted(SCENARIOS)
        raise ValueError(f"unknown scenario {name!r}; expected one of {known}") from None


class Workload:
    """Per-prompt difficulty and response draws of a scenario under a seed."""

    def __init__(self, scn: Scenario, num_prompts: int, seed: int) -> None:
        self.scn = scn
        rng = np.random.Generator(np.random.PCG64([seed, 0x5EED]))
        self.difficulty = rng.normal(0.0, scn.prompt_sigma, size=num_prompts)
        self.z = rng.standard_normal(size=(num_prompts, _POOL))
        self.coin = rng.random(size=(num_prompts, _POOL))
        self.pareto = rng.pareto(scn.tail_alpha, size=(num_prompts, _POOL)) + 1.0
        self.q = np.minimum(0.5, scn.tail_prob * np.exp(scn.tail_coupling * self.difficulty))

    def lengths(self, prompt: int, first: int, count: int, progress: float) -> list[int]:
        """Lengths of responses ``first .. first+count-1`` of ``prompt`` at ``progress``."""
        return self.lengths_many([prompt], [first], count, progress)[0]

    def lengths_many(
        self, prompts: list[int], firsts: list[int], count: int, progress: float
    ) -> list[list[int]]:
        """``lengths`` for many prompts at once (one row per prompt)."""
        s = self.scn
        p = np.asarray(prompts, dtype=np.int64)[:, None]
        idx = (np.asarray(firsts, dtype=np.int64)[:, None] + np.arange(count)) % _POOL
        base = s.median_tokens * (1.0 + s.drift * progress)
        length = base * np.exp(self.difficulty[p] + s.response_sigma * self.z[p, idx])
        ramble = self.coin[p, idx] < self.q[p]
        length = np.where(ramble, length * s.tail_min * self.pareto[p, idx], length)
        out: list[list[int]] = np.clip(np.rint(length), 1, s.cap).astype(np.int64).tolist()
        return out
