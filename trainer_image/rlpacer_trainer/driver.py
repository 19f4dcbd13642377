"""The synchronous on-policy RL loop: plan, roll out (tail batching), score, train, sync, report.

One step = one policy update. Per step:

1. The plan (group size G, round kind) comes from the controller client (in-process or the
   operator's step-report endpoint); while it says ScalingUp the driver polls. The engines
   are fitted to the plan's usable rollout replicas (:meth:`Driver.use_plan`): a long
   round's added replicas get engines on their pods, each serving only once it holds the
   learner's weights; requests are spread over the engines by load.
2. The driver owns the tail-batching planner: ``start_round(G)`` picks the prompts; requests
   go to the engines; each finished response is fed to the planner *in finish order*, and
   whatever it says to abort is aborted on the engines at once. Kept responses are scored as
   they finish (rewards off the critical path). The planner's gate reads the lengths it is
   given with each response: with ``tailBatching.activation: Adaptive`` a short round races
   (over-provisioned, deferring) only while short rounds straggle; otherwise it is a plain
   synchronous round.
3. DAPO dynamic sampling (when on): groups whose rewards are all equal are dropped and, while
   the batch is short of P0 groups, up to ``max_refill_rounds`` more short rounds refill it
   (never a long round: a long round is its own step). Their lengths count in the report.
4. The step's informative groups (rewards not all equal) and its rounds' critical path
   (longest kept response per round, in tokens) feed the planner's long-round yield; a due
   long round whose yield does not pay (``tailBatching.longRound.minYieldRatio``) is retired
   before the report, so the next round is short and nothing scales up for it.
   Group-relative advantages, one policy update, weights pushed to every engine in place.
   After a long round (the next one short) the added engines are released first.
5. The step report (lengths max/median/p90/count/aborted, seconds, long queue, the planner's
   next round kind, mean reward) goes to the controller; its answer is the next plan.

Sampling seeds are derived from (seed, round index, prompt, response index), the planner and
controller are deterministic, and checkpoints hold the learner, optimizer, planner, controller
and RNG state: a resumed run continues with the same rounds and prompts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rlpacer.api import job as job_api
from rlpacer.api import trace as trace_format
from rlpacer.api.protocol import (
    LengthSummary,
    Plan,
    RolloutCapacity,
    RolloutState,
    RoundKind,
    StepReport,
    StepSeconds,
    StragglerRisk,
)
from rlpacer.control.length_prior import LengthPrior
from rlpacer.control.tail_batching import TailBatchingPlanner, ask_early
from rlpacer_trainer import algos
from rlpacer_trainer.engine import EngineInfo, EngineStats, Finished, GenRequest, total_stats
from rlpacer_trainer.learner import Sample
from rlpacer_trainer.learners import driver_rng_state, set_driver_rng_state
from rlpacer_trainer.rewards import RewardCall, RewardPool, RewardStats

#: How often a long round with ``joinMidRound`` reads the plan for replicas now usable.
MID_ROUND_POLL_S = 1.0


def sample_seed(seed: int, round_index: int, prompt: int, idx: int) -> int:
    h = hashlib.blake2b(f"{seed}/{round_index}/{prompt}/{idx}".encode(), digest_size=4)
    return int.from_bytes(h.digest(), "little")


def length_summary(lengths: Sequence[int], aborted: int) -> LengthSummary:
    if not lengths:
        return LengthSummary(max=1, median=1, p90=1, count=0, aborted=aborted)
    s = sorted(lengths)
    p90 = s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]
    return LengthSummary(max=s[-1], median=float(statistics.median(s)), p90=float(p90),
                         count=len(s), aborted=aborted, mean=math.fsum(s) / len(s))


def reward_metrics(d: RewardStats) -> dict[str, Any]:
    """A step's reward-pool fields of the metrics record (docs/metrics.md, "The per-step
    record")."""
    return {"reward_calls": d.calls, "reward_timeouts": d.timeouts,
            "reward_crashes": d.crashes, "reward_errors": d.errors,
            "reward_busy_s": d.busy_s, "reward_worker_restarts": d.restarts}


@dataclasses.dataclass
class Kept:
    prompt: int
    idx: int
    tokens: tuple[int, ...]
    finish_reason: str
    reward: float = 0.0


@dataclasses.dataclass
class StepStream:
    """A step's groups handed to the learner as they finish (``spec.trainer.streamTraining``):
    each complete group, once its rewards are in, in the order the step's batch will hold it
    (its rounds in order, each round's groups in the order they completed), with the
    positions its samples will have there; a group DAPO's dynamic sampling drops takes none."""

    done: list[tuple[int, int, list[Kept]]] = dataclasses.field(default_factory=list)
    """Complete groups not yet handed over: (round index, prompt, kept responses)."""
    scores: dict[Any, float] = dataclasses.field(default_factory=dict)
    submitted: set[Any] = dataclasses.field(default_factory=set)  # reward keys sent to score
    next_pos: int = 0  # the batch position of the next sample handed over
    in_rollout: int = 0  # samples handed over while a round was still generating
    batch_tokens: int = 0
    """Padded tokens (sequences x the longest) to gather before handing a part over: the
    learner's micro-batch budget, so that its passes are as large as the whole step's (0:
    each group at once)."""
    buffer: list[tuple[Sample, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RoundOutcome:
    kind: RoundKind
    kept: dict[int, list[Kept]]
    aborted: int
    rollout_s: float
    overprovisioned: bool = False  # a short round that raced (the planner's gate was on)
    routed: int = 0  # fresh prompts the length prior sent straight to the long queue
    kept_near_cap: bool = False  # it reached the cap and kept every prompt it launched


class EngineDied(RuntimeError):
    """An engine's process is gone (on Ray: its actor died, e.g. with its pod)."""


def _died_errors() -> tuple[type[BaseException], ...]:
    """The errors that mean "this engine is gone" (not a bug in the request)."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover - ray is a dependency of the trainer image
        return (EngineDied,)
    return (EngineDied, RayActorError)


class Driver:
    """Runs steps; see the module docstring."""

    def __init__(
        self,
        *,
        cfg: Any,  # RunConfig
        controller: Any,  # ControllerClient
        engines: Sequence[Any],
        learner: Any,  # learners.InProcessLearners | learners.RayLearners
        planner: TailBatchingPlanner,
        attempt: int = 0,
        checkpoint_dir: Path | None = None,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        engine_factory: Callable[[int], Any] | None = None,
        offered_replicas: Callable[[], set[int]] | None = None,
        join_wait_s: float = 60.0,
    ) -> None:
        self.cfg = cfg
        self.controller = controller
        #: whether :meth:`close` shuts the learner down (the one ``build_driver`` made here; a
        #: caller's learners outlive the driver)
        self.owns_learner = False
        #: live engines by rollout replica index (each as it reports itself)
        self.pool: dict[int, Any] = {}
        for e in engines:
            self.pool[int(e.info().replica)] = e
        #: the start-up replicas (``spec.rollout.replicas``): kept across rounds; the others
        #: (a long round's) are released before the report that lets the operator scale down
        self.base_replicas: frozenset[int] = frozenset(self.pool)
        self.active: list[int] = sorted(self.pool)  # the replicas the current round uses
        #: long rounds on wide engines of their own, short rounds on the rollout's
        self.wide_long_rounds = job_api.wide_long_rounds(cfg.spec)
        #: tailBatching.longRound.joinMidRound: a long round starts on what serves; the
        #: extras join during it and take a share of its unfinished requests
        self.join_mid_round = cfg.join_mid_round
        self._mid_round = False  # the current round takes engines that join during it
        self._mid_usable: list[int] = []  # the replicas the plan last named usable
        self._mid_polled = 0.0  # when the plan was last read during the round
        self._round_t0 = 0.0
        self._moved = 0  # the step's requests moved to an engine that joined mid-round
        self._moved_tokens = 0  # the tokens they carried (generated before the move)
        self._joined_mid: list[list[float]] = []  # [replica, seconds into its round]
        #: tailBatching.longRound.releaseWhenFits: a long round's added engines go (and the
        #: operator is told) once its unfinished requests fit on the rollout's own engines
        self.release_when_fits = cfg.release_when_fits
        self._start_load = 0  # requests an engine of the round began it with, at most
        self._released_mid: list[float] = []  # [seconds into the round, replicas released]
        self._fill: set[int] = set()  # the round's fill prompts (longRound.fillPrompts)
        #: a filled long round on wide engines: its fill runs on the rollout's own engines
        self._side_fill = False
        #: starts the engine of replica i (on its pod); None: the engine set never changes
        self.engine_factory = engine_factory
        #: the replicas whose pods have joined the Ray cluster (their resource is offered)
        self.offered_replicas = offered_replicas
        self.join_wait_s = join_wait_s
        self._retired: list[EngineStats] = []  # last stats of released or dead engines
        self._requests: dict[str, GenRequest] = {}  # this round's requests (re-dispatch)
        self.events: list[tuple[str, int]] = []  # (joined|released|died, replica), in order
        self._stats_before: dict[int, EngineStats] = {}  # each engine's at the step's start
        self._died_served: list[dict[str, Any]] = []  # the step's engines that died in it
        self.learner = learner
        self.planner = planner
        self.attempt = attempt
        self.checkpoint_dir = checkpoint_dir
        self.on_step = on_step
        self.problems = cfg.problems()
        self.tok = cfg.tokenizer()  # the model's: prompts in, responses out
        self.step = 0
        self.records: list[dict[str, Any]] = []
        #: reward worker processes, started once (spec.reward; rewards.py)
        self.scorer = RewardPool.from_spec(cfg.spec.reward)
        self.rollout_wall = 0.0  # wall time inside rollouts (engine busy fraction's base)
        self._pending: dict[str, tuple[int, int, int]] = {}  # request id -> replica, prompt, idx
        self._served: dict[int, int] = {}  # responses each replica's engine finished this step
        self.policy_version: str | None = None  # the learner's, as last pushed to the engines
        # "store": Ray's object store (CPU, and GPU by default); "nccl": learner rank 0
        # broadcasts to the engines' workers (RLPACER_WEIGHT_TRANSPORT=nccl; unverified)
        self.weight_transport = "store"
        #: per-prompt length prior: every trained group's lengths (rlpacer.control.length_prior);
        #: its uses (routing, dispatch) only as the spec's tailBatching.lengthPrior says
        self.prior = LengthPrior(planner.num_prompts, half_life=cfg.length_half_life)
        self.routed_total = 0
        self._trace: Any = None  # the open response trace (record_trace), or None
        self._trace_t0 = time.perf_counter()
        # Early scale-up (tailBatching.longRound.scaleUpLeadSeconds; the module doc): the lead
        # in use is the spec's until a scale-up is measured (request to added engines serving)
        self.lead_s = float(cfg.scale_up_lead_s)  # 0: no early scale-up
        self.lead_measured: float | None = None
        self.long_replicas = int(cfg.spec.tail_batching.long_round.rollout_replicas)
        self._asked_at: float | None = None  # when the reports began asking for the extras
        self._lead_done = False  # this ask's lead measured
        self._asked_early = False  # the last report asked ahead of a long round
        self._joining: dict[int, Any] = {}  # replica -> the Future of its engine's start
        self._join_threads: Any = None  # a ThreadPoolExecutor, made at the first use
        self._joined_at: dict[int, float] = {}  # added engines serving, not yet used
        self._last_join = 0.0  # when the latest added engine began serving
        self._short_s: list[float] = []  # the last short steps' seconds
        self._ready_wait_s = 0.0  # the step's wait for a scale-up (wait_ready)
        self._extra_idle_s = 0.0  # the step's added engines' seconds between joining and use
        # Deferred long rounds (tailBatching.longRound.maxDeferredRounds): short rounds run in
        # a due long round's place while its extra replicas are not ready
        self.max_deferrals = cfg.max_deferred_rounds
        self._deferrals = 0  # in this wait (0 again once a long round runs)
        self._deferring = False  # the coming round is one of them
        #: the step's groups streamed to the learner as they finish (spec.trainer.streamTraining)
        self._stream: StepStream | None = None

    # --- the response trace -----------------------------------------------------------------
    def record_trace(self, path: Path) -> None:
        """From now on, every response of every round goes to ``path`` (JSON lines, the
        format of ``rlpacer.api.trace``; a new file starts with its header, an existing one is
        appended to). Times are seconds since this call."""
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists() or path.stat().st_size == 0
        self._trace = path.open("a", encoding="utf-8")
        self._trace_t0 = time.perf_counter()
        if new:
            self._trace.write(trace_format.header(
                max_tokens=int(self.cfg.max_tokens), prompts=int(self.planner.num_prompts),
                prompts_per_step=int(self.cfg.spec.prompts_per_step),
                seed=int(self.cfg.data_seed)) + "\n")
            self._trace.flush()

    def _write_trace(self, plan: Any, prompt_tokens: dict[int, int],
                     rows: dict[tuple[int, int], tuple[int | None, int | None, float, str]],
                     kept: dict[int, list[int]], t0: float) -> None:
        kind = plan.kind.value.lower()
        lines = []
        for (p, i), (engine, length, finish, outcome) in sorted(rows.items()):
            if outcome == "kept" and i not in kept.get(p, ()):
                outcome = "discarded"  # finished early, but its prompt was deferred
            lines.append(trace_format.ResponseRecord(
                attempt=self.attempt, step=self.step, round=plan.index, kind=kind,
                epoch=plan.epoch, prompt=p, index=i, engine=engine,
                prompt_tokens=prompt_tokens[p], length=length,
                start_s=t0 - self._trace_t0, finish_s=finish - self._trace_t0,
                outcome=outcome).to_json())
        self._trace.write("\n".join(lines) + "\n")
        self._trace.flush()

    # --- rewards -----------------------------------------------------------------------------
    def _submit_reward(self, key: tuple[int, int, int], f: Finished, pid: int) -> None:
        """Scores a finished response in the pool (a truncated one is not scored: 0.0)."""
        if f.finish_reason == "stop":
            self.scorer.submit(key, RewardCall.of(self.tok.decode(f.token_ids),
                                                  self.problems[pid]))
            if self._stream is not None:
                self._stream.submitted.add(key)

    def _pump_stream(self, *, final: bool = False, in_rollout: bool = False) -> None:
        """Hands the learner every complete group whose rewards are in, in batch order
        (``final``: the rest of them, a reward never asked for counting 0 as in the step)."""
        st = self._stream
        if st is None:
            return
        if not final:
            st.scores.update(self.scorer.take_ready())  # run_step reads them there too
        while st.done:
            rnd, p, ks = st.done[0]
            keys = [(rnd, p, k.idx) for k in ks]
            if not final and any(key in st.submitted and key not in st.scores for key in keys):
                return  # the next group's rewards are not all in: the order waits for it
            st.done.pop(0)
            rewards = [self._shaped(st.scores.get(key, 0.0), k) for key, k in zip(
                keys, ks, strict=True)]
            if self.cfg.dynamic_sampling and not algos.informative_groups([rewards]):
                continue  # dropped from the batch: no position
            (adv,) = algos.ragged_group_advantages([rewards])
            prompt = self.tok.prompt_ids(self.problems[p].prompt)
            samples = [Sample(prompt, list(k.tokens), float(a))
                       for k, a in zip(ks, adv, strict=True)]
            st.buffer += [(x, st.next_pos + j) for j, x in enumerate(samples)]
            st.next_pos += len(samples)
            width = max(len(x.prompt_ids) + len(x.response_ids) for x, _ in st.buffer)
            if len(st.buffer) * width >= st.batch_tokens:
                self._hand_over(in_rollout=in_rollout)
        if final:
            self._hand_over(in_rollout=in_rollout)

    def _stream_scores(self, got: dict[Any, float]) -> None:
        """Scores that finished while the driver waited for a round's last ones."""
        if self._stream is not None:
            self._stream.scores.update(got)
            self._pump_stream()

    def _hand_over(self, *, in_rollout: bool) -> None:
        st = self._stream
        if st is None or not st.buffer:
            return
        samples, positions = [x for x, _ in st.buffer], [pos for _, pos in st.buffer]
        st.buffer = []
        if in_rollout:
            st.in_rollout += len(samples)
        self.learner.stream_add(samples, positions)

    def _shaped(self, score: float, k: Kept) -> float:
        """The reward a kept response trains with: its score plus overlong shaping."""
        if self.cfg.overlong_buffer:
            score += self.cfg.overlong_scale * algos.overlong_penalty(
                len(k.tokens), max_tokens=self.cfg.max_tokens,
                buffer_tokens=self.cfg.overlong_buffer)
        return score

    def close(self) -> None:
        """Stops the reward workers (they also exit with this process); closes the trace;
        shuts down a learner this driver owns (a sharded one leaves its process group)."""
        self.scorer.close()
        self._abandon_starts()
        if self._join_threads is not None:
            self._join_threads.shutdown(wait=False, cancel_futures=True)
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        if self.owns_learner:
            self.owns_learner = False
            self.learner.shutdown()

    # --- one round ----------------------------------------------------------------------------
    def _route(self, prompt: int) -> bool:
        """``tailBatching.lengthPrior.route``: a fresh prompt seen in an earlier epoch whose
        predicted length ranks at or above the quantile goes straight to a long round."""
        q = self.cfg.route_quantile
        return (q is not None and self.prior.predict(prompt).seen > 0
                and self.prior.level_rank(prompt) >= q)

    def next_straggler_risk(self) -> list[StragglerRisk] | None:
        """``tailBatching.lengthPrior.context``: the next round's predicted straggler
        probability per candidate G, from the prompts the planner will launch (None: the use
        is off, the run is over, or the prior has seen nothing yet). Deterministic in the
        step (the Monte Carlo's seed), so a resumed run reports what the straight run did."""
        if not self.cfg.length_context or self.planner.done:
            return None
        route = self._route if self.cfg.route_quantile is not None else None
        nxt = self.planner.peek_round(route=route)
        gc = self.cfg.spec.group_control
        risk = self.prior.straggler_risk(
            nxt.prompts, [int(g) for g in gc.candidates], float(gc.straggler_ratio),
            extra=nxt.extra_responses, target=nxt.target_prompts, cap=self.cfg.max_tokens,
            seed=self.step)
        return [StragglerRisk(group_size=g, probability=p) for g, p in sorted(risk.items())] or None

    def run_round(self, group_size: int) -> RoundOutcome:
        route = self._route if self.cfg.route_quantile is not None else None
        plan = self.planner.start_round(group_size, route=route)
        self._fill = set(plan.fill)  # a filled long round's fresh prompts
        # a filled long round on wide long-round engines: its queued prompts on the wide
        # engines, its fill on the rollout's own, which would otherwise wait through it
        # (_engines_for; rlpacer bench --side-fill models it)
        self._side_fill = bool(self.wide_long_rounds and plan.kind is RoundKind.LONG
                               and plan.fill)
        if self._side_fill:
            self.active = sorted(set(self.active)
                                 | {r for r in self.pool if r in self.base_replicas})
        def rid(p: int, i: int) -> str:
            return f"r{plan.index}-p{p}-i{i}"

        self._pending.clear()
        self._requests.clear()
        reqs: list[tuple[GenRequest, int, int]] = []
        prompt_tokens: dict[int, int] = {}
        # the response trace: (prompt, index) -> (engine, length, seen at, outcome)
        rows: dict[tuple[int, int], tuple[int | None, int | None, float, str]] = {}
        for p in plan.prompts:
            ids = tuple(self.tok.prompt_ids(self.problems[p].prompt))
            prompt_tokens[p] = len(ids)
            for i in range(plan.responses_per_prompt):
                reqs.append((GenRequest(
                    rid(p, i), ids, self.cfg.max_tokens, self.cfg.temperature,
                    sample_seed(self.cfg.data_seed, plan.index, p, i),
                    top_p=self.cfg.top_p), p, i))
        t0 = self._round_t0 = time.perf_counter()
        self._mid_round = (self.join_mid_round and plan.kind is RoundKind.LONG
                           and self.engine_factory is not None)
        self._mid_polled = t0
        self._start_load = -(-len(reqs) // max(1, len(self.active)))
        self._dispatch(reqs)
        kept: dict[int, list[Kept]] = {}
        aborted = 0
        complete = False
        while not complete:
            busy = sorted({e for e, _, _ in self._pending.values()})
            if not busy:
                break
            finished, dead = self._poll(busy)
            for f in finished:
                if f.request_id not in self._pending:
                    continue  # aborted while this batch was in flight
                e, p, i = self._pending.pop(f.request_id)
                self._served[e] = self._served.get(e, 0) + 1
                d = self.planner.on_response_finished(p, i, len(f.token_ids))
                rows[(p, i)] = (e, len(f.token_ids), time.perf_counter(),
                                "kept" if d.keep else "discarded")
                if d.keep:
                    k = Kept(p, i, f.token_ids, f.finish_reason)
                    kept.setdefault(p, []).append(k)
                    self._submit_reward((plan.index, p, i), f, p)
                    if self._stream is not None and len(kept[p]) == plan.keep_per_prompt:
                        self._stream.done.append((plan.index, p, kept[p]))  # complete
                to_abort = [(q, j) for q in d.abort_prompts for j in
                            range(plan.responses_per_prompt)] + list(d.abort_responses)
                if d.round_complete:
                    to_abort += [(q, j) for (_, q, j) in self._pending.values()]
                now, deferred = time.perf_counter(), set(d.abort_prompts)
                for q, j in to_abort:
                    if rid(q, j) in self._pending:
                        rows[(q, j)] = (self._pending[rid(q, j)][0], None, now,
                                        "deferred" if q in deferred else "aborted")
                aborted += self._abort(rid, to_abort)
                if d.round_complete:
                    complete = True
                    break
            for r in dead:
                self._engine_died(r)
            if self._mid_round and not complete and self._pending:
                self._grow_mid_round()
            if (self.release_when_fits and plan.kind is RoundKind.LONG and not complete
                    and self._pending):
                self._release_if_fits()
            if self._stream is not None and not complete:
                self._pump_stream(in_rollout=True)
        rollout_s = time.perf_counter() - t0
        self.rollout_wall += rollout_s
        self._mid_round = False
        res = self.planner.finish_round()
        if self._trace is not None:
            self._write_trace(plan, prompt_tokens, rows, res.kept, t0)
        self.routed_total += len(res.routed)
        by_prompt: dict[int, list[int]] = {}  # the round's finished lengths by prompt
        for (q, _), (_, length, _, _) in rows.items():
            if length is not None:
                by_prompt.setdefault(q, []).append(length)
        for p in res.kept:  # the prior learns each trained group: finished lengths, censored
            done = by_prompt.get(p, [])
            self.prior.observe(p, done, censored=plan.responses_per_prompt - len(done))
        out = {p: [k for k in kept[p] if k.idx in set(idxs)] for p, idxs in res.kept.items()}
        return RoundOutcome(res.kind, out, res.aborted_responses, rollout_s,
                            res.overprovisioned, len(res.routed), res.kept_near_cap)

    def _engines_for(self, p: int) -> list[int]:
        """The round's engines that may serve prompt p: all of them, but in a filled long
        round on wide engines (``_side_fill``) the fill goes to the rollout's own engines and
        the queued prompts to the wide ones, each class falling back to every engine of the
        round while none of its own is live."""
        if not self._side_fill:
            return self.active
        own = p in self._fill
        return [r for r in self.active if (r in self.base_replicas) == own] or self.active

    def _dispatch(self, reqs: Sequence[tuple[GenRequest, int, int]]) -> None:
        """Spreads requests over the round's engines by load: each goes to the engine with
        the fewest outstanding requests (then the fewest outstanding prompt tokens, then the
        lowest replica) among those that may serve its prompt (:meth:`_engines_for`),
        counting what it already has in flight. With
        ``tailBatching.lengthPrior.dispatch``: the longest predicted first, each to the engine
        with the fewest predicted tokens outstanding (the length prior's median per prompt)."""
        by_length = bool(self.cfg.length_dispatch)
        predicted: dict[int, float] = {}

        def guess(p: int) -> float:
            if p not in predicted:
                predicted[p] = math.exp(self.prior.predict(p).level) if by_length else 0.0
            return predicted[p]

        if by_length:
            reqs = sorted(reqs, key=lambda x: -guess(x[1]))
        while True:
            if not self.active:
                raise RuntimeError("no rollout engine left to serve the round")
            load: dict[int, list[float]] = {r: [0.0, 0, 0] for r in self.active}
            for rid_, (e, p_, _) in self._pending.items():
                if e in load:
                    load[e][0] += guess(p_)
                    load[e][1] += 1
                    load[e][2] += len(self._requests[rid_].prompt_ids)
            batches: dict[int, list[GenRequest]] = {}
            for req, p, i in reqs:
                e = min(self._engines_for(p),
                        key=lambda r: (load[r][0], load[r][1], load[r][2], r))
                load[e][0] += guess(p)
                load[e][1] += 1
                load[e][2] += len(req.prompt_ids)
                batches.setdefault(e, []).append(req)
                self._pending[req.request_id] = (e, p, i)
                self._requests[req.request_id] = req
            dead = []
            for e, batch in batches.items():
                try:
                    self.pool[e].submit(batch)
                except _died_errors():
                    dead.append(e)
            if not dead:
                return
            # their requests (this batch and any before) go to the engines still alive
            reqs = [(self._requests[r], p, i) for r, (e, p, i) in self._pending.items()
                    if e in dead]
            for e in dead:
                self._forget(e, "died")
            for req, _, _ in reqs:
                del self._pending[req.request_id]

    def _grow_mid_round(self) -> None:
        """During a long round with ``joinMidRound``: reads the plan for the replicas now
        usable (at most every :data:`MID_ROUND_POLL_S`), starts their engines in the
        background once their pods are in Ray, and lets each engine that is up (holding the
        learner's weights, which the round generates at) take a share of the round's
        unfinished requests (:meth:`_rebalance`)."""
        now = time.perf_counter()
        if now - self._mid_polled >= MID_ROUND_POLL_S:
            self._mid_polled = now
            try:
                cap = self.controller.plan().rollout
            except Exception as err:  # a blip: the round goes on with what serves
                print(f"reading the plan mid-round failed ({err}); the round goes on",
                      flush=True)
                cap = None
            if cap is not None:
                self._mid_usable = self._usable(cap)
                missing = [r for r in self._mid_usable
                           if r not in self.pool and r not in self._joining]
                if missing:
                    self._start_in_background(missing)
        if not self._joining:
            return
        before = set(self.pool)
        self._admit_started(self._mid_usable, wait=False)
        new = sorted(r for r in self.pool if r not in before)
        if new:
            t = time.perf_counter() - self._round_t0
            self._joined_mid += [[r, round(t, 3)] for r in new]
            wide = self.wide_long_rounds and not set(new) & self.base_replicas
            if wide and not self._side_fill:
                # the long round belongs to the wide engines: all of it goes to them
                self.active = sorted(r for r in set(self.active) | set(new)
                                     if r not in self.base_replicas)
            else:
                self.active = sorted(set(self.active) | set(new))
            self._rebalance(new, everything=wide)
            # the load an engine holds from here: what releaseWhenFits measures the rest by
            self._start_load = -(-len(self._pending) // max(1, len(self.active)))

    def _release_if_fits(self) -> None:
        """``releaseWhenFits``: once the long round's unfinished requests fit on the
        rollout's own engines at the load each engine began the round with (so no engine's
        batch grows past its start), and the next round is not another long one: the added
        engines' unfinished requests move to the rollout's engines with their tokens, the
        added engines are shut down, and the operator is asked to scale the rollout back now
        (``POST release``) instead of at the step's report."""
        if self.wide_long_rounds:
            return  # a wide engine is there for the round's tail: it stays to its end
        extras = [r for r in sorted(self.pool) if r not in self.base_replicas]
        base = [r for r in sorted(self.pool) if r in self.base_replicas]
        if (not extras or not base or self._joining or self.planner.long_round_follows()
                or len(self._pending) > self._start_load * len(base)):
            return
        load = {r: 0 for r in base}
        for e, _, _ in self._pending.values():
            if e in load:
                load[e] += 1

        def least_loaded(_: str) -> int:
            dest = min(base, key=lambda r: (load[r], r))
            load[dest] += 1
            return dest

        batches, _ = self._take_moves(
            {e: [rid_ for rid_, (x, _, _) in self._pending.items() if x == e] for e in extras},
            least_loaded)
        moved = sum(len(b) for b in batches.values())
        gone = []
        for e in extras:
            if e not in self.pool:
                continue
            entry = self._gone_entry(e)
            self._forget(e, "released")
            self._died_served.append(entry)
            gone.append(e)
        self.active = base
        # no engine joins this round again (an operator that did not take the release
        # still names the replicas usable)
        self._mid_round = False
        self._submit_moved(batches)
        t = time.perf_counter() - self._round_t0
        self._released_mid = [round(t, 3), *gone]
        told = self.controller.release(self.attempt, self.step)
        print(f"step {self.step}'s long round fits on the rollout's own replicas"
              f" ({len(self._pending)} requests unfinished): replica(s) {gone} released"
              f" {t:.1f}s into the round, {moved} requests moved back with their tokens;"
              f" the operator {'scales back now' if told else 'scales back at the report'}",
              flush=True)

    def _gone_entry(self, r: int) -> dict[str, Any]:
        """The metrics record's entry of replica r's engine, which leaves mid-step: what it
        served of the step so far (its own report)."""
        eng = self.pool[r]
        info, st = eng.info(), eng.stats()
        before = self._stats_before.get(r)
        return {"replica": r, "address": info.address, "hostname": info.hostname,
                "netns": info.netns, "responses": self._served.get(r, 0),
                "tokens": st.tokens - (before.tokens if before else 0),
                "policy_version": info.policy_version, "released": True}

    def _rebalance(self, new: Sequence[int], *, everything: bool = False) -> None:
        """Moves unfinished requests from the engines already serving the round to the ones
        in ``new``, as the simulator's join does (``rlpacer.sim.rollout``): each new engine
        takes the unfinished requests over the round's engines (rounded down), each from
        the engine then holding the most, its latest dispatched first (vLLM admits first
        come, first served, so those are the likeliest not to have started); with
        ``everything`` all of them (a wide long-round engine joining a long round begun on
        the rollout's engines; all but the fill's in a filled one, which stays on the
        rollout's engines, :meth:`_engines_for`). Each is taken with its tokens so far
        (:meth:`VLLMEngine.take`) and sent on with them as its prefix: the new engine
        continues the response; nothing is generated twice or lost (a request the old
        engine finished before the take stays its response)."""
        by_engine: dict[int, list[str]] = {}
        for rid_, (e, p, _) in self._pending.items():
            if everything and self._side_fill and p in self._fill:
                continue  # the fill stays on the rollout's engines
            by_engine.setdefault(e, []).append(rid_)
        old = [e for e in sorted(by_engine) if e not in new and hasattr(self.pool.get(e), "take")]
        # each new engine's quota, as the simulator's join (rlpacer.sim.rollout): the
        # unfinished requests over the engines, rounded down; each one from the engine that
        # then holds the most (the lowest replica of a tie), its latest dispatched first
        quota = (sum(len(v) for v in by_engine.values()) if everything
                 else len(self._pending) // max(1, len(set(self.active) | set(new))))
        moves: dict[int, list[str]] = {}
        plan: list[tuple[str, int]] = []  # (request, its new engine)
        for dest in new:
            for _ in range(quota):
                if not old:
                    break
                e = max(old, key=lambda x: (len(by_engine[x]), -x))
                if not by_engine[e]:
                    break
                rid_ = by_engine[e].pop()
                moves.setdefault(e, []).append(rid_)
                plan.append((rid_, dest))
        batches, tokens = self._take_moves(moves, dict(plan).__getitem__)
        self._moved += sum(len(b) for b in batches.values())
        self._moved_tokens += tokens
        self._submit_moved(batches)
        if batches:
            print(f"mid-round join of replica(s) {list(new)}: "
                  f"{sum(len(b) for b in batches.values())} unfinished requests moved to them"
                  " with their tokens", flush=True)

    def _take_moves(self, moves: dict[int, list[str]], dest_for: Callable[[str], int]
                    ) -> tuple[dict[int, list[GenRequest]], int]:
        """Takes the unfinished requests ``moves`` (engine -> request ids) from their
        engines with their tokens so far (:meth:`VLLMEngine.take`) and readies each, its
        tokens as its prefix, for ``dest_for(request)`` (called once per request taken, in
        order): the destination engine continues the response, nothing generated twice. A
        request its engine finished before the take stays that engine's response; an engine
        that dies on the take is handled as any engine death (its requests go to the live
        engines as they are). Returns the requests to submit by engine
        (:meth:`_submit_moved`) and the tokens they carry beyond their earlier prefixes."""
        batches: dict[int, list[GenRequest]] = {}
        tokens = 0
        for e, ids in moves.items():
            try:
                taken = self.pool[e].take(ids) if ids else {}
            except _died_errors():
                self._engine_died(e)
                continue
            for rid_ in ids:
                if rid_ not in taken:
                    continue  # it finished there first: its response comes from there
                _, p, i = self._pending[rid_]
                dest = dest_for(rid_)
                tokens += len(taken[rid_]) - len(self._requests[rid_].prefix)
                req = dataclasses.replace(self._requests[rid_], prefix=tuple(taken[rid_]))
                self._requests[rid_] = req
                self._pending[rid_] = (dest, p, i)
                batches.setdefault(dest, []).append(req)
        return batches, tokens

    def _submit_moved(self, batches: dict[int, list[GenRequest]]) -> None:
        """Submits requests readied by :meth:`_take_moves` to their new engines; an engine
        that dies on the submit is handled as any engine death (its requests, prefixes and
        all, go elsewhere)."""
        for dest, batch in batches.items():
            try:
                self.pool[dest].submit(batch)
            except _died_errors():
                self._engine_died(dest)

    def _poll(self, busy: Sequence[int]) -> tuple[list[Finished], list[int]]:
        """Polls the busy engines (Ray engines in parallel); also names those that died."""
        out: list[Finished] = []
        dead: list[int] = []
        if busy and hasattr(self.pool[busy[0]], "poll_async"):
            import ray

            refs = {r: self.pool[r].poll_async() for r in busy}
            for r, ref in refs.items():
                try:
                    out.extend(ray.get(ref))
                except _died_errors():
                    dead.append(r)
            return out, dead
        for r in busy:
            try:
                out.extend(self.pool[r].poll())
            except _died_errors():
                dead.append(r)
        return out, dead

    def _forget(self, r: int, why: str) -> None:
        """Drops replica r's engine (released or dead); its counters stay in the totals."""
        eng = self.pool.pop(r, None)
        if r in self.active:
            self.active.remove(r)
        self.events.append((why, r))
        last = self._stats_before.get(r)
        if eng is not None and why == "released":
            try:
                last = dataclasses.replace(eng.stats())
            finally:
                if hasattr(eng, "shutdown"):
                    eng.shutdown()
        if last is not None:
            self._retired.append(last)
        if why == "died":
            # what it answered before it died was kept; its host is gone with it
            self._died_served.append({"replica": r, "responses": self._served.get(r, 0),
                                      "died": True})
        print(f"rollout engine of replica {r} {why}", flush=True)

    def _engine_died(self, r: int) -> None:
        """Replica r's engine is gone mid-round: its unfinished requests go to the others
        (same seeds, so the same responses); nothing it answered is counted twice. Its
        engine is started again once its replica is usable and its pod offered again."""
        if r not in self.pool:
            return
        lost = [(self._requests[rid_], p, i) for rid_, (e, p, i) in self._pending.items()
                if e == r]
        self._forget(r, "died")
        if self._died_served and self._died_served[-1]["replica"] == r:
            self._died_served[-1]["redispatched"] = len(lost)
        for req, _, _ in lost:
            del self._pending[req.request_id]
        if lost:
            print(f"rollout replica {r}: {len(lost)} unfinished requests re-dispatched",
                  flush=True)
            self._dispatch(lost)

    def _abort(self, rid: Callable[[int, int], str], pairs: Sequence[tuple[int, int]]) -> int:
        by_engine: dict[int, list[str]] = {}
        for p, i in pairs:
            r = rid(p, i)
            if r in self._pending:
                e, _, _ = self._pending.pop(r)
                by_engine.setdefault(e, []).append(r)
        for e, ids in by_engine.items():
            if e in self.pool:
                try:
                    self.pool[e].abort(ids)
                except _died_errors():
                    self._engine_died(e)
        return sum(len(v) for v in by_engine.values())

    # --- one step -----------------------------------------------------------------------------
    def long_round_mini_batches(self, kind: RoundKind) -> int | None:
        """The optimizer steps of the update after a round of ``kind`` that starts now: a long
        round of more than promptsPerStep prompts (``tailBatching.longRound.prompts``, and
        its ``fillPrompts`` as launched) trains in as many as its prompts would take in steps
        of promptsPerStep, ceil(prompts / P0) x the learner's mini-batches, so a prompt gets
        as many updates whichever round it runs in. None (the learner's own count) for every
        other round."""
        if kind is not RoundKind.LONG:
            return None
        prompts = len(self.planner.peek_round().prompts)
        steps = math.ceil(prompts / int(self.cfg.spec.prompts_per_step))
        if steps <= 1:
            return None
        return steps * int(self.cfg.learner_config().mini_batches)

    def run_step(self, plan: Plan) -> dict[str, Any]:
        g = plan.group_size
        p0 = int(self.cfg.spec.prompts_per_step)
        kind = self.planner.next_round_kind
        groups: dict[tuple[int, int], list[Kept]] = {}
        lengths: list[int] = []
        aborted = 0
        rollout_s = reward_s = 0.0
        path_tokens = 0  # each round's longest kept response: its decode steps, summed
        dropped = refills = routed = near_cap = 0
        overprovisioned = False  # any of the step's rounds raced (tail batching's gate on)
        rewards_all: list[float] = []
        deferring, self._deferring = self._deferring, False
        if ((self._asked_early or deferring) and kind is RoundKind.SHORT
                and self.engine_factory is not None):
            # the capacity asked ahead: which added replicas are ready now (not at the report)
            plan = plan.model_copy(update={"rollout": self.controller.plan().rollout})
        t_join = time.perf_counter()
        used = self.use_plan(plan, kind, background=deferring)
        join_s = time.perf_counter() - t_join  # engines started for this round, if any
        self._served = {}
        self._moved = self._moved_tokens = 0
        self._joined_mid = []
        self._released_mid = []
        self._died_served = []
        self._stats_before = stats_before = self._engine_stats()
        reward_before = self.scorer.stats
        self._stream = None
        mini_batches = self.long_round_mini_batches(kind)
        if self.cfg.stream_training and self.learner.stream_begin(mini_batches):
            self._stream = StepStream(
                batch_tokens=int(self.cfg.learner_config().micro_batch_tokens))
        while True:
            rnd = self.run_round(g)
            if self._side_fill:  # the rollout's engines ran the fill beside the wide ones
                used = sorted(set(used) | set(self.active))
            rollout_s += rnd.rollout_s
            path_tokens += max((len(k.tokens) for ks in rnd.kept.values() for k in ks),
                               default=0)
            aborted += rnd.aborted
            routed += rnd.routed
            near_cap += rnd.kept_near_cap
            overprovisioned = overprovisioned or rnd.overprovisioned
            # streaming: the groups whose rewards come in while the driver waits for the
            # rest go to the learner then, not after
            scores, waited = self.scorer.collect(
                None if self._stream is None else self._stream_scores)
            if self._stream is not None:  # with those the stream took first
                self._stream.scores.update(scores)
                scores = self._stream.scores
                self._pump_stream(final=True)
            reward_s += waited
            for p, ks in rnd.kept.items():
                for k in ks:
                    k.reward = self._shaped(
                        scores.get((self.planner.rounds - 1, p, k.idx), 0.0), k)
                    lengths.append(len(k.tokens))
                    rewards_all.append(k.reward)
                groups[(self.planner.rounds - 1, p)] = ks
            if not self.cfg.dynamic_sampling:
                break
            informative = algos.informative_groups([[k.reward for k in ks]
                                                    for ks in groups.values()])
            if (len(informative) >= p0 or refills >= self.cfg.max_refill_rounds
                    or self.planner.done or rnd.kind is RoundKind.LONG
                    or self.planner.next_round_kind is RoundKind.LONG):
                break
            refills += 1
        keys = keys_all = list(groups)
        group_rewards = [[k.reward for k in groups[key]] for key in keys]
        informative = algos.informative_groups(group_rewards)  # before any is dropped
        if self.cfg.dynamic_sampling:
            keep_idx = algos.informative_groups(group_rewards)
            dropped = len(keys) - len(keep_idx)
            keys = [keys[i] for i in keep_idx]
            group_rewards = [group_rewards[i] for i in keep_idx]
        advs = algos.ragged_group_advantages(group_rewards)
        samples = []
        for key, adv in zip(keys, advs, strict=True):
            pid = key[1]
            prompt = self.tok.prompt_ids(self.problems[pid].prompt)
            for k, a in zip(groups[key], adv, strict=True):
                samples.append(Sample(prompt, list(k.tokens), float(a)))
        served = self._served_by_engine(stats_before) + self._died_served
        # long rounds that do not pay: measured per kind, a due one retired before the report
        # says what comes next (so the operator never scales up for a round that won't run).
        # The cost is the rounds' critical path in decode steps (a synchronous round lasts as
        # long as its longest response), not seconds: deterministic, so a resumed run retires
        # exactly what the straight run did.
        # a filled long round's yield is its queued prompts' (what retirement decides on)
        queued = [i for i in informative if keys_all[i][1] not in self._fill]
        self.planner.observe_yield(kind, len(queued), float(path_tokens))
        retired = self.planner.retire_due_long_rounds()
        next_long = self.planner.next_round_kind is RoundKind.LONG
        forecast = self.planner.rounds_until_long()
        asking = not next_long and self._ask_early(forecast, rollout_s + reward_s + join_s)
        if not next_long and not asking:
            gone = self.release_extras()  # before the report that lets the operator scale down
            if gone and kind is RoundKind.LONG and self.release_when_fits:
                # releaseWhenFits: added replicas still held at the long round's end (wide
                # engines, which stay to it, _release_if_fits; or ones the round ended before
                # it could give back) go back now, before the rewards, the training and the
                # sync, not at the report
                self._released_mid = [round(rollout_s, 3), *gone]
                told = self.controller.release(self.attempt, self.step)
                print(f"step {self.step}'s long round is over: replica(s) {gone} released"
                      f" before its training; the operator"
                      f" {'scales back now' if told else 'scales back at the report'}",
                      flush=True)
        t0 = time.perf_counter()
        stream, self._stream = self._stream, None
        if stream is not None:
            stats = self.learner.stream_finish(samples, mini_batches)
        else:
            stats = self.learner.train_step(samples, mini_batches)
        train_s = time.perf_counter() - t0
        sync_s = self.sync_weights()
        summary = length_summary(lengths, aborted)
        mean_reward = sum(rewards_all) / len(rewards_all) if rewards_all else 0.0
        report = StepReport(
            attempt=self.attempt, step=self.step, group_size=g, round_kind=kind,
            lengths=summary,
            seconds=StepSeconds(rollout=rollout_s, reward=reward_s, train=train_s, sync=sync_s),
            long_queue=self.planner.long_queue_len,
            next_round_kind=self.planner.next_round_kind, reward=mean_reward,
            prepare_long_round=asking, next_straggler_risk=self.next_straggler_risk(),
        )
        next_plan = self.controller.report(report)
        self._asked_early = asking
        if kind is RoundKind.LONG:
            self._deferrals = 0
        if (next_long or asking) and self._asked_at is None:
            self._asked_at, self._lead_done = time.perf_counter(), False
        elif not (next_long or asking):
            self._asked_at = None
        step_s = rollout_s + reward_s + train_s + sync_s + join_s
        if kind is RoundKind.SHORT:
            self._short_s = [*self._short_s, step_s][-8:]
        est = total_stats([*self._engine_stats().values(), *self._retired])
        rec = {
            "step": self.step, "attempt": self.attempt, "group_size": g,
            "prompts": sorted(key[1] for key in groups),
            "round_kind": kind.value, "reward": mean_reward,
            "accuracy": sum(r >= 1.0 for r in rewards_all) / max(1, len(rewards_all)),
            "long_rounds": self.planner.long_rounds,
            "len_max": summary.max, "len_median": summary.median, "len_p90": summary.p90,
            "len_mean": summary.mean,
            "kept": summary.count, "aborted": aborted, "long_queue": report.long_queue,
            "next_round_kind": report.next_round_kind.value,
            "seconds_rollout": rollout_s, "seconds_reward": reward_s, "seconds_train": train_s,
            "seconds_sync": sync_s, "seconds_join": join_s, "lambda": next_plan.lambda_,
            "seconds_capacity_wait": self._ready_wait_s + join_s,
            "seconds_extra_idle": self._extra_idle_s, "rounds_until_long": forecast,
            "prepare_long_round": asking, "scale_up_lead_s": self.lead_in_use(),
            "deferred_long_round": deferring,
            "joined_mid_round": self._joined_mid, "moved_requests": self._moved,
            "moved_tokens": self._moved_tokens, "released_mid_round": self._released_mid,
            "straggler_rate": next_plan.straggler_rate,
            "straggler": getattr(self.controller, "last_straggler", None),
            "tau": float(self.cfg.spec.group_control.straggler_ratio),
            "engine_tokens": est.tokens, "engine_busy_s": est.busy_seconds,
            "rollout_wall_s": self.rollout_wall, "dropped_groups": dropped, "refills": refills,
            "informative_groups": len(informative), "overprovisioned": overprovisioned,
            "retired_prompts": len(retired), "retired_total": self.planner.retired,
            "routed_prompts": routed, "routed_total": self.routed_total,
            "rounds_kept_near_cap": near_cap,
            "critical_path_tokens": path_tokens,
            "fill_prompts": len(self._fill) if kind is RoundKind.LONG else 0,
            "fill_kept": (sum(1 for key in groups if key[1] in self._fill)
                          if kind is RoundKind.LONG else 0),
            "stream_training": stream is not None,
            "streamed_in_rollout": stream.in_rollout if stream is not None else 0,
            "seconds_train_streamed": float(stats.get("stream_s", 0.0)),
            "tail_gate_on": self.planner.gate.active and self.planner.config.enabled,
            **reward_metrics(self.scorer.stats.minus(reward_before)),
            "policy_version": self.policy_version, "engines": served, "replicas": used,
            **{f"learner_{k}": v for k, v in stats.items()},
        }
        if hasattr(self.controller, "posterior_means"):
            rec["posterior"] = {str(k): v for k, v in self.controller.posterior_means().items()}
        if hasattr(self.controller, "step_seconds") and (priced := self.controller.step_seconds()):
            rec["step_seconds_by_g"] = {str(k): round(v, 4) for k, v in priced.items()}
        if hasattr(self.controller, "step_prices") and (prices := self.controller.step_prices()):
            rec["step_price_by_g"] = {str(k): round(v, 4) for k, v in prices.items()}
        self.records.append(rec)
        self.step += 1
        self._next_plan = next_plan
        return rec

    # --- engines ------------------------------------------------------------------------------
    @property
    def engines(self) -> list[Any]:
        """The live engines, in replica order."""
        return [self.pool[r] for r in sorted(self.pool)]

    def _ray_engines(self) -> bool:
        return bool(self.pool) and hasattr(next(iter(self.pool.values())), "info_async")

    def _infos(self, replicas: Sequence[int]) -> dict[int, EngineInfo]:
        out: dict[int, EngineInfo] = {}
        if self._ray_engines():
            import ray

            refs = {r: self.pool[r].info_async() for r in replicas}
            for r, ref in refs.items():
                try:
                    out[r] = ray.get(ref)
                except _died_errors():
                    self._forget(r, "died")
            return out
        for r in replicas:
            try:
                out[r] = self.pool[r].info()
            except _died_errors():
                self._forget(r, "died")
        return out

    def engine_infos(self) -> list[EngineInfo]:
        """What each engine reports about itself (read in its own process), in replica order."""
        return list(self._infos(sorted(self.pool)).values())

    def usable_replicas(self, plan: Plan) -> list[int]:
        """The rollout replicas the plan lets this round use: its ``rollout.usableReplicas``
        (the ready ones within the desired count); from an operator that does not send it,
        ``0..min(ready, desired)-1`` and the start-up replicas."""
        return self._usable(plan.rollout)

    def _usable(self, cap: RolloutCapacity) -> list[int]:
        if cap.usable_replicas is not None:
            return sorted(set(cap.usable_replicas))
        n = min(cap.ready_replicas, cap.desired_replicas)
        return sorted(set(range(n)) | self.base_replicas)

    def use_plan(self, plan: Plan, kind: RoundKind | None = None,
                 background: bool = False) -> list[int]:
        """Fits the engines to the plan before a round (of ``kind``, default the plan's):
        starts the engines of usable replicas that have none (a long round's, or one whose
        engine died) once their pods have joined Ray, each serving only after it holds the
        learner's weights; releases extra engines the plan no longer names; returns the
        replicas the round uses. Asked early (a long round forecast), a short round does not
        wait for them: they start in the background and serve from the first round after
        they are up; a long round waits for those still starting. ``background``: start the
        missing ones in the background whatever was asked (a short round run in a pending
        long round's place)."""
        kind = plan.round_kind if kind is None else kind
        long = kind is RoundKind.LONG
        mid = long and self.join_mid_round  # the round starts on what serves; others join
        usable = self.usable_replicas(plan)
        self._drop_dead()
        for r in sorted(self.pool):
            if r not in usable and r not in self.base_replicas:
                self._forget(r, "released")
        self._admit_started(usable, wait=long and not mid)
        missing = [r for r in usable if r not in self.pool and r not in self._joining]
        self._mid_usable = usable
        self._mid_round = mid and self.engine_factory is not None
        if missing and self.engine_factory is not None:
            if mid or ((self._asked_early or background) and not long):
                self._start_in_background(missing)
            else:
                self._join(missing)
        active = [r for r in sorted(self.pool) if r in usable]
        if self.wide_long_rounds:
            # wide long-round engines (tailBatching.longRound.tensorParallelSize): a long
            # round runs on them alone, a short one on the rollout's (each falling back to
            # what is live when none of its own is)
            mine = [r for r in active if (r not in self.base_replicas) == long]
            active = mine or active
        if not active:  # nothing the plan names is live: run on what is
            active = sorted(self.pool)
        if not active:
            raise RuntimeError("no rollout engine is live")
        now = time.perf_counter()
        self._extra_idle_s = sum(now - self._joined_at.pop(r) for r in active
                                 if r in self._joined_at)
        if (long and self._asked_at is not None and not self._lead_done
                and self._last_join >= self._asked_at and set(usable) <= set(self.pool)):
            # every replica the long round may use is serving: the lead this ask took
            self.lead_measured = max(0.0, self._last_join - self._asked_at)
            self._lead_done = True
        self.active = active
        return list(active)

    def lead_in_use(self) -> float:
        """Seconds ahead of a forecast long round to ask for its replicas (0: never)."""
        if self.lead_s <= 0:
            return 0.0
        if self.lead_measured is None:
            return self.lead_s
        return max(self.lead_measured, 1e-3)  # joined at once: still ask a round ahead

    def _ask_early(self, forecast: int | None, this_step_s: float) -> bool:
        """Whether this step's report asks for the long round's replicas ahead of it."""
        if (self.lead_s <= 0 or self.long_replicas <= len(self.base_replicas)
                or self.step + 1 >= self.cfg.total_steps):
            return False  # off, nothing to add, or this step is the job's last
        step_s = (statistics.fmean(self._short_s) if self._short_s else this_step_s)
        return ask_early(forecast, step_s, self.lead_in_use())

    def _start_in_background(self, replicas: Sequence[int]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        if self._join_threads is None:
            self._join_threads = ThreadPoolExecutor(max_workers=4,
                                                    thread_name_prefix="engine-start")
        why = ("it joins the long round under way" if self._mid_round
               else "a long round is forecast")
        for r in replicas:
            print(f"rollout replica {r}: its engine starts in the background ({why})",
                  flush=True)
            self._joining[r] = self._join_threads.submit(self._start_engine, r)

    def _start_engine(self, r: int) -> Any:
        """Replica r's engine once its pod has joined Ray (None: it has not, or its engine
        died starting three times)."""
        if r not in self._offered([r]):
            print(f"rollout replica {r} is usable but its pod has not joined Ray", flush=True)
            return None
        return self._try_start(r)

    def _try_start(self, r: int) -> Any:
        """Replica r's engine on its pod, offered in Ray (None: it died starting 3 times)."""
        assert self.engine_factory is not None
        for attempt in range(3):
            try:
                return self.engine_factory(r)
            except _died_errors() as err:
                # e.g. placed on the pod's previous Ray node just before it was marked
                # dead (same pod name, same address): try again on the one now offered
                print(f"rollout replica {r}: its new engine died starting ({attempt + 1}"
                      f"/3): {str(err).splitlines()[0]}", flush=True)
                time.sleep(2.0)
        return None

    def _admit_started(self, usable: Sequence[int], *, wait: bool) -> None:
        """The engines started in the background that are up (all of them, ``wait``): the
        learner's weights pushed, then serving; one the plan no longer names is shut down."""
        from concurrent.futures import wait as wait_all

        if not self._joining:
            return
        if wait:
            wait_all(list(self._joining.values()))
        started: dict[int, Any] = {}
        for r, fut in list(self._joining.items()):
            if not fut.done():
                continue
            del self._joining[r]
            try:
                eng = fut.result()
            except Exception as err:  # a failed start is reported, not fatal
                print(f"rollout replica {r}: its engine failed to start: {err}", flush=True)
                continue
            if eng is None:
                continue
            if r in usable:
                started[r] = eng
            elif hasattr(eng, "shutdown"):
                eng.shutdown()
        if started:
            self._admit(started)
            now = time.perf_counter()
            for r in started:
                if r in self.pool:
                    self._joined_at[r] = now

    def _abandon_starts(self) -> None:
        """Background starts no longer wanted: each engine is shut down once it is up."""
        for r, fut in list(self._joining.items()):
            del self._joining[r]

            def _down(f: Any, r: int = r) -> None:
                try:
                    eng = f.result()
                except Exception:  # it never started: nothing to shut down
                    return
                if eng is not None and hasattr(eng, "shutdown"):
                    eng.shutdown()
                print(f"rollout replica {r}: its engine, started for a long round no longer"
                      f" forecast, is shut down", flush=True)

            fut.add_done_callback(_down)

    def _drop_dead(self) -> None:
        """Forgets the engines that died between steps (e.g. with their pod), so that they
        are started again rather than sent requests."""
        self._infos(sorted(self.pool))

    def _join(self, missing: Sequence[int]) -> None:
        assert self.engine_factory is not None
        offered = self._offered(missing)
        started: dict[int, Any] = {}
        for r in missing:
            if r not in offered:
                print(f"rollout replica {r} is usable but its pod has not joined Ray: the "
                      f"round runs without it", flush=True)
                continue
            eng = self._try_start(r)
            if eng is not None:
                started[r] = eng
        self._admit(started)

    def _admit(self, started: dict[int, Any]) -> None:
        """Started engines serve once they hold the learner's weights (those that do not are
        shut down)."""
        if not started:
            return
        blob, version = self.learner.publish()  # one copy for every joining engine
        if version != self.policy_version:
            raise RuntimeError(f"the learner's weights {version} are not the ones the "
                               f"engines hold ({self.policy_version})")
        for k in self._push_weights(list(started.values()), blob):
            r = list(started)[k]
            print(f"rollout replica {r}: its new engine died loading the weights", flush=True)
            del started[r]
        for r, eng in started.items():
            held = eng.info().policy_version
            if held != self.policy_version:
                print(f"rollout replica {r}: its new engine holds {held}, not the learner's "
                      f"{self.policy_version}: not used", flush=True)
                if hasattr(eng, "shutdown"):
                    eng.shutdown()
                continue
            self.pool[r] = eng
            self.events.append(("joined", r))
            self._last_join = time.perf_counter()
            print(f"rollout engine of replica {r} joined at {held}", flush=True)

    def _offered(self, want: Sequence[int]) -> set[int]:
        if self.offered_replicas is None:
            return set(want)
        deadline = time.monotonic() + self.join_wait_s
        while True:
            offered = self.offered_replicas()
            if set(want) <= offered or time.monotonic() >= deadline:
                return offered
            time.sleep(0.5)

    def release_extras(self) -> list[int]:
        """Kills the engines beyond the start-up replicas (a long round's): called when the
        long round is over, before the report that lets the operator scale the rollout
        StatefulSet back down, so no pod is deleted under a live engine."""
        self._abandon_starts()
        self._joined_at.clear()
        extra = [r for r in sorted(self.pool) if r not in self.base_replicas]
        for r in extra:
            self._forget(r, "released")
        return extra

    def topology(self) -> dict[str, Any]:
        """Where every engine and learner replica runs, each as it reports itself."""
        return {"engines": [dataclasses.asdict(i) for i in self.engine_infos()],
                "learners": self.learner.infos(), "policy_version": self.policy_version,
                "driver": {"pid": os.getpid(), "hostname": socket.gethostname()}}

    def _engine_stats(self) -> dict[int, EngineStats]:
        out: dict[int, EngineStats] = {}
        for r in sorted(self.pool):
            try:
                out[r] = dataclasses.replace(self.pool[r].stats())  # a copy: deltas later
            except _died_errors():
                self._forget(r, "died")
        return out

    def _served_by_engine(self, before: dict[int, EngineStats]) -> list[dict[str, Any]]:
        """The step's work per engine that served it (its own report of where it ran and
        which weights it held while generating, before this step's sync)."""
        out = []
        after = self._engine_stats()
        for e, info in self._infos(sorted(self.pool)).items():
            tokens = after[e].tokens - (before[e].tokens if e in before else 0)
            busy = after[e].busy_seconds - (before[e].busy_seconds if e in before else 0.0)
            # a joining engine's start-up is not this step's work: from its first stats read
            cpu = after[e].cpu_seconds - (before[e].cpu_seconds if e in before else
                                          after[e].cpu_seconds)
            if self._served.get(e, 0) == 0 and tokens == 0:
                continue
            out.append({"replica": info.replica, "address": info.address,
                        "hostname": info.hostname, "netns": info.netns,
                        "cores": info.threads_bind,
                        "tensor_parallel_size": info.tensor_parallel_size,
                        "responses": self._served.get(e, 0), "tokens": tokens,
                        "busy_s": round(busy, 4), "cpu_s": round(cpu, 4),
                        "policy_version": info.policy_version})
        return out

    def sync_weights(self) -> float:
        """Pushes the learner's weights to every engine: one serialized copy per update (on
        Ray one object in the object store, fetched once per node, loaded by every engine at
        once); then checks that every engine's worker reports the learner's fingerprint."""
        if self.weight_transport == "nccl":  # GPU learners and engines (unverified)
            t0 = time.perf_counter()
            self.policy_version = self.learner.nccl_sync(self.engines)
            return time.perf_counter() - t0
        blob, version = self.learner.publish()  # bytes, or a ref to rank 0's in the store
        t0 = time.perf_counter()
        replicas = sorted(self.pool)
        for k in self._push_weights([self.pool[r] for r in replicas], blob):
            self._forget(replicas[k], "died")  # started again once its pod is back
        seconds = time.perf_counter() - t0
        self.policy_version = version
        self._check_held(version, "the learner's weights")
        return seconds

    def push_policy(self, blob: bytes, version: str) -> None:
        """Loads a serialized state dict (``weights.to_bytes``) from outside this driver's
        learner into every engine, e.g. to score another trainer's weights with
        :meth:`evaluate`, and checks that every engine holds ``version`` (its
        ``weights.fingerprint``); the next :meth:`sync_weights` puts the learner's back."""
        replicas = sorted(self.pool)
        dead = self._push_weights([self.pool[r] for r in replicas], blob)
        if dead:
            raise RuntimeError(f"engines of replicas {[replicas[k] for k in dead]} died while"
                               " loading weights")
        self._check_held(version, "the weights pushed")

    def _check_held(self, version: str, what: str) -> None:
        """Raises unless every engine's worker reports ``version`` (a weights fingerprint)."""
        stale = [(i.replica, i.policy_version) for i in self.engine_infos()
                 if i.policy_version != version]
        if stale:
            raise RuntimeError(f"weight sync: engines (replica, version) {stale} do not hold "
                               f"{what} {version}")

    def _push_weights(self, engines: Sequence[Any], blob: Any) -> list[int]:
        """Loads ``blob`` into ``engines``; returns the positions of those that died."""
        dead: list[int] = []
        if engines and hasattr(engines[0], "load_weights_async"):
            import ray

            ref = blob if isinstance(blob, ray.ObjectRef) else ray.put(blob)
            refs = [e.load_weights_async(ref) for e in engines]
            for k, one in enumerate(refs):
                try:
                    ray.get(one)
                except _died_errors():
                    dead.append(k)
            return dead
        if not isinstance(blob, (bytes, list)):  # a ref (a list: buckets, each loaded)
            import ray

            blob = ray.get(blob)
        for k, e in enumerate(engines):
            try:
                e.load_weights(blob)
            except _died_errors():
                dead.append(k)
        return dead

    # --- the loop -----------------------------------------------------------------------------
    def run(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Runs until ``cfg.total_steps`` (or ``steps`` more steps); checkpoints every N."""
        end = self.cfg.total_steps if steps is None else min(self.cfg.total_steps,
                                                             self.step + steps)
        plan = self.controller.plan()
        if (plan.round_kind is RoundKind.SHORT and plan.rollout.state is RolloutState.SCALING_UP
                and not self._asked_early):
            # a scale-up for a short round is an early one (scaleUpLeadSeconds) that an
            # earlier attempt asked and the operator still holds: this attempt's short rounds
            # do not wait for it either (its reports ask again, or it is released)
            self._asked_early = True
            if self._asked_at is None:
                self._asked_at, self._lead_done = time.perf_counter(), False
        plan = self._wait_ready(plan)
        every = self.cfg.checkpoint_every
        while self.step < end and not self.planner.done and not plan.done:
            rec = self.run_step(plan)
            if self.on_step is not None:
                self.on_step(rec)
            if self.checkpoint_dir is not None and self.step % every == 0:
                self.save_checkpoint()
            plan = self._wait_ready(self._next_plan)
        return self.records

    def _wait_ready(self, plan: Plan) -> Plan:
        """The plan once its scale-up is resolved, except for a short round whose scale-up
        this driver asked ahead of a long round (that round does not wait for it), and for a
        long round whose replicas are not ready while ``maxDeferredRounds`` allows a short
        round in its place (:meth:`_defer`)."""
        t0 = time.perf_counter()
        if self._defer(plan):
            pass
        elif not ((self._asked_early and plan.round_kind is RoundKind.SHORT)
                  or (self.join_mid_round and plan.round_kind is RoundKind.LONG
                      and self.engine_factory is not None)):
            plan = self.controller.wait_ready(plan)
        self._ready_wait_s = time.perf_counter() - t0
        return plan

    def _defer(self, plan: Plan) -> bool:
        """Whether the next round is a short one in place of the due long round the plan
        names, whose extra replicas the operator is still scaling up (waiting for a queue's
        admission or for their pods): at most ``maxDeferredRounds`` in a row, and only while
        the epoch has fresh prompts for it (the planner's :meth:`defer_long_round`). The
        long round's prompts stay queued; the operator keeps its scale-up pending."""
        if (self.max_deferrals <= 0 or self._deferrals >= self.max_deferrals
                or plan.round_kind is not RoundKind.LONG
                or plan.rollout.state is not RolloutState.SCALING_UP
                or plan.step != self.step or plan.done
                or self.planner.next_round_kind is not RoundKind.LONG
                or not self.planner.defer_long_round()):
            return False
        self._deferrals += 1
        self._deferring = True
        print(f"step {self.step}: a short round in place of the long round, whose"
              f" {plan.rollout.desired_replicas} rollout replicas are not ready"
              f" ({plan.rollout.ready_replicas} are; {self._deferrals} of at most"
              f" {self.max_deferrals})", flush=True)
        return True

    # --- evaluation ---------------------------------------------------------------------------
    def evaluate(self, problems: Sequence[Any], temperature: float = 0.0,
                 seed: int = 0) -> float:
        """Accuracy on ``problems`` (the held-out set): greedy by default, else one seeded
        sample per prompt at ``temperature``; split over the engines."""
        engines = self.engines
        per_engine: list[list[GenRequest]] = [[] for _ in engines]
        self._evals = getattr(self, "_evals", 0) + 1
        for j, p in enumerate(problems):
            per_engine[j % len(engines)].append(GenRequest(
                f"eval{self.step}.{self._evals}-{j}", tuple(self.tok.prompt_ids(p.prompt)),
                self.cfg.max_tokens, temperature,
                None if temperature == 0 else sample_seed(seed, -1, j, 0)))
        for e, reqs in enumerate(per_engine):
            if not reqs:
                continue
            done = engines[e].generate(reqs)
            for r in reqs:
                j = int(r.request_id.rsplit("-", 1)[1])
                f = done[r.request_id]
                if f.finish_reason == "stop":  # scored by the job's own reward (spec.reward)
                    self.scorer.submit(("eval", j), RewardCall.of(
                        self.tok.decode(f.token_ids), problems[j]))
        scores, _ = self.scorer.collect()
        hits = sum(int(v >= 1.0) for v in scores.values())
        return hits / max(1, len(problems))

    # --- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        assert self.checkpoint_dir is not None
        final = self.checkpoint_dir / f"step-{self.step:06d}"
        tmp = self.checkpoint_dir / f".tmp-step-{self.step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.learner.save(tmp / "learner.pt")  # learner rank 0 writes its part
        torch.save(driver_rng_state(), tmp / "driver.pt")
        state = {
            "step": self.step, "attempt": self.attempt,
            "planner": self.planner.state_dict(),
            "controller": (self.controller.state_dict()
                           if hasattr(self.controller, "state_dict") else None),
            "records": self.records, "rollout_wall": self.rollout_wall,
            "length_prior": self.prior.state_dict(), "routed_total": self.routed_total,
        }
        (tmp / "state.json").write_text(json.dumps(state))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (self.checkpoint_dir / "latest").write_text(final.name + "\n")
        return final

    def checkpoints(self) -> list[tuple[int, Path]]:
        """The complete checkpoints in ``checkpoint_dir`` as (step, folder), oldest first
        (a folder is complete once renamed from its ``.tmp-`` name, :meth:`save_checkpoint`)."""
        if self.checkpoint_dir is None or not self.checkpoint_dir.is_dir():
            return []
        out = []
        for d in self.checkpoint_dir.glob("step-*"):
            step = d.name.removeprefix("step-")
            if step.isdigit() and (d / "state.json").is_file():
                out.append((int(step), d))
        return sorted(out)

    def load_checkpoint(self, path: Path | None = None, *, at_most: int | None = None) -> bool:
        """Restores the latest (or ``path``) checkpoint; False when there is none.

        ``at_most``: the step the job's plan is at (the operator's controller expects that
        step next): the latest checkpoint if its step is at most that, else the newest one
        that is, since a new attempt may resume at any step up to the plan's and never past
        it (a checkpoint past it is another run's, e.g. on a claim a deleted job of the same
        name wrote, or one the controller's state no longer knows). None: the latest,
        whatever its step (the controller is in this process and resumes from the checkpoint
        itself)."""
        if path is None and at_most is not None and self.checkpoint_dir is not None:
            marker = self.checkpoint_dir / "latest"
            latest = marker.read_text().strip() if marker.exists() else ""
            saved = self.checkpoints()
            if not any(d.name == latest and s <= at_most for s, d in saved):
                ahead = [d.name for s, d in saved if s > at_most]
                if ahead:
                    print(f"checkpoints past the plan's step {at_most} not used: "
                          f"{', '.join(ahead)}", flush=True)
                fit = [d for s, d in saved if s <= at_most]
                if not fit:
                    return False
                path = fit[-1]
        if path is None:
            if self.checkpoint_dir is None or not (self.checkpoint_dir / "latest").exists():
                return False
            path = self.checkpoint_dir / (self.checkpoint_dir / "latest").read_text().strip()
        self.learner.load(path / "learner.pt")  # every learner replica
        if (path / "driver.pt").exists():
            set_driver_rng_state(torch.load(path / "driver.pt", weights_only=False))
        else:  # checkpoints written before learners moved out of the driver
            set_driver_rng_state(torch.load(path / "learner.pt", weights_only=False))
        state = json.loads((path / "state.json").read_text())
        self.step = int(state["step"])
        self.planner = TailBatchingPlanner.from_state_dict(state["planner"])
        if state["controller"] is not None and hasattr(self.controller, "load_state_dict"):
            self.controller.load_state_dict(state["controller"])
        self.records = list(state["records"])
        self.rollout_wall = float(state["rollout_wall"])
        # checkpoints written before the prior existed: it starts again from nothing
        self.prior = (LengthPrior.from_state_dict(state["length_prior"])
                      if "length_prior" in state else LengthPrior(self.planner.num_prompts))
        self.prior.half_life = self.cfg.length_half_life  # the spec's, not the checkpoint's
        self.routed_total = int(state.get("routed_total", 0))
        self.sync_weights()
        return True
