"""The synchronous on-policy RL loop: plan, roll out (tail batching), score, train, sync, report.

One step = one policy update. Per step:

1. The plan (group size G, round kind) comes from the controller client (in-process or the
   operator's step-report endpoint); while it says ScalingUp the driver polls.
2. The driver owns the tail-batching planner: ``start_round(G)`` picks the prompts; requests
   go to the engines; each finished response is fed to the planner *in finish order*, and
   whatever it says to abort is aborted on the engines at once. Kept responses are scored as
   they finish (rewards off the critical path).
3. DAPO dynamic sampling (when on): groups whose rewards are all equal are dropped and, while
   the batch is short of P0 groups, up to ``max_refill_rounds`` more short rounds refill it
   (never a long round: a long round is its own step). Their lengths count in the report.
4. Group-relative advantages, one policy update, weights pushed to every engine in place.
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
import os
import shutil
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rlpacer.api.protocol import LengthSummary, Plan, RoundKind, StepReport, StepSeconds
from rlpacer.control.tail_batching import TailBatchingPlanner
from rlpacer_trainer import algos, task, tiny
from rlpacer_trainer.engine import EngineInfo, EngineStats, Finished, GenRequest, total_stats
from rlpacer_trainer.learner import Sample
from rlpacer_trainer.learners import driver_rng_state, set_driver_rng_state
from rlpacer_trainer.rewards import RewardScorer


def sample_seed(seed: int, round_index: int, prompt: int, idx: int) -> int:
    h = hashlib.blake2b(f"{seed}/{round_index}/{prompt}/{idx}".encode(), digest_size=4)
    return int.from_bytes(h.digest(), "little")


def length_summary(lengths: Sequence[int], aborted: int) -> LengthSummary:
    if not lengths:
        return LengthSummary(max=1, median=1, p90=1, count=0, aborted=aborted)
    s = sorted(lengths)
    p90 = s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]
    return LengthSummary(max=s[-1], median=float(statistics.median(s)), p90=float(p90),
                         count=len(s), aborted=aborted)


@dataclasses.dataclass
class Kept:
    prompt: int
    idx: int
    tokens: tuple[int, ...]
    finish_reason: str
    reward: float = 0.0


@dataclasses.dataclass
class RoundOutcome:
    kind: RoundKind
    kept: dict[int, list[Kept]]
    aborted: int
    rollout_s: float


def _poll_all(engines: Sequence[Any], busy: Sequence[int]) -> list[Finished]:
    """Polls the busy engines; Ray engines in parallel."""
    if busy and hasattr(engines[busy[0]], "poll_async"):
        import ray

        refs = [engines[i].poll_async() for i in busy]
        out: list[Finished] = []
        for r in ray.get(refs):
            out.extend(r)
        return out
    out = []
    for i in busy:
        out.extend(engines[i].poll())
    return out


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
    ) -> None:
        self.cfg = cfg
        self.controller = controller
        self.engines = list(engines)
        self.learner = learner
        self.planner = planner
        self.attempt = attempt
        self.checkpoint_dir = checkpoint_dir
        self.on_step = on_step
        self.problems = cfg.problems()
        self.step = 0
        self.records: list[dict[str, Any]] = []
        self._reward_fn = task.REWARDS[cfg.spec.reward.type]
        self.scorer = RewardScorer(self._score, timeout_s=float(cfg.spec.reward.timeout_seconds))
        self.rollout_wall = 0.0  # wall time inside rollouts (engine busy fraction's base)
        self._pending: dict[str, tuple[int, int, int]] = {}  # request id -> engine, prompt, idx
        self._served = [0] * len(self.engines)  # responses each engine finished this step
        self.policy_version: str | None = None  # the learner's, as last pushed to the engines
        # "store": Ray's object store (CPU, and GPU by default); "nccl": learner rank 0
        # broadcasts to the engines' workers (RLPACER_WEIGHT_TRANSPORT=nccl; unverified)
        self.weight_transport = "store"

    # --- rewards -----------------------------------------------------------------------------
    def _score(self, tokens: tuple[int, ...], finish_reason: str, pid: int) -> float:
        r = 0.0
        if finish_reason == "stop":
            r = self._reward_fn(tiny.decode(list(tokens)), self.problems[pid])
        if self.cfg.overlong_buffer:
            r += self.cfg.overlong_scale * algos.overlong_penalty(
                len(tokens), max_tokens=self.cfg.max_tokens,
                buffer_tokens=self.cfg.overlong_buffer)
        return r

    # --- one round ----------------------------------------------------------------------------
    def run_round(self, group_size: int) -> RoundOutcome:
        plan = self.planner.start_round(group_size)
        def rid(p: int, i: int) -> str:
            return f"r{plan.index}-p{p}-i{i}"

        per_engine: list[list[GenRequest]] = [[] for _ in self.engines]
        self._pending.clear()
        for j, p in enumerate(plan.prompts):
            e = j % len(self.engines)
            ids = tuple(tiny.prompt_ids(self.problems[p].prompt))
            for i in range(plan.responses_per_prompt):
                per_engine[e].append(GenRequest(
                    rid(p, i), ids, self.cfg.max_tokens, self.cfg.temperature,
                    sample_seed(self.cfg.data_seed, plan.index, p, i)))
                self._pending[rid(p, i)] = (e, p, i)
        t0 = time.perf_counter()
        for e, reqs in enumerate(per_engine):
            if reqs:
                self.engines[e].submit(reqs)
        kept: dict[int, list[Kept]] = {}
        aborted = 0
        complete = False
        while not complete:
            busy = sorted({e for e, _, _ in self._pending.values()})
            if not busy:
                break
            for f in _poll_all(self.engines, busy):
                if f.request_id not in self._pending:
                    continue  # aborted while this batch was in flight
                e, p, i = self._pending.pop(f.request_id)
                self._served[e] += 1
                d = self.planner.on_response_finished(p, i)
                if d.keep:
                    k = Kept(p, i, f.token_ids, f.finish_reason)
                    kept.setdefault(p, []).append(k)
                    self.scorer.submit((plan.index, p, i), f.token_ids, f.finish_reason, p)
                to_abort = [(q, j) for q in d.abort_prompts for j in
                            range(plan.responses_per_prompt)] + list(d.abort_responses)
                if d.round_complete:
                    to_abort += [(q, j) for (_, q, j) in self._pending.values()]
                aborted += self._abort(rid, to_abort)
                if d.round_complete:
                    complete = True
        rollout_s = time.perf_counter() - t0
        self.rollout_wall += rollout_s
        res = self.planner.finish_round()
        out = {p: [k for k in kept[p] if k.idx in set(idxs)] for p, idxs in res.kept.items()}
        return RoundOutcome(res.kind, out, res.aborted_responses, rollout_s)

    def _abort(self, rid: Callable[[int, int], str], pairs: Sequence[tuple[int, int]]) -> int:
        by_engine: dict[int, list[str]] = {}
        for p, i in pairs:
            r = rid(p, i)
            if r in self._pending:
                e, _, _ = self._pending.pop(r)
                by_engine.setdefault(e, []).append(r)
        for e, ids in by_engine.items():
            self.engines[e].abort(ids)
        return sum(len(v) for v in by_engine.values())

    # --- one step -----------------------------------------------------------------------------
    def run_step(self, plan: Plan) -> dict[str, Any]:
        g = plan.group_size
        p0 = int(self.cfg.spec.prompts_per_step)
        kind = self.planner.next_round_kind
        groups: dict[tuple[int, int], list[Kept]] = {}
        lengths: list[int] = []
        aborted = 0
        rollout_s = reward_s = 0.0
        dropped = refills = 0
        rewards_all: list[float] = []
        self._served = [0] * len(self.engines)
        stats_before = self._engine_stats()
        while True:
            rnd = self.run_round(g)
            rollout_s += rnd.rollout_s
            aborted += rnd.aborted
            scores, waited = self.scorer.collect()
            reward_s += waited
            for p, ks in rnd.kept.items():
                for k in ks:
                    k.reward = scores.get((self.planner.rounds - 1, p, k.idx), 0.0)
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
        keys = list(groups)
        group_rewards = [[k.reward for k in groups[key]] for key in keys]
        if self.cfg.dynamic_sampling:
            keep_idx = algos.informative_groups(group_rewards)
            dropped = len(keys) - len(keep_idx)
            keys = [keys[i] for i in keep_idx]
            group_rewards = [group_rewards[i] for i in keep_idx]
        advs = algos.ragged_group_advantages(group_rewards)
        samples = []
        for key, adv in zip(keys, advs, strict=True):
            pid = key[1]
            prompt = tiny.prompt_ids(self.problems[pid].prompt)
            for k, a in zip(groups[key], adv, strict=True):
                samples.append(Sample(prompt, list(k.tokens), float(a)))
        served = self._served_by_engine(stats_before)
        t0 = time.perf_counter()
        stats = self.learner.train_step(samples)
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
        )
        next_plan = self.controller.report(report)
        est = total_stats(self._engine_stats())
        rec = {
            "step": self.step, "attempt": self.attempt, "group_size": g,
            "prompts": sorted(key[1] for key in groups),
            "round_kind": kind.value, "reward": mean_reward,
            "accuracy": sum(r >= 1.0 for r in rewards_all) / max(1, len(rewards_all)),
            "long_rounds": self.planner.long_rounds,
            "len_max": summary.max, "len_median": summary.median, "len_p90": summary.p90,
            "kept": summary.count, "aborted": aborted, "long_queue": report.long_queue,
            "next_round_kind": report.next_round_kind.value,
            "seconds_rollout": rollout_s, "seconds_reward": reward_s, "seconds_train": train_s,
            "seconds_sync": sync_s, "lambda": next_plan.lambda_,
            "straggler_rate": next_plan.straggler_rate,
            "straggler": getattr(self.controller, "last_straggler", None),
            "tau": float(self.cfg.spec.group_control.straggler_ratio),
            "engine_tokens": est.tokens, "engine_busy_s": est.busy_seconds,
            "rollout_wall_s": self.rollout_wall, "dropped_groups": dropped, "refills": refills,
            "reward_timeouts": self.scorer.timeouts,
            "policy_version": self.policy_version, "engines": served,
            **{f"learner_{k}": v for k, v in stats.items()},
        }
        if hasattr(self.controller, "posterior_means"):
            rec["posterior"] = {str(k): v for k, v in self.controller.posterior_means().items()}
        self.records.append(rec)
        self.step += 1
        self._next_plan = next_plan
        return rec

    # --- engines ------------------------------------------------------------------------------
    def _ray_engines(self) -> bool:
        return bool(self.engines) and hasattr(self.engines[0], "info_async")

    def engine_infos(self) -> list[EngineInfo]:
        """What each engine reports about itself (read in its own process), in engine order."""
        if self._ray_engines():
            import ray

            return list(ray.get([e.info_async() for e in self.engines]))
        return [e.info() for e in self.engines]

    def topology(self) -> dict[str, Any]:
        """Where every engine and learner replica runs, each as it reports itself."""
        return {"engines": [dataclasses.asdict(i) for i in self.engine_infos()],
                "learners": self.learner.infos(), "policy_version": self.policy_version,
                "driver": {"pid": os.getpid(), "hostname": socket.gethostname()}}

    def _engine_stats(self) -> list[EngineStats]:
        return [dataclasses.replace(e.stats()) for e in self.engines]  # a copy: deltas later

    def _served_by_engine(self, before: Sequence[EngineStats]) -> list[dict[str, Any]]:
        """The step's work per engine that served it (its own report of where it ran and
        which weights it held while generating, before this step's sync)."""
        out = []
        after = self._engine_stats()
        for e, info in enumerate(self.engine_infos()):
            tokens = after[e].tokens - before[e].tokens
            if self._served[e] == 0 and tokens == 0:
                continue
            out.append({"replica": info.replica, "address": info.address,
                        "hostname": info.hostname, "netns": info.netns,
                        "cores": info.threads_bind,
                        "responses": self._served[e], "tokens": tokens,
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
        if self._ray_engines():
            import ray

            ref = blob if isinstance(blob, ray.ObjectRef) else ray.put(blob)
            ray.get([e.load_weights_async(ref) for e in self.engines])
        else:
            if not isinstance(blob, bytes):
                import ray

                blob = ray.get(blob)
            for e in self.engines:
                e.load_weights(blob)
        seconds = time.perf_counter() - t0
        self.policy_version = version
        stale = [(i.replica, i.policy_version) for i in self.engine_infos()
                 if i.policy_version != version]
        if stale:
            raise RuntimeError(f"weight sync: engines (replica, version) {stale} do not hold "
                               f"the learner's weights {version}")
        return seconds

    # --- the loop -----------------------------------------------------------------------------
    def run(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Runs until ``cfg.total_steps`` (or ``steps`` more steps); checkpoints every N."""
        end = self.cfg.total_steps if steps is None else min(self.cfg.total_steps,
                                                             self.step + steps)
        plan = self.controller.wait_ready(self.controller.plan())
        every = int(self.cfg.spec.checkpoint.every_steps)
        while self.step < end and not self.planner.done and not plan.done:
            rec = self.run_step(plan)
            if self.on_step is not None:
                self.on_step(rec)
            if self.checkpoint_dir is not None and self.step % every == 0:
                self.save_checkpoint()
            plan = self.controller.wait_ready(self._next_plan)
        return self.records

    # --- evaluation ---------------------------------------------------------------------------
    def evaluate(self, problems: Sequence[task.Problem], temperature: float = 0.0,
                 seed: int = 0) -> float:
        """Accuracy on ``problems`` (the held-out set): greedy by default, else one seeded
        sample per prompt at ``temperature``; split over the engines."""
        per_engine: list[list[GenRequest]] = [[] for _ in self.engines]
        self._evals = getattr(self, "_evals", 0) + 1
        for j, p in enumerate(problems):
            per_engine[j % len(self.engines)].append(GenRequest(
                f"eval{self.step}.{self._evals}-{j}", tuple(tiny.prompt_ids(p.prompt)),
                self.cfg.max_tokens, temperature,
                None if temperature == 0 else sample_seed(seed, -1, j, 0)))
        hits = 0
        for e, reqs in enumerate(per_engine):
            if not reqs:
                continue
            done = self.engines[e].generate(reqs)
            for r in reqs:
                j = int(r.request_id.rsplit("-", 1)[1])
                f = done[r.request_id]
                if f.finish_reason == "stop":
                    hits += int(task.reward(tiny.decode(list(f.token_ids)), problems[j]) >= 1.0)
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
        }
        (tmp / "state.json").write_text(json.dumps(state))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (self.checkpoint_dir / "latest").write_text(final.name + "\n")
        return final

    def load_checkpoint(self, path: Path | None = None) -> bool:
        """Restores the latest (or ``path``) checkpoint; False when there is none."""
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
        self.sync_weights()
        return True
