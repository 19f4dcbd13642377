"""The driver's loop against a scripted engine (no vLLM): finish-order delivery into the
tail-batching planner, aborts, dynamic sampling, reports, checkpoints and resume."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from rlpacer_trainer import runtime, task, tiny, weights
from rlpacer_trainer.config import RunConfig
from rlpacer_trainer.driver import length_summary
from rlpacer_trainer.engine import EngineInfo, EngineStats, Finished, GenRequest

pytestmark = pytest.mark.unit
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-local.yaml"


class ScriptedEngine:
    """Answers each prompt correctly with probability 1/2 (seeded per request); a response
    of n tokens finishes at engine step n, so finish order is length order."""

    def __init__(self, replica: int = 0) -> None:
        self.replica = replica
        self.version: str | None = None
        self.live: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.clock = 0
        self.st = EngineStats()
        self.loads = 0
        self.aborted_ids: list[str] = []

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
            self.live[r.request_id] = (self.clock + len(toks), toks)

    def poll(self, max_steps: int = 16) -> list[Finished]:
        out: list[Finished] = []
        for _ in range(max_steps):
            if not self.live or out:
                break
            self.clock += 1
            self.st.steps += 1
            for rid, (t, toks) in sorted(self.live.items()):
                if t <= self.clock:
                    del self.live[rid]
                    self.st.tokens += len(toks)
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


def _cfg(**kw: object) -> RunConfig:
    cfg = RunConfig.load(EXAMPLE, **kw)  # type: ignore[arg-type]
    cfg.job.spec.prompts_per_step = 4
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


def test_no_tail_batching_never_aborts() -> None:
    eng = ScriptedEngine()
    drv = runtime.build_driver(_cfg(steps=3, tail_batching=False, fixed_group_size=4), [eng])
    drv.run()
    assert all(r["aborted"] == 0 and r["round_kind"] == "Short" for r in drv.records)
    assert all(r["group_size"] == 4 for r in drv.records)


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
