"""The driver's loop against a scripted engine (no vLLM): finish-order delivery into the
tail-batching planner, aborts, dynamic sampling, reports, checkpoints and resume."""

from __future__ import annotations

import random
import textwrap
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rlpacer.api.job import TailBatchingActivation
from rlpacer.api.protocol import Plan, RolloutCapacity, RolloutState, RoundKind, StepReport
from rlpacer.control.plan import ControlPlan
from rlpacer_trainer import runtime, task, tiny, weights
from rlpacer_trainer.config import RunConfig
from rlpacer_trainer.controller_client import InProcessController
from rlpacer_trainer.driver import EngineDied, length_summary
from rlpacer_trainer.engine import EngineInfo, EngineStats, Finished, GenRequest

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("close_drivers")]
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-local.yaml"


class ScriptedEngine:
    """Answers each prompt correctly with probability 1/2 (seeded per request); a response
    of n tokens finishes at engine step n, so finish order is length order."""

    def __init__(self, replica: int = 0) -> None:
        self.replica = replica
        self.version: str | None = None
        self.live: dict[str, tuple[int, tuple[int, ...]]] = {}
        #: live requests: (engine step at submit, tokens it came with: a moved prefix)
        self.started: dict[str, tuple[int, int]] = {}
        self.taken: dict[str, tuple[int, ...]] = {}  # what take() handed on, by request
        self.clock = 0
        self.st = EngineStats()
        self.loads = 0
        self.aborted_ids: list[str] = []
        self.step_s = 0.0  # wall seconds an engine step takes

    def _tokens(self, r: GenRequest) -> tuple[int, ...]:
        text = tiny.decode(list(r.prompt_ids[1:]))
        n, k = (int(x) for x in text.rstrip(":").split("-"))
        ref = task.chain(n, k)
        rng = random.Random(r.seed)
        out = ref if rng.random() < 0.5 else ref[: max(0, len(ref) - 2)] + "9,"
        return (*tiny.encode(out), tiny.EOS_ID)[: r.max_tokens]

    def submit(self, requests: Sequence[GenRequest]) -> None:
        for r in requests:
            toks = self._tokens(r)
            # a moved request continues its response: the prefix must be the response's own
            assert toks[:len(r.prefix)] == r.prefix, (r.request_id, r.prefix, toks)
            self.live[r.request_id] = (self.clock + len(toks) - len(r.prefix), toks)
            self.started[r.request_id] = (self.clock, len(r.prefix))

    def take(self, request_ids: Sequence[str]) -> dict[str, tuple[int, ...]]:
        """Live requests handed on: each with the tokens generated so far (one a step)."""
        out = {}
        for rid in request_ids:
            if rid in self.live:
                _, toks = self.live.pop(rid)
                t0, had = self.started.pop(rid)
                out[rid] = toks[:had + self.clock - t0]
                self.st.tokens += self.clock - t0
                self.taken[rid] = out[rid]
        return out

    def poll(self, max_steps: int = 16) -> list[Finished]:
        out: list[Finished] = []
        for _ in range(max_steps):
            if not self.live or out:
                break
            if self.step_s:
                time.sleep(self.step_s)
            self.clock += 1
            self.st.steps += 1
            for rid, (t, toks) in sorted(self.live.items()):
                if t <= self.clock:
                    del self.live[rid]
                    self.st.tokens += len(toks) - self.started.pop(rid, (0, 0))[1]
                    out.append(Finished(rid, toks, "stop"))
        return out

    def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            if self.live.pop(rid, None) is not None:
                self.st.aborted += 1
                self.aborted_ids.append(rid)

    def pending(self) -> int:
        return len(self.live)

    def load_weights(self, blob: bytes) -> float:
        self.loads += 1
        self.version = weights.fingerprint(weights.from_bytes(blob).items())
        return 0.0

    def info(self) -> EngineInfo:
        return EngineInfo(self.replica, "127.0.0.1", "scripted", 0, 0, self.version)

    def stats(self) -> EngineStats:
        return self.st

    def generate(self, requests: Sequence[GenRequest]) -> dict[str, Finished]:
        self.submit(requests)
        done: dict[str, Finished] = {}
        while self.live:
            for f in self.poll():
                done[f.request_id] = f
        return done


def _cfg(activation: str = "Always", **kw: object) -> RunConfig:
    """The tiny example at 4 prompts per step; tail batching races every short round
    (``Always``) unless ``activation="Adaptive"`` (the gate; the spec's default)."""
    cfg = RunConfig.load(EXAMPLE, **kw)  # type: ignore[arg-type]
    cfg.job.spec.prompts_per_step = 4
    cfg.job.spec.tail_batching.activation = TailBatchingActivation(activation)
    return cfg


def test_length_summary() -> None:
    s = length_summary([5, 1, 3, 9, 7], aborted=2)
    assert (s.max, s.median, s.count, s.aborted) == (9, 5.0, 5, 2)
    assert s.median <= s.p90 <= s.max


def test_tail_batching_round_trip_with_aborts_and_reports() -> None:
    eng = ScriptedEngine()
    drv = runtime.build_driver(_cfg(steps=6), [eng])
    drv.run()
    recs = drv.records
    assert [r["step"] for r in recs] == list(range(6))
    shorts = [r for r in recs if r["round_kind"] == "Short"]
    assert shorts and all(r["aborted"] > 0 for r in shorts)  # the race aborts losers
    assert eng.aborted_ids and eng.pending() == 0
    assert any(r["round_kind"] == "Long" for r in recs)
    for r in recs:
        # dynamic sampling: only informative groups are trained on
        assert r["learner_samples"] <= r["kept"]
        assert r["len_max"] >= r["len_p90"] >= r["len_median"] > 0
    assert eng.loads == 1 + 6  # initial reset + one sync per step
    assert drv.controller.jc.next_step == 6


def test_sampling_follows_the_spec_temperature_and_top_p() -> None:
    """spec.rollout.temperature and topP reach every training request the engines get."""
    seen: list[GenRequest] = []

    class Recording(ScriptedEngine):
        def submit(self, requests: Sequence[GenRequest]) -> None:
            seen.extend(requests)
            super().submit(requests)

    cfg = _cfg(steps=1, tail_batching=False, fixed_group_size=4)
    cfg.job.spec.rollout.top_p = "0.85"
    cfg.job.spec.rollout.temperature = "0.7"
    runtime.build_driver(cfg, [Recording()]).run()
    assert seen and {(r.top_p, r.temperature) for r in seen} == {(0.85, 0.7)}


def test_no_tail_batching_never_aborts() -> None:
    eng = ScriptedEngine()
    drv = runtime.build_driver(_cfg(steps=3, tail_batching=False, fixed_group_size=4), [eng])
    drv.run()
    assert all(r["aborted"] == 0 and r["round_kind"] == "Short" for r in drv.records)
    assert all(r["group_size"] == 4 for r in drv.records)


class TailEngine(ScriptedEngine):
    """The scripted engine with a long tail: one response in 8 (by its seed) rambles on to
    the token limit, so a plain round's longest response is many times its median."""

    def _tokens(self, r: GenRequest) -> tuple[int, ...]:
        toks = super()._tokens(r)
        if r.seed is not None and r.seed % 8 == 0:
            toks = (*toks[:-1], *([toks[0]] * r.max_tokens))[: r.max_tokens]
        return toks


class FlatEngine(ScriptedEngine):
    """The scripted engine without a tail: every response is 20-27 tokens (by its seed)."""

    def _tokens(self, r: GenRequest) -> tuple[int, ...]:
        n = 20 + (r.seed or 0) % 8
        return (*tiny.encode("1," * n)[: n - 1], tiny.EOS_ID)


def test_adaptive_tail_batching_without_a_tail_runs_plain_rounds() -> None:
    """No tail (every response 20-27 tokens, as capped word-problem answers are: max/median
    under tau): the gate stays off, so every round is a plain synchronous one: P0 prompts x G,
    nothing aborted, deferred or long."""
    eng = FlatEngine()
    cfg = _cfg("Adaptive", steps=6)
    cfg.job.spec.algorithm.dynamic_sampling = False  # the flat answers all score 0
    drv = runtime.build_driver(cfg, [eng])
    drv.run()
    recs = drv.records
    assert len(recs) == 6
    for r in recs:
        assert r["len_max"] <= 4 * r["len_median"], r  # the workload really has no tail
        assert r["round_kind"] == "Short" and r["aborted"] == 0 and r["long_queue"] == 0, r
        assert r["overprovisioned"] is False and r["tail_gate_on"] is False, r
        assert r["kept"] == r["group_size"] * len(r["prompts"]), r
        assert 0 <= r["informative_groups"] <= len(r["prompts"]), r
    assert not eng.aborted_ids and drv.planner.gate.switches == 0
    assert drv.planner.long_rounds == 0


def test_adaptive_tail_batching_with_a_tail_races_and_defers() -> None:
    """A long tail: the first plain rounds straggle, the gate turns on within its window, and
    from then on short rounds race (aborts, deferrals) and the queue feeds a long round."""
    eng = TailEngine()
    drv = runtime.build_driver(_cfg("Adaptive", steps=8, fixed_group_size=8), [eng])
    drv.run()
    recs = drv.records
    assert recs[0]["overprovisioned"] is False and recs[0]["aborted"] == 0
    assert recs[0]["len_max"] > 4 * recs[0]["len_median"]  # the tail is measured
    on = [r["step"] for r in recs if r["overprovisioned"]]
    assert on and on[0] <= 2, [(r["step"], r["overprovisioned"]) for r in recs]
    assert all(r["aborted"] > 0 for r in recs if r["overprovisioned"])
    assert eng.aborted_ids and drv.planner.gate.active
    assert any(r["round_kind"] == "Long" for r in recs)


class HalfHopelessEngine(ScriptedEngine):
    """Prompts of odd n are always answered wrong (all-equal groups); the rest as scripted."""

    def _tokens(self, r: GenRequest) -> tuple[int, ...]:
        text = tiny.decode(list(r.prompt_ids[1:]))
        n = int(text.rstrip(":").split("-")[0])
        if n % 2:
            return (*tiny.encode("9," * 3), tiny.EOS_ID)
        return super()._tokens(r)


class HopelessTailEngine(ScriptedEngine):
    """As on the tiny task: the prompts of odd n ramble (the longest responses, so they lose
    the short rounds' race and run in long rounds) and are always wrong (no group trains)."""

    def _tokens(self, r: GenRequest) -> tuple[int, ...]:
        text = tiny.decode(list(r.prompt_ids[1:]))
        if int(text.rstrip(":").split("-")[0]) % 2:
            return (*tiny.encode("9," * 40), tiny.EOS_ID)[: r.max_tokens]
        return super()._tokens(r)


def test_long_rounds_that_train_nothing_are_retired_and_their_steps_train() -> None:
    """Long rounds of hopeless prompts give (almost) no informative group. With
    ``longRound.minYieldRatio`` 0 every due long round runs (a step each, nothing trained);
    at 0.25 the first runs, the next due ones are retired before the report (which then
    says Short, so nothing would scale up) and those steps train short rounds instead."""
    runs = {}
    for ratio in ("0", "0.25"):
        cfg = _cfg(steps=14, fixed_group_size=4)
        cfg.job.spec.tail_batching.prompt_overprovision = "2"
        cfg.job.spec.tail_batching.long_round.min_yield_ratio = ratio  # type: ignore[assignment]
        drv = runtime.build_driver(cfg, [HopelessTailEngine()])
        reports: list[StepReport] = []
        real = drv.controller.report
        drv.controller.report = lambda rep, _r=real, _l=reports: (_l.append(rep), _r(rep))[1]
        drv.run()
        runs[ratio] = (drv.records, reports, drv.planner)
    recs0, _, p0 = runs["0"]
    recs, reports, planner = runs["0.25"]
    longs0 = [r for r in recs0 if r["round_kind"] == "Long"]
    longs = [r for r in recs if r["round_kind"] == "Long"]
    # off: half the steps are long rounds, and they train little (4 prompts x 4 each)
    assert len(longs0) >= 3 and sum(r["informative_groups"] for r in longs0) <= len(longs0)
    assert p0.retired == 0 and all(r["retired_prompts"] == 0 for r in recs0)
    assert 1 <= len(longs) < len(longs0)
    retiring = [r for r in recs if r["retired_prompts"] > 0]
    assert retiring and planner.retired == sum(r["retired_prompts"] for r in recs) > 0
    for r in retiring:  # retired before its report: the report announces a short round
        assert r["next_round_kind"] == "Short" and reports[r["step"]].next_round_kind \
            is RoundKind.SHORT, r
    # the steps the long rounds took now train: more informative groups and samples
    assert sum(r["informative_groups"] for r in recs) > sum(
        r["informative_groups"] for r in recs0)
    assert sum(r["learner_samples"] for r in recs) > sum(r["learner_samples"] for r in recs0)


def test_a_resumed_run_retires_the_long_rounds_the_straight_run_retired(tmp_path: Path) -> None:
    """The yield's cost is each round's critical path in tokens, not seconds: a run resumed
    from a checkpoint (the yields restored with the planner) makes the same decisions."""
    cfg = _cfg(steps=12, fixed_group_size=4)
    cfg.job.spec.tail_batching.prompt_overprovision = "2"
    cfg.job.spec.checkpoint.every_steps = 4
    a = runtime.build_driver(cfg, [HopelessTailEngine()], checkpoint_dir=tmp_path)
    a.run()
    assert any(r["retired_prompts"] for r in a.records[4:])  # decisions after the resume
    assert all(r["critical_path_tokens"] > 0 for r in a.records)
    b = runtime.build_driver(cfg, [HopelessTailEngine()], checkpoint_dir=tmp_path)
    assert b.load_checkpoint(tmp_path / "step-000004") and b.step == 4
    b.run()
    keys = ("round_kind", "prompts", "retired_prompts", "retired_total", "critical_path_tokens")
    assert [{k: r[k] for k in keys} for r in b.records[4:]] == \
        [{k: r[k] for k in keys} for r in a.records[4:]]


@pytest.mark.parametrize("dynamic_sampling", [True, False])
def test_informative_groups_counts_groups_before_dynamic_sampling(
    dynamic_sampling: bool,
) -> None:
    """``informative_groups``: the kept groups whose rewards differ, counted before DAPO's
    dynamic sampling drops the others (with it on, exactly the groups trained on; with it
    off, fewer than the groups trained on when some are all-equal)."""
    cfg = _cfg(steps=3, fixed_group_size=4)
    cfg.job.spec.algorithm.dynamic_sampling = dynamic_sampling
    drv = runtime.build_driver(cfg, [HalfHopelessEngine()])
    drv.run()
    for r in drv.records:
        trained = r["learner_samples"] // r["group_size"]
        assert trained == len(r["prompts"]) - r["dropped_groups"], r
        if dynamic_sampling:
            assert r["informative_groups"] == trained, r
        else:
            assert r["dropped_groups"] == 0 and r["informative_groups"] <= trained, r
    assert sum(len(r["prompts"]) - r["informative_groups"] for r in drv.records) > 0
    assert sum(r["informative_groups"] for r in drv.records) > 0


def test_resume_from_checkpoint_continues_identically(tmp_path: Path) -> None:
    cfg = _cfg(steps=4)
    cfg.job.spec.checkpoint.every_steps = 2
    a = runtime.build_driver(cfg, [ScriptedEngine()], checkpoint_dir=tmp_path)
    a.run()
    b = runtime.build_driver(cfg, [ScriptedEngine()], checkpoint_dir=tmp_path)
    assert b.load_checkpoint(tmp_path / "step-000002") and b.step == 2
    b.run()
    keys = ("group_size", "round_kind", "prompts", "kept", "aborted", "reward", "len_max")
    assert [{k: r[k] for k in keys} for r in b.records[2:]] == \
        [{k: r[k] for k in keys} for r in a.records[2:]]
    sa, sb = a.learner.model.state_dict(), b.learner.model.state_dict()
    assert all((sa[k] - sb[k]).abs().max() < 1e-6 for k in sa)


def test_resume_takes_the_latest_checkpoint_the_plan_can_take(tmp_path: Path) -> None:
    """A driver resumes where the job's plan says it may (issue 32): the latest checkpoint of
    a step up to the plan's, never one past it (another run's, or one the operator's
    controller no longer knows), and from step 0 when there is none."""
    cfg = _cfg(steps=4)
    cfg.job.spec.checkpoint.every_steps = 1
    a = runtime.build_driver(cfg, [ScriptedEngine()], checkpoint_dir=tmp_path)
    a.run()
    assert [s for s, _ in a.checkpoints()] == [1, 2, 3, 4]
    b = runtime.build_driver(cfg, [ScriptedEngine()], checkpoint_dir=tmp_path)
    assert b.load_checkpoint(at_most=2) and b.step == 2
    assert b.records == a.records[:2]  # that checkpoint's, not the latest's
    c = runtime.build_driver(cfg, [ScriptedEngine()], checkpoint_dir=tmp_path)
    assert not c.load_checkpoint(at_most=0) and c.step == 0
    (tmp_path / "step-000003" / "state.json").unlink()  # an incomplete one is no checkpoint
    d = runtime.build_driver(cfg, [ScriptedEngine()], checkpoint_dir=tmp_path)
    assert d.load_checkpoint(at_most=3) and d.step == 2
    e = runtime.build_driver(cfg, [ScriptedEngine()], checkpoint_dir=tmp_path)
    assert e.load_checkpoint() and e.step == 4  # the in-process controller: the latest
    # the latest within the plan's step is taken, not a newer folder another run left
    (tmp_path / "step-000004").rename(tmp_path / "step-000009")
    (tmp_path / "latest").write_text("step-000002\n")
    f = runtime.build_driver(cfg, [ScriptedEngine()], checkpoint_dir=tmp_path)
    assert f.load_checkpoint(at_most=9) and f.step == 2


class StopAt(InProcessController):
    """The in-process plan logic, except that the answer to the report of step ``at - 1``
    says ``done`` (as the operator answers a job Kueue evicted, within its eviction grace)."""

    def __init__(self, cfg: RunConfig, at: int) -> None:
        super().__init__(cfg.controller_config(), cfg.total_steps, replicas=1)
        self.at = at

    def report(self, report: StepReport) -> Plan:
        plan = super().report(report)
        return plan.model_copy(update={"done": True}) if plan.step == self.at else plan


def test_a_plan_that_says_done_mid_job_stops_the_driver_whose_checkpoint_resumes_there(
    tmp_path: Path,
) -> None:
    """What a driver does with the answer an evicted job's report gets (checkpoint.eviction-
    GraceSeconds): it stops after that step; the pod's entrypoint then checkpoints (as after
    any run); the next attempt, whose plan is at that step, resumes from it and trains on
    exactly as a run that was never stopped."""
    cfg = _cfg(steps=4)
    cfg.job.spec.checkpoint.every_steps = 100  # no periodic checkpoint: only the stop's
    straight = runtime.build_driver(cfg, [ScriptedEngine()])
    straight.run()
    a = runtime.build_driver(cfg, [ScriptedEngine()], controller=StopAt(cfg, 2),
                             checkpoint_dir=tmp_path)
    a.run()
    assert a.step == 2 and len(a.records) == 2
    a.save_checkpoint()  # the entrypoint's, after run() (rlpacer_trainer.pod)
    assert [s for s, _ in a.checkpoints()] == [2]
    b = runtime.build_driver(cfg, [ScriptedEngine()], checkpoint_dir=tmp_path)
    assert b.load_checkpoint(at_most=2) and b.step == 2
    b.run()
    keys = ("group_size", "round_kind", "prompts", "kept", "aborted", "reward", "len_max")
    assert [{k: r[k] for k in keys} for r in b.records] == \
        [{k: r[k] for k in keys} for r in straight.records]
    sa, sb = straight.learner.model.state_dict(), b.learner.model.state_dict()
    assert all((sa[k] - sb[k]).abs().max() < 1e-6 for k in sa)


def test_step_records_policy_version_and_each_engines_work() -> None:
    engines = [ScriptedEngine(0), ScriptedEngine(1)]
    drv = runtime.build_driver(_cfg(steps=3), engines)
    v0 = drv.policy_version
    assert v0 == weights.fingerprint(drv.learner.model.state_dict().items())
    drv.run()
    held = v0
    for r in drv.records:
        # each update changes the weights; every engine served the step at the version it held
        assert r["policy_version"] != held
        assert [e["replica"] for e in r["engines"]] == [0, 1]
        assert all(e["policy_version"] == held for e in r["engines"])
        assert sum(e["responses"] for e in r["engines"]) >= r["kept"]
        assert all(e["tokens"] > 0 for e in r["engines"])
        held = r["policy_version"]
    assert all(e.version == drv.policy_version for e in engines)


def test_sync_fails_when_an_engine_does_not_hold_the_learners_weights() -> None:
    class Stale(ScriptedEngine):
        def load_weights(self, blob: bytes) -> float:
            self.loads += 1  # drops the weights on the floor
            return 0.0

    with pytest.raises(RuntimeError, match=r"engines \(replica, version\) \[\(1, None\)\]"):
        runtime.build_driver(_cfg(steps=1), [ScriptedEngine(0), Stale(1)])


# --- elastic long rounds: join, dispatch by load, release, faults ------------------------------

class LoggedEngine(ScriptedEngine):
    """A scripted engine that logs what the driver asks of it, in order, into ``log``."""

    def __init__(self, replica: int, log: list[tuple[object, ...]]) -> None:
        super().__init__(replica)
        self.log = log
        self.down = False
        self.ids: list[str] = []  # every request submitted to it, in order

    def submit(self, requests: Sequence[GenRequest]) -> None:
        self.log.append(("submit", self.replica, self.version, len(requests)))
        self.ids += [r.request_id for r in requests]
        super().submit(requests)

    def load_weights(self, blob: bytes) -> float:
        out = super().load_weights(blob)
        self.log.append(("load", self.replica, self.version))
        return out

    def shutdown(self) -> None:
        self.log.append(("shutdown", self.replica, self.pending()))
        self.down = True


class ElasticController(InProcessController):
    """The in-process plan logic with an operator's capacity: a long round's plan names
    ``long_usable`` (``None``: no usableReplicas field, as from an older operator), a short
    round's ``short``; every report is logged (its place among the engines' calls)."""

    def __init__(self, cfg: RunConfig, log: list[tuple[object, ...]], *, short: list[int],
                 long_usable: list[int] | None, long_ready: int = 2) -> None:
        super().__init__(cfg.controller_config(), cfg.total_steps, replicas=len(short))
        self.log, self.short, self.long_usable, self.long_ready = (
            log, short, long_usable, long_ready)

    def _to_plan(self, cp: ControlPlan) -> Plan:
        plan = super()._to_plan(cp)
        if cp.round_kind is RoundKind.LONG:
            cap = RolloutCapacity(desired_replicas=self.long_ready, ready_replicas=self.long_ready,
                                  state=RolloutState.READY, usable_replicas=self.long_usable)
        else:
            cap = RolloutCapacity(desired_replicas=len(self.short),
                                  ready_replicas=len(self.short), state=RolloutState.READY,
                                  usable_replicas=self.short)
        return plan.model_copy(update={"rollout": cap})

    def report(self, report: StepReport) -> Plan:
        self.log.append(("report", report.step, report.round_kind.value))
        return super().report(report)

    def release(self, attempt: int, step: int) -> bool:
        self.log.append(("release", attempt, step))
        return True


def _elastic(steps: int, *, base: int = 1, long_usable: list[int] | None = None,
             offered: set[int] | None = None, engine_cls: type[LoggedEngine] = LoggedEngine,
             long_ready: int = 2, wide: bool = False, fill: int | None = None,
             base_engines: list[LoggedEngine] | None = None,
             ) -> tuple[Any, list[tuple[object, ...]], list[LoggedEngine]]:
    cfg = _cfg(steps=steps)
    cfg.job.spec.tail_batching.long_round.fill_prompts = fill
    if wide:  # tailBatching.longRound.tensorParallelSize (1: the example's CPU engines)
        cfg.job.spec.tail_batching.long_round.tensor_parallel_size = 1
        cfg.job.spec.tail_batching.long_round.rollout_replicas = base + 1
    log: list[tuple[object, ...]] = []
    made: list[LoggedEngine] = []

    def factory(r: int) -> LoggedEngine:
        e = engine_cls(r, log)
        log.append(("start", r))
        made.append(e)
        return e

    ctl = ElasticController(cfg, log, short=list(range(base)), long_usable=long_usable,
                            long_ready=long_ready)
    engines = [LoggedEngine(i, log) for i in range(base)]
    if base_engines is not None:
        base_engines += engines
    drv = runtime.build_driver(cfg, engines, controller=ctl,
                               engine_factory=factory,
                               offered_replicas=(lambda: set(range(8))) if offered is None
                               else (lambda: offered))
    drv.join_wait_s = 0.0
    return drv, log, made


def test_long_round_joins_an_engine_that_serves_only_at_the_learners_version() -> None:
    drv, log, made = _elastic(6, long_usable=[0, 1])
    drv.run()
    longs = [r for r in drv.records if r["round_kind"] == "Long"]
    assert longs, "the scripted run has a long round"
    held = {r["step"]: prev["policy_version"] for prev, r in zip(drv.records, drv.records[1:],
                                                                 strict=False)}
    for r in drv.records:
        if r["round_kind"] == "Long":
            assert r["replicas"] == [0, 1]
            added = [e for e in r["engines"] if e["replica"] == 1]
            # the added replica generated part of the long round, at the weights all held
            assert added and added[0]["responses"] > 0
            assert {e["policy_version"] for e in r["engines"]} == {held[r["step"]]}
        else:
            assert r["replicas"] == [0] and [e["replica"] for e in r["engines"]] == [0]
    # every engine of replica 1 loaded the learner's weights before its first request, and
    # every request it got came at the version the driver held
    assert made and all(e.replica == 1 for e in made)
    first_load = log.index(next(x for x in log if x[:2] == ("load", 1)))
    first_submit = log.index(next(x for x in log if x[:2] == ("submit", 1)))
    assert log.index(("start", 1)) < first_load < first_submit
    assert all(x[2] is not None for x in log if x[:2] == ("submit", 1))
    # released (idle) before the report that lets the operator scale down
    for r in longs:
        if r["next_round_kind"] == "Short":
            i_report = log.index(("report", r["step"], "Long"))
            shut = [i for i, x in enumerate(log) if x[:2] == ("shutdown", 1)]
            assert any(i < i_report for i in shut)
            assert all(log[i][2] == 0 for i in shut)  # nothing in flight on it
    assert all(e.down for e in made) and 1 not in drv.pool
    assert [w for w, _ in drv.events] == ["joined", "released"] * len(made)


def test_wide_long_round_engines_run_the_long_rounds_alone_short_rounds_skip_them() -> None:
    """With wide long-round engines the long round goes to the replicas it added (never to
    the rollout's own engine), short rounds to the rollout's; when no wide engine joins, the
    long round runs on the rollout's (it never waits on nothing)."""
    drv, _, made = _elastic(6, long_usable=[0, 1], wide=True)
    assert drv.wide_long_rounds
    drv.run()
    longs = [r for r in drv.records if r["round_kind"] == "Long"]
    assert longs and made
    for r in drv.records:
        served = sorted(e["replica"] for e in r["engines"])
        want = [1] if r["round_kind"] == "Long" else [0]
        assert r["replicas"] == want and served == want, r
    assert len(made) == len(longs)  # one wide engine per long round, released after each

    drv, _, made = _elastic(6, long_usable=[0, 1], offered={0}, wide=True)
    drv.run()
    assert not made and any(r["round_kind"] == "Long" and r["replicas"] == [0]
                            for r in drv.records)


def test_a_filled_long_round_on_wide_engines_runs_its_fill_on_the_rollouts_engine() -> None:
    """``fillPrompts`` with wide long-round engines: a filled long round's queued prompts go
    to the wide engine (replica 1) and its fill to the rollout's own engine (replica 0),
    which would otherwise wait through the round; every request of the round lands on its
    class's engine, and both engines answer part of it. Short rounds stay on replica 0."""
    base: list[LoggedEngine] = []
    drv, _, made = _elastic(10, long_usable=[0, 1], wide=True, fill=4, base_engines=base)
    plans = []
    start = drv.planner.start_round

    def spy(*a: Any, **kw: Any) -> Any:
        plans.append(start(*a, **kw))
        return plans[-1]

    drv.planner.start_round = spy
    drv.run()
    filled = [p for p in plans if p.kind is RoundKind.LONG and p.fill]
    assert filled and made

    def served(engines: Sequence[LoggedEngine], index: int) -> set[int]:
        return {int(rid.split("-")[1][1:]) for e in engines for rid in e.ids
                if rid.startswith(f"r{index}-")}

    for plan in filled:
        on_base, on_wide = served(base, plan.index), served(made, plan.index)
        assert on_base == set(plan.fill), plan.index
        assert on_wide == set(plan.prompts) - set(plan.fill), plan.index
    for plan in plans:
        if plan.kind is RoundKind.SHORT:
            assert served(made, plan.index) == set() and served(base, plan.index)
    for r in drv.records:
        if r["round_kind"] == "Long" and r["fill_prompts"]:
            by = {e["replica"]: e["responses"] for e in r["engines"]}
            assert by.get(0, 0) > 0 and by.get(1, 0) > 0, r["engines"]
            assert r["replicas"] == [0, 1], r["replicas"]


def test_release_when_fits_gives_a_wide_engine_back_at_its_long_rounds_end() -> None:
    """``releaseWhenFits`` with wide long-round engines: the wide engine stays to the long
    round's end (it is there for the tail), then it is shut down and the operator asked to
    scale back (``release``) before the step's training and report, not at the report; the
    record says when. Without the field the operator is never asked."""
    for on in (False, True):
        drv, log, made = _elastic(6, long_usable=[0, 1], wide=True)
        drv.cfg.job.spec.tail_batching.long_round.release_when_fits = on
        drv.release_when_fits = drv.cfg.release_when_fits
        drv.run()
        longs = [r for r in drv.records if r["round_kind"] == "Long"]
        assert longs and made
        asked = [x for x in log if x[0] == "release"]
        if not on:
            assert not asked and all(r["released_mid_round"] == [] for r in longs)
            continue
        for r in longs:
            if r["next_round_kind"] != "Short":
                continue
            t, *gone = r["released_mid_round"]
            assert gone == [1] and t == pytest.approx(r["seconds_rollout"], abs=1e-3), r
            i_release = log.index(("release", r["attempt"], r["step"]))
            i_report = log.index(("report", r["step"], "Long"))
            # after the wide engine's last request of the round and its shutdown
            last_submit = max(i for i, x in enumerate(log[:i_report]) if x[:2] == ("submit", 1))
            shut = max(i for i, x in enumerate(log[:i_report]) if x[:2] == ("shutdown", 1))
            assert last_submit < shut < i_release < i_report
            assert log[shut][2] == 0  # nothing in flight on it
            assert sorted(e["replica"] for e in r["engines"]) == [1]  # it ran the round alone
        assert len(asked) == sum(r["next_round_kind"] == "Short" for r in longs) > 0


class MidRoundController(ElasticController):
    """A long round's scale-up that is still pending when the round starts: its plan names
    rollout-0 alone (ScalingUp) until the driver has read it ``ready_after`` times during the
    round; from then on replica 1 is usable too."""

    def __init__(self, *args: Any, ready_after: int = 2, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.ready_after, self.reads = ready_after, 0

    def _to_plan(self, cp: ControlPlan) -> Plan:
        plan = super()._to_plan(cp)
        if cp.round_kind is not RoundKind.LONG:
            self.reads = 0
            return plan
        self.reads += 1
        if self.reads <= self.ready_after:
            cap = RolloutCapacity(desired_replicas=2, ready_replicas=1,
                                  state=RolloutState.SCALING_UP, usable_replicas=[0])
            return plan.model_copy(update={"rollout": cap})
        return plan


def _mid_round_run(monkeypatch: pytest.MonkeyPatch, *, wide: bool, fill: int | None = None,
                   steps: int = 6) -> tuple[
        Any, LoggedEngine, list[LoggedEngine], list[tuple[object, ...]]]:
    """A 6-step run with ``joinMidRound`` (``wide``: and a wide long-round engine) whose long
    round's replica 1 becomes usable during the round (:class:`MidRoundController`); every
    engine step takes 2 ms. Returns the driver, rollout-0's engine, the engines started for
    replica 1, and the log."""
    from rlpacer_trainer import driver as driver_mod

    monkeypatch.setattr(driver_mod, "MID_ROUND_POLL_S", 0.0)
    cfg = _cfg(steps=steps)
    lr = cfg.job.spec.tail_batching.long_round
    lr.join_mid_round = True
    lr.fill_prompts = fill
    if wide:
        lr.tensor_parallel_size, lr.rollout_replicas = 1, 2
    log: list[tuple[object, ...]] = []
    made: list[LoggedEngine] = []

    def factory(r: int) -> LoggedEngine:
        e = LoggedEngine(r, log)
        e.step_s = 0.002
        made.append(e)
        return e

    base = LoggedEngine(0, log)
    base.step_s = 0.002
    ctl = MidRoundController(cfg, log, short=[0], long_usable=[0, 1])
    drv = runtime.build_driver(cfg, [base], controller=ctl, engine_factory=factory,
                               offered_replicas=lambda: {0, 1})
    drv.join_wait_s = 0.0
    drv.run()
    return drv, base, made, log


def test_a_replica_joining_mid_round_takes_running_requests_with_their_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``joinMidRound``: the long round starts on rollout-0 while its scale-up pends (no
    wait); replica 1 becomes usable during it, its engine starts in the background, gets the
    learner's weights and takes a share of the round's unfinished requests, each with the
    tokens rollout-0 had generated, and finishes them: every moved response is the one the
    request would have given (the scripted engine checks the prefix is its own), and each
    (prompt, index) is answered once; the step's record counts the moves."""
    drv, base, made, _ = _mid_round_run(monkeypatch, wide=False)
    longs = [r for r in drv.records if r["round_kind"] == "Long"]
    assert longs and made
    moved = [r for r in longs if r["moved_requests"] > 0]
    assert moved, [(r["step"], r["joined_mid_round"]) for r in longs]
    for r in moved:
        assert r["seconds_capacity_wait"] < 0.5, r  # it never waited for the scale-up
        assert [j[0] for j in r["joined_mid_round"]] == [1] and r["joined_mid_round"][0][1] > 0
        served = {e["replica"]: e for e in r["engines"]}
        assert served[1]["responses"] > 0 and served[0]["responses"] > 0, r["engines"]
        assert r["moved_tokens"] > 0
    # every taken request went on with its tokens: some had generated some already
    assert any(len(t) > 0 for t in base.taken.values()), base.taken
    assert sum(r["moved_requests"] for r in drv.records) == len(base.taken)
    assert sum(r["moved_tokens"] for r in drv.records) == sum(map(len, base.taken.values()))
    print([(r["step"], r["joined_mid_round"], r["moved_requests"], r["moved_tokens"])
           for r in longs])
    # each response answered once across both engines: no loss, no double
    for r in drv.records:
        assert len(r["prompts"]) == len(set(r["prompts"]))
    assert all(r["moved_requests"] == 0 for r in drv.records if r["round_kind"] == "Short")


def test_usable_replicas_with_a_gap_and_an_unjoined_pod() -> None:
    # the plan names 0 and 2 (1 is pending): only 2 joins; 2 also fails to join if its pod
    # is not in Ray, and the long round runs on what is there
    drv, log, made = _elastic(6, long_usable=[0, 2], long_ready=3)
    drv.run()
    longs = [r for r in drv.records if r["round_kind"] == "Long"]
    assert longs and all(r["replicas"] == [0, 2] for r in longs)
    assert all(x[1] != 1 for x in log if x[0] in ("start", "submit"))
    assert {e.replica for e in made} == {2}

    drv, log, made = _elastic(6, long_usable=[0, 2], long_ready=3, offered={0})
    drv.run()
    assert not made and all(r["replicas"] == [0] for r in drv.records)


def test_a_joining_engine_without_the_learners_weights_is_never_used() -> None:
    class Stale(LoggedEngine):
        def load_weights(self, blob: bytes) -> float:
            self.log.append(("load", self.replica, None))
            return 0.0

    drv, log, made = _elastic(6, long_usable=[0, 1], engine_cls=Stale)
    drv.run()
    assert made and all(e.down for e in made)
    assert not any(x[:2] == ("submit", 1) for x in log)
    assert all(r["replicas"] == [0] for r in drv.records)


def test_plan_without_usable_replicas_uses_ready_within_desired() -> None:
    drv, _, _ = _elastic(1)
    cap = RolloutCapacity(desired_replicas=1, ready_replicas=2)  # scaled down, pod not gone
    plan = Plan(step=0, group_size=4, rollout=cap)
    assert drv.usable_replicas(plan) == [0]
    cap = RolloutCapacity(desired_replicas=3, ready_replicas=2, state=RolloutState.TIMED_OUT)
    assert drv.usable_replicas(plan.model_copy(update={"rollout": cap})) == [0, 1]
    cap = RolloutCapacity(desired_replicas=3, ready_replicas=2, usable_replicas=[2, 0])
    assert drv.usable_replicas(plan.model_copy(update={"rollout": cap})) == [0, 2]
    # an older operator's long round: 0..ready-1 join
    drv, _, made = _elastic(6, long_usable=None)
    drv.run()
    assert made and any(r["replicas"] == [0, 1] for r in drv.records)


def test_dispatch_goes_to_the_least_loaded_engine() -> None:
    log: list[tuple[object, ...]] = []
    engines = [LoggedEngine(i, log) for i in range(3)]
    drv = runtime.build_driver(_cfg(steps=1), engines)
    ids = tuple(tiny.prompt_ids(drv.problems[0].prompt))

    def req(n: int) -> tuple[GenRequest, int, int]:
        return GenRequest(f"x{n}", ids, 8, 1.0, n), 0, n

    drv._dispatch([req(n) for n in range(4)])  # idle: spread, lowest replica first
    assert [len(e.live) for e in engines] == [2, 1, 1]
    engines[0].live.clear()  # replica 0 finished its two
    for r in ("x0", "x3"):
        del drv._pending[r]
    drv._dispatch([req(n) for n in range(4, 9)])
    # 0 had none outstanding, 1 and 2 one each: 0 catches up first, then they take turns
    assert [len(e.live) for e in engines] == [3, 2, 2]
    assert sum(1 for e, _, _ in drv._pending.values() if e == 0) == 3


def test_length_dispatch_sends_the_predicted_longest_first_and_balances_tokens() -> None:
    """``tailBatching.lengthPrior.dispatch``: prompt 0 is predicted 100x longer than the
    others. By count, alternating submissions put both its requests on replica 0; by predicted
    length they go first, one to each engine, and the short ones follow."""
    from rlpacer.api.job import LengthPriorSpec

    placed = {}
    for dispatch in (False, True):
        log: list[tuple[object, ...]] = []
        engines = [LoggedEngine(i, log) for i in range(2)]
        cfg = _cfg(steps=1)
        cfg.job.spec.tail_batching.length_prior = LengthPriorSpec(dispatch=dispatch)
        drv = runtime.build_driver(cfg, engines)
        drv.prior.observe(0, [4000, 5000, 6000])
        for p in (1, 2, 3):
            drv.prior.observe(p, [40, 50, 60])
        ids = tuple(tiny.prompt_ids(drv.problems[0].prompt))
        order = [0, 1, 0, 1, 2, 3, 2, 3]
        drv._dispatch([(GenRequest(f"r{n}", ids, 8, 1.0, n), p, n)
                       for n, p in enumerate(order)])
        placed[dispatch] = {r: (e, p) for r, (e, p, _) in drv._pending.items()}
        if dispatch:  # the predicted longest is the first each engine was given
            assert [drv._pending[next(iter(e.live))][1] for e in engines] == [0, 0]
    by_count = sorted(e for e, p in placed[False].values() if p == 0)
    by_length = sorted(e for e, p in placed[True].values() if p == 0)
    assert by_count == [0, 0] and by_length == [0, 1]
    # four requests each either way: predicted tokens 5,000 + 3 x 50 on each engine
    for d in (False, True):
        assert sorted(Counter(e for e, _ in placed[d].values()).values()) == [4, 4]


def test_an_engine_dying_mid_round_loses_nothing_and_restarts() -> None:
    class Dies(LoggedEngine):
        polls = 0
        lost = 0

        def poll(self, max_steps: int = 16) -> list[Finished]:
            Dies.polls += 1
            if Dies.polls == 3 and self.replica == 1:
                Dies.lost = len(self.live)
                self.live.clear()
                raise EngineDied("actor died")
            return super().poll(max_steps)

    cfg = _cfg(steps=4, tail_batching=False, fixed_group_size=4)
    log: list[tuple[object, ...]] = []
    made: list[LoggedEngine] = []

    def factory(r: int) -> LoggedEngine:
        made.append(LoggedEngine(r, log))
        return made[-1]

    drv = runtime.build_driver(cfg, [LoggedEngine(0, log), Dies(1, log)], engine_factory=factory,
                               offered_replicas=lambda: {0, 1})
    rec = drv.run_step(drv.controller.plan())
    # nothing lost: every response of every prompt was kept (no tail batching) exactly once
    assert rec["kept"] == len(rec["prompts"]) * 4 and rec["aborted"] == 0
    assert ("died", 1) in drv.events and rec["replicas"] == [0, 1] and Dies.lost > 0
    died = [e for e in rec["engines"] if e.get("died")]
    assert [e["replica"] for e in died] == [1] and died[0]["responses"] > 0
    assert died[0]["redispatched"] == Dies.lost  # each unfinished request went on, counted
    assert sum(e["responses"] for e in rec["engines"]) == rec["kept"]
    drv.run()  # the next step starts replica 1's engine again (its pod is still offered)
    assert [r.replica for r in made] == [1] and drv.pool[1] is made[0]
    assert all(r["replicas"] == [0, 1] for r in drv.records)
    assert drv.records[-1]["engines"][1]["responses"] > 0


def test_an_engine_that_died_between_steps_is_started_again() -> None:
    class Killable(LoggedEngine):
        def info(self) -> EngineInfo:
            if self.down:
                raise EngineDied("actor died")
            return super().info()

    cfg = _cfg(steps=3, tail_batching=False, fixed_group_size=4)
    log: list[tuple[object, ...]] = []
    made: list[LoggedEngine] = []

    tries: list[int] = []

    def factory(r: int) -> LoggedEngine:
        tries.append(r)
        if len(tries) == 1:  # placed on the pod's old node just before it was marked dead
            raise EngineDied("the actor died because its node has died")
        made.append(LoggedEngine(r, log))
        return made[-1]

    gone = Killable(1, log)
    drv = runtime.build_driver(cfg, [LoggedEngine(0, log), gone], engine_factory=factory,
                               offered_replicas=lambda: {0, 1})
    drv.run_step(drv.controller.plan())
    gone.down = True  # its pod went away after the step
    drv.run()
    assert [w for w, _ in drv.events] == ["died", "joined"] and made[0].replica == 1
    assert tries == [1, 1]  # a start that died is tried again
    assert not any(x[:2] == ("submit", 1) and x[2] is None for x in log)
    for r in drv.records:
        assert r["replicas"] == [0, 1] and [e["replica"] for e in r["engines"]] == [0, 1]


def test_an_engine_dying_at_the_weight_sync_is_started_again() -> None:
    class DiesAtSync(LoggedEngine):
        def load_weights(self, blob: bytes) -> float:
            if self.loads >= 1:  # after the start-up sync
                raise EngineDied("actor died")
            return super().load_weights(blob)

    cfg = _cfg(steps=3, tail_batching=False, fixed_group_size=4)
    log: list[tuple[object, ...]] = []
    made: list[LoggedEngine] = []

    def factory(r: int) -> LoggedEngine:
        made.append(LoggedEngine(r, log))
        return made[-1]

    drv = runtime.build_driver(cfg, [LoggedEngine(0, log), DiesAtSync(1, log)],
                               engine_factory=factory, offered_replicas=lambda: {0, 1})
    drv.run()
    assert [w for w, _ in drv.events] == ["died", "joined"] and len(made) == 1
    assert [r["replicas"] for r in drv.records] == [[0, 1]] * 3
    assert all(e.version == drv.policy_version for e in (drv.pool[0], drv.pool[1]))


def test_rewards_run_in_the_pool_failures_scored_and_counted_per_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user reward through the driver: the first call hangs (killed at the 1 s timeout),
    wrong chains kill their worker; both score failureScore and are counted in the step's
    record, and right chains score 1.0."""
    (tmp_path / "rlpacer_drv_reward.py").write_text(textwrap.dedent(f'''
        import os, time
        MARK = {str(tmp_path / "hung-once")!r}

        def score(response, answer, prompt, **meta):
            assert prompt.endswith(":") and answer.endswith(",")
            try:
                os.close(os.open(MARK, os.O_CREAT | os.O_EXCL))  # the first call, once
            except FileExistsError:
                pass
            else:
                time.sleep(1e9)
            if response != answer:
                os._exit(1)
            return 1.0
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _cfg(steps=2, tail_batching=False, fixed_group_size=4)
    cfg.job.spec.algorithm.dynamic_sampling = False
    cfg.job.spec.reward.type = "rlpacer_drv_reward:score"
    cfg.job.spec.reward.timeout_seconds = 1
    cfg.job.spec.reward.failure_score = "-1"
    drv = runtime.build_driver(cfg, [ScriptedEngine()])
    try:
        recs = drv.run()
    finally:
        drv.close()
    assert [r["reward_timeouts"] for r in recs] == [1, 0]
    assert 1.0 <= recs[0]["seconds_reward"] < 3.0
    for r in recs:
        assert r["reward_calls"] == r["kept"] == 16
        assert r["reward_errors"] == 0 and r["reward_busy_s"] > 0
        right = r["accuracy"] * r["kept"]
        assert r["reward_crashes"] + r["reward_timeouts"] == r["kept"] - right
        assert r["reward_worker_restarts"] == r["reward_crashes"] + r["reward_timeouts"]
        assert r["reward"] == pytest.approx((right - (r["kept"] - right)) / r["kept"])
    assert 0 < sum(r["reward_crashes"] for r in recs) < 32


def test_length_context_reports_the_next_rounds_risk_and_sagc_takes_it() -> None:
    """``tailBatching.lengthPrior.context``: from the first step on (the prior has seen a
    round) each report names the next round's predicted straggler probability at every
    candidate G, computed from the prompts the planner launches next, and the plan logic's
    SAGC files each step under its context; off, no report carries one."""
    from rlpacer.api.job import LengthPriorSpec
    from rlpacer.control.sagc import SAGCController

    for on in (False, True):
        cfg = _cfg(steps=10)
        cfg.job.spec.tail_batching.length_prior = LengthPriorSpec(context=on)
        drv = runtime.build_driver(cfg, [ScriptedEngine()])
        sent: list[StepReport] = []
        report = drv.controller.report

        def spy(r: StepReport, report=report, sent=sent) -> Plan:  # type: ignore[no-untyped-def]
            sent.append(r)
            return report(r)

        drv.controller.report = spy  # type: ignore[method-assign]
        drv.run()
        ctl = drv.controller.jc.controller
        assert isinstance(ctl, SAGCController) and len(sent) == 10
        filed = sum(n for n, _ in ctl.context_counts())
        if not on:
            assert all(r.next_straggler_risk is None for r in sent) and filed == 0
            continue
        cands = [int(g) for g in cfg.spec.group_control.candidates]
        for r in sent[:-1]:  # the last step's report has no next round
            risk = r.next_straggler_risk
            assert risk is not None and [x.group_size for x in risk] == cands
            assert all(0.0 <= x.probability <= 1.0 for x in risk)
        # every short round after the first two (no context yet, then no history to split
        # at) is filed under a half (long rounds do not feed SAGC)
        shorts = sum(r.round_kind is RoundKind.SHORT for r in sent)
        assert filed >= shorts - 2 > 0


def test_the_length_priors_forgetting_follows_the_spec_through_a_checkpoint(
        tmp_path: Path) -> None:
    """``tailBatching.lengthPrior.halfLifeGroups``: the driver's prior discounts each group's
    evidence by the groups trained since (without it, every response weighs one), a resumed
    driver's prior is the straight run's, and the spec's half-life, not the checkpoint's,
    applies on resume."""
    from rlpacer.api.job import LengthPriorSpec

    runs = {}
    for half_life in (None, 8):
        cfg = _cfg(steps=6)
        cfg.job.spec.checkpoint.every_steps = 3
        cfg.job.spec.tail_batching.length_prior = LengthPriorSpec(half_life_groups=half_life)
        ckpt = tmp_path / str(half_life)
        a = runtime.build_driver(cfg, [ScriptedEngine()], checkpoint_dir=ckpt)
        a.run()
        assert a.prior.half_life == half_life and a.prior.groups > 16
        state = a.prior.state_dict()
        weights = [(a.prior._own(int(p))[0], n) for p, n in state["count"].items()]
        if half_life is None:
            assert all(w == n for w, n in weights)
        else:  # every prompt but the last one observed has aged
            assert sum(w < n for w, n in weights) >= len(weights) - 1
        b = runtime.build_driver(cfg, [ScriptedEngine()], checkpoint_dir=ckpt)
        assert b.load_checkpoint(ckpt / "step-000003") and b.step == 3
        b.run()
        assert b.prior.state_dict() == state
        runs[half_life] = (cfg, ckpt)
    cfg, _ = runs[8]
    _, plain = runs[None]  # a checkpoint of a prior without forgetting, resumed with it
    c = runtime.build_driver(cfg, [ScriptedEngine()], checkpoint_dir=plain)
    assert c.load_checkpoint(plain / "step-000003") and c.prior.half_life == 8


class _SlowScriptedEngine(ScriptedEngine):
    """A scripted engine whose decode steps take a few milliseconds, so that rewards of the
    groups that complete early are in before the round's last response; it answers every
    prompt whose chain length is a multiple of 3 correctly (groups DAPO drops)."""

    def _tokens(self, r: GenRequest) -> tuple[int, ...]:
        n, k = (int(x) for x in tiny.decode(list(r.prompt_ids[1:])).rstrip(":").split("-"))
        if n % 3 == 0:
            return (*tiny.encode(task.chain(n, k)), tiny.EOS_ID)[: r.max_tokens]
        return super()._tokens(r)

    def poll(self, max_steps: int = 16) -> list[Finished]:
        import time

        time.sleep(0.004)
        return super().poll(max_steps=1)


@pytest.mark.parametrize("dynamic", [True, False])
def test_stream_training_trains_groups_mid_round_and_takes_the_same_update(
        dynamic: bool) -> None:
    """``trainer.streamTraining``: each group goes to the learner once it is complete and
    scored, while the round still generates; the batch the step trains on (its order and
    positions, DAPO's dropped groups, refill rounds) is the one the whole step would take, so
    the weights after every step equal the unstreamed run's. Same seeds, same responses."""
    runs: dict[bool, Any] = {}
    for stream in (False, True):
        cfg = _cfg(steps=4)
        cfg.job.spec.algorithm.dynamic_sampling = dynamic
        cfg.job.spec.trainer.stream_training = stream
        # parts go over once they fill a micro-batch: small ones here, so that several do
        # while the rounds generate
        cfg.job.spec.trainer.micro_batch_tokens = 256
        drv = runtime.build_driver(cfg, [_SlowScriptedEngine(0), _SlowScriptedEngine(1)])
        start = {k: v.clone() for k, v in drv.learner.model.state_dict().items()}
        drv.run()
        runs[stream] = (drv.records, drv.learner.model.state_dict())
    (off, w_off), (on, w_on) = runs[False], runs[True]
    for a, b in zip(off, on, strict=True):
        for key in ("prompts", "reward", "kept", "dropped_groups", "refills", "round_kind",
                    "learner_samples"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert not a["stream_training"] and a["streamed_in_rollout"] == 0
        assert b["stream_training"]
        # every sample of the batch was streamed (none trained whole instead)
        assert b["learner_streamed"] == b["learner_samples"], b
        assert "learner_stream_refused" not in b
        assert b["learner_loss"] == pytest.approx(a["learner_loss"], rel=1e-4, abs=1e-6)
    # groups were handed over while their rounds were still generating
    assert sum(r["streamed_in_rollout"] for r in on) > 0
    assert sum(r["seconds_train_streamed"] for r in on) > 0
    if dynamic:
        assert sum(r["dropped_groups"] for r in on) > 0  # the drops were exercised
    # equal up to float summation order: L2 over all weights, against the run's update
    moved = sum(float((w_off[k] - start[k]).double().pow(2).sum()) for k in start) ** 0.5
    off_by = sum(float((w_on[k] - w_off[k]).double().pow(2).sum()) for k in start) ** 0.5
    assert moved > 1e-3
    assert off_by < 1e-3 * moved, (off_by, moved)


def test_a_wide_engine_joining_mid_round_takes_the_whole_long_round(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``joinMidRound`` with wide long-round engines: the long round starts on rollout-0's
    engine (no wide engine is up yet), and when the wide one joins it takes every
    unfinished request with its tokens; rollout-0's engine gets nothing more of it."""
    drv, base, made, log = _mid_round_run(monkeypatch, wide=True)
    moved = [r for r in drv.records if r["moved_requests"] > 0]
    assert moved and made
    for r in moved:
        # everything unfinished at the join went to the wide engine: rollout-0 had nothing
        # left in flight, and what it answered it had finished before the join
        assert r["moved_requests"] == len(base.taken)
        assert base.pending() == 0
        assert {e["replica"] for e in r["engines"]} == {0, 1}
    # from the wide engine's first request to the long round's report, nothing to rollout-0
    first_move = next(i for i, x in enumerate(log) if x[:2] == ("submit", 1))
    report = log.index(("report", moved[0]["step"], "Long"))
    assert first_move < report
    assert not any(x[:2] == ("submit", 0) for x in log[first_move:report])


def test_a_wide_engine_joining_a_filled_long_round_takes_its_queued_prompts_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``joinMidRound`` with wide engines and ``fillPrompts``: the filled long round starts
    on rollout-0 (no wide engine yet); when the wide one joins it takes the queued prompts'
    unfinished requests with their tokens and the fill stays on rollout-0."""
    drv, base, made, _ = _mid_round_run(monkeypatch, wide=True, fill=4, steps=10)
    moved = [r for r in drv.records if r["moved_requests"] > 0 and r["fill_prompts"]]
    assert moved and made

    def prompt(rid: str) -> int:
        return int(rid.split("-")[1][1:])

    # a request id is r<round>-p<prompt>-i<index>; the fill prompts of a filled long round
    # are the ones no earlier round had (its queued prompts were deferred from earlier ones)
    ids = [rid for e in (base, *made) for rid in e.ids]

    def parse(rid: str) -> tuple[int, int]:
        rnd, p, _ = rid.split("-")
        return int(rnd[1:]), int(p[1:])

    rounds = sorted({parse(rid)[0] for e in made for rid in e.ids})
    assert len(rounds) == len(moved)
    for rnd, rec in zip(rounds, moved, strict=True):
        prompts = {p for x, p in map(parse, ids) if x == rnd}
        queued = prompts & {p for x, p in map(parse, ids) if x < rnd}
        fill = prompts - queued
        assert len(fill) == 4 and queued
        taken = {p for x, p in map(parse, base.taken) if x == rnd}
        on_wide = {p for x, p in (parse(rid) for e in made for rid in e.ids) if x == rnd}
        assert taken and taken == on_wide and on_wide <= queued, (taken, on_wide, queued)
        assert rec["moved_requests"] == sum(1 for rid in base.taken if parse(rid)[0] == rnd)


def test_a_long_round_gives_its_added_replica_back_once_the_rest_fits() -> None:
    """``releaseWhenFits``: a long round on rollout-0 and an added replica 1; once its
    unfinished requests fit on rollout-0 at the load it began the round with, replica 1's go
    there with their tokens, its engine is shut down with nothing in flight, and the operator
    is asked to scale back (``release``) before the round ends, well before the step's
    report; every response is answered once (the released engine's share in the record)."""
    drv, log, made = _elastic(6, long_usable=[0, 1])
    drv.cfg.job.spec.tail_batching.long_round.release_when_fits = True
    drv.release_when_fits = drv.cfg.release_when_fits
    drv.run()
    longs = [r for r in drv.records if r["round_kind"] == "Long"]
    assert longs and made
    for r in longs:
        t, *gone = r["released_mid_round"]
        assert gone == [1] and 0 < t <= r["seconds_rollout"], r["released_mid_round"]
        by = {e["replica"]: e for e in r["engines"]}
        assert by[1].get("released") and by[1]["responses"] > 0, r["engines"]
        assert by[0]["responses"] + by[1]["responses"] == r["kept"], r["engines"]
        i_release = log.index(("release", 0, r["step"]))
        i_report = log.index(("report", r["step"], "Long"))
        assert i_release < i_report
        # the engine went before the release was asked, with nothing in flight
        shut = [i for i, x in enumerate(log) if x[:2] == ("shutdown", 1) and i < i_release]
        assert shut and all(log[i][2] == 0 for i in shut)
        # after the release, only rollout-0 got requests in that round
        assert not any(x[:2] == ("submit", 1) for x in log[i_release:i_report])
    moved_back = [rid for e in made for rid in e.taken]
    assert moved_back  # some were unfinished there and went on with their tokens


@pytest.mark.parametrize("stream", [False, True])
def test_filled_long_rounds_train_fresh_prompts_beside_the_queued_ones(stream: bool) -> None:
    """``tailBatching.longRound.fillPrompts`` 4 at promptsPerStep 4: each long round launches
    its 4 queued prompts and the next 4 fresh ones; the fill groups done by the time the
    queued ones are train in that step (the learner's updates for 8 prompts, as launched),
    the rest are aborted and queued; no prompt trains twice in an epoch, and the job covers
    its prompts in fewer steps than without the fill."""
    runs = {}
    for fill in (None, 4):
        cfg = _cfg(steps=16, fixed_group_size=4)
        cfg.job.spec.algorithm.dynamic_sampling = False  # every group trains: counts exact
        cfg.job.spec.trainer.stream_training = stream
        cfg.job.spec.tail_batching.long_round.fill_prompts = fill
        drv = runtime.build_driver(cfg, [TailEngine()])
        drv.run()
        runs[fill] = drv
    k = int(_cfg().learner_config().mini_batches)
    recs = runs[4].records
    longs = [r for r in recs if r["round_kind"] == "Long"]
    assert longs, [(r["step"], r["long_queue"]) for r in recs]
    for r in longs:
        assert r["fill_prompts"] == 4 and 0 <= r["fill_kept"] <= 4, r
        assert len(r["prompts"]) == 4 + r["fill_kept"] and r["kept"] == 4 * len(r["prompts"])
        assert r["learner_updates"] == 2 * k, r  # ceil(8 launched / 4) steps' worth
        assert r["aborted"] == 4 * (4 - r["fill_kept"]), r
        if stream:
            assert r["learner_streamed"] == r["learner_samples"] == r["kept"], r
    assert sum(r["fill_kept"] for r in longs) > 0  # fill trained in the long rounds' shadow
    for r in recs:
        if r["round_kind"] == "Short":
            assert r["fill_prompts"] == 0 and r["learner_updates"] == k, r
    seen = [p for r in recs for p in r["prompts"]]
    assert len(seen) == len(set(seen))  # 16 steps stay within the first epoch
    plain = runs[None].records
    assert all(r["fill_prompts"] == 0 for r in plain)
    # the same 16 steps train more prompts with the fill
    assert len(seen) > sum(len(r["prompts"]) for r in plain)


@pytest.mark.parametrize("stream", [False, True])
def test_long_rounds_of_more_prompts_run_them_at_once_in_as_many_updates(stream: bool) -> None:
    """``tailBatching.longRound.prompts`` 8 at promptsPerStep 4: the deferred prompts queue
    until 8 are there and one long round generates all 8 groups, trained in twice the
    learner's mini-batches (as two steps of 4 would be); short rounds keep the learner's
    own count. Without the field the long rounds hold 4 prompts."""
    runs = {}
    for lp in (None, 8):
        cfg = _cfg(steps=14, fixed_group_size=4)
        cfg.job.spec.algorithm.dynamic_sampling = False  # every group trains: counts exact
        cfg.job.spec.trainer.stream_training = stream
        cfg.job.spec.tail_batching.long_round.prompts = lp
        drv = runtime.build_driver(cfg, [TailEngine()])
        drv.run()
        runs[lp] = drv.records
    k = int(_cfg().learner_config().mini_batches)
    longs = [r for r in runs[8] if r["round_kind"] == "Long"]
    assert longs, [(r["step"], r["long_queue"]) for r in runs[8]]
    for r in longs:
        assert len(r["prompts"]) == 8 and r["kept"] == 8 * 4, r
        assert r["learner_updates"] == 2 * k, r
        if stream:
            assert r["learner_streamed"] == r["learner_samples"] == 32, r
    for r in runs[8]:
        if r["round_kind"] == "Short":
            assert r["learner_updates"] == k and r["long_queue"] <= 8, r
    # the queue waited past P0 for L (a long round at 4 queued prompts is the default's)
    assert any(r["long_queue"] >= 4 and r["next_round_kind"] == "Short" for r in runs[8])
    base_longs = [r for r in runs[None] if r["round_kind"] == "Long"]
    assert base_longs and all(len(r["prompts"]) == 4 and r["learner_updates"] == k
                              for r in base_longs)
    assert len(base_longs) > len(longs)


def test_a_per_second_run_prices_the_sizes_it_ran_from_its_own_steps() -> None:
    """``groupControl.objective: PerSecond`` through the local driver: each step's measured
    seconds and tokens (its responses' mean length times their count) reach SAGC: the records
    carry the seconds of every size it has run (and no other) and its price of every candidate;
    a per-step run records neither."""
    drv = runtime.build_driver(_cfg(steps=5, tail_batching=False, sagc_objective="second"),
                               [ScriptedEngine()])
    drv.run()
    for r in drv.records:
        priced = r["step_seconds_by_g"]
        ran = {str(x["group_size"]) for x in drv.records[: r["step"] + 1]}
        assert set(priced) == ran and all(s > 0 for s in priced.values())
        assert 0 < r["len_mean"] <= r["len_max"]
        prices = r["step_price_by_g"]  # every candidate, a larger size dearer
        assert list(map(int, prices)) == [4, 8, 16] and 0 < prices["4"] <= prices["16"]
    tokens = drv.controller.jc.controller.state_dict()["step_tokens"]
    assert [int(h[0]) for h in tokens] == [r["group_size"] for r in drv.records]
    assert [h[1] for h in tokens] == pytest.approx([r["len_mean"] * r["kept"]
                                                    for r in drv.records])
    plain = runtime.build_driver(_cfg(steps=2, tail_batching=False), [ScriptedEngine()])
    plain.run()
    assert all("step_seconds_by_g" not in r and "step_price_by_g" not in r
               for r in plain.records)


class WideTailEngine(ScriptedEngine):
    """A tail too wide for the race: the first response of every even-numbered prompt
    rambles to the token limit, so about half of a round's prompts have a response at the
    cap and a round that races 5 prompts for 4 groups waits for the cap all the same."""

    def _tokens(self, r: GenRequest) -> tuple[int, ...]:
        toks = super()._tokens(r)
        _, p, i = r.request_id.split("-")
        if int(p[1:]) % 2 == 0 and i == "i0":
            toks = (*toks[:-1], *([toks[0]] * r.max_tokens))[: r.max_tokens]
        return toks


def test_a_round_that_reached_the_cap_trains_every_prompt_it_launched() -> None:
    """``tailBatching.keepNearCap``: a short round whose 4th group completes at the cap keeps
    all 5 prompts it launched (5 x G trained, nothing deferred, none of their responses
    aborted), and the step record counts it; the same run without the field defers a
    prompt every round and runs long rounds for them (what this test would see if the field
    did nothing)."""
    runs = {}
    for near in (None, "0.1"):
        cfg = _cfg(steps=8, fixed_group_size=4)
        cfg.job.spec.algorithm.dynamic_sampling = False  # every group trains: counts exact
        cfg.job.spec.tail_batching.extra_responses_per_prompt = 0
        cfg.job.spec.tail_batching.keep_near_cap = near
        drv = runtime.build_driver(cfg, [WideTailEngine()])
        drv.run()
        runs[near] = drv.records
    recs = runs["0.1"]
    kept_all = [r for r in recs if r["rounds_kept_near_cap"]]
    assert len(kept_all) >= 4, [(r["step"], r["len_max"], len(r["prompts"])) for r in recs]
    for r in kept_all:
        assert r["round_kind"] == "Short" and r["len_max"] == int(cfg.max_tokens), r
        assert len(r["prompts"]) == 5 and r["kept"] == 4 * 5 == r["learner_samples"], r
        assert r["aborted"] == 0, r
    for r in recs:
        if not r["rounds_kept_near_cap"] and r["round_kind"] == "Short":
            assert len(r["prompts"]) == 4, r  # a race that ended short of the cap defers
    seen = [p for r in recs for p in r["prompts"]]
    assert len(seen) == len(set(seen))
    plain = runs[None]
    assert all(r["rounds_kept_near_cap"] == 0 for r in plain)
    assert any(r["round_kind"] == "Long" for r in plain)
    assert sum(len(r["prompts"]) for r in plain) < len(seen)
