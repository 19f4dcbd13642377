"""Fit before start (rlpacer_trainer.fit): the learner's estimate against a rank's memory,
the error's numbers and fixes, and the error recognised through Ray's wrapping; a model the
CPU engine cannot serve is refused at config load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from rlpacer_trainer import fit
from rlpacer_trainer.config import CPU_ATTENTION_HEAD_SIZES, ConfigError, RunConfig
from rlpacer_trainer.errors import LearnerDoesNotFit

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "tiny-local.yaml"
WORDPROBLEMS = ROOT / "trainer_image" / "rlpacer_trainer" / "assets" / "wordproblems-qwen2"
QWEN7B = {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
          "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
          "tie_word_embeddings": False, "model_type": "qwen2"}


def _model(tmp_path: Path, conf: dict[str, object]) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(conf))
    return d


def test_check_learner_refuses_with_the_numbers_and_the_fixes(tmp_path: Path) -> None:
    model = _model(tmp_path, QWEN7B)
    kw = {"world": 8, "sharded": True, "micro_batch_tokens": 16384,
          "activation_checkpointing": False, "kl": False, "device": "cuda"}
    est = fit.check_learner(model, **kw, env={fit.ENV_LEARNER_MEMORY: str(200 << 30)})
    assert 150 << 30 < est.total < 155 << 30  # docs/learner-fit.md: 152.8 GiB
    with pytest.raises(LearnerDoesNotFit) as info:
        fit.check_learner(model, **kw, env={fit.ENV_LEARNER_MEMORY: str(80 << 30)})
    msg = str(info.value)
    assert "\n" not in msg  # one line: the operator keeps the driver's last error line
    assert msg.startswith("learner does not fit: 152.8 GiB per rank (weights ")
    assert "exceeds 80.0 GiB per rank (RLPACER_LEARNER_MEMORY_BYTES)" in msg
    for fix in ("spec.trainer.replicas x gpusPerReplica",
                "spec.trainer.activationCheckpointing: true",
                "a smaller spec.trainer.microBatchTokens (now 16384)", "a smaller model"):
        assert fix in msg
    fit.check_learner(model, **{**kw, "activation_checkpointing": True},
                      env={fit.ENV_LEARNER_MEMORY: str(80 << 30)})  # 56.7 GiB fits
    with pytest.raises(ConfigError, match="RLPACER_LEARNER_MEMORY_BYTES"):
        fit.check_learner(model, **kw, env={fit.ENV_LEARNER_MEMORY: "80G"})


def test_a_rank_on_cpu_has_the_hosts_memory_shared() -> None:
    have, where = fit.rank_memory("cpu", env={})
    assert have is not None and have > 0 and where
    half, why = fit.rank_memory("cpu", ranks_per_host=2, env={})
    assert half == have // 2 and "over 2 ranks" in why
    assert fit.rank_memory("cuda", env={fit.ENV_LEARNER_MEMORY: "5"}) == (
        5, fit.ENV_LEARNER_MEMORY)


def test_the_driver_checks_the_spec_layout(tmp_path: Path) -> None:
    cfg = RunConfig.load(EXAMPLE)
    layout = fit.learner_layout(cfg)
    # one CPU rank: nothing to shard (as the learner decides)
    assert layout == {"world": 1, "sharded": False, "micro_batch_tokens": 16384,
                      "activation_checkpointing": True, "kl": False, "device": "cpu",
                      "ranks_per_replica": 1}
    assert fit.check_run(cfg, local=False, env={}) is None  # learner pods check themselves
    assert fit.check_run(cfg, local=True, env={}) is not None  # the tiny model fits here
    with pytest.raises(LearnerDoesNotFit, match="exceeds 1000 bytes per rank"):
        fit.check_run(cfg, local=False, env={fit.ENV_LEARNER_MEMORY: "1000"})


def test_the_error_is_found_through_rays_wrapping() -> None:
    err = LearnerDoesNotFit("learner does not fit: 9 GiB per rank")
    assert fit.does_not_fit(err) is err
    try:
        try:
            raise err
        except LearnerDoesNotFit as e:
            raise RuntimeError("start failed") from e
    except RuntimeError as wrapped:
        assert fit.does_not_fit(wrapped) is err
    # an actor whose __init__ raised: Ray's ActorDiedError carries the traceback as text
    ray_text = ("The actor died because of an error raised in its creation task,"
                " ray::LearnerWorker.__init__() (pid=1, ip=10.0.0.1)\n  File \"x.py\", line 3\n"
                "rlpacer_trainer.errors.LearnerDoesNotFit: learner does not fit: 9 GiB per"
                " rank exceeds 8 GiB\n")
    found = fit.does_not_fit(RuntimeError(ray_text))
    assert found is not None
    assert str(found) == "learner does not fit: 9 GiB per rank exceeds 8 GiB"
    assert fit.does_not_fit(RuntimeError("something else")) is None


def _user_model_job(tmp_path: Path, head_dim: int | None, gpus: int = 0) -> Path:
    model = tmp_path / "model"
    shutil.copytree(WORDPROBLEMS, model)
    conf = json.loads((model / "config.json").read_text())
    conf.update({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1})
    if head_dim is not None:
        conf["head_dim"] = head_dim
    (model / "config.json").write_text(json.dumps(conf))
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"] = {"source": str(model)}
    doc["spec"]["rollout"]["gpusPerReplica"] = gpus
    doc["spec"]["rollout"]["tensorParallelSize"] = max(gpus, 1)
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def test_a_head_dim_the_cpu_engine_cannot_serve_is_refused_at_load(tmp_path: Path) -> None:
    job = _user_model_job(tmp_path, None)  # 64 / 4 heads: head_dim 16
    with pytest.raises(ConfigError) as info:
        RunConfig.load(job)
    msg = str(info.value)
    assert msg.startswith(f"spec.model.source: {tmp_path / 'model'} has head_dim 16")
    assert "32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512" in msg
    assert "spec.rollout.gpusPerReplica" in msg


def test_a_gpu_engine_or_a_supported_head_dim_loads(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    RunConfig.load(_user_model_job(tmp_path / "a", 32))  # head_dim given in config.json
    RunConfig.load(_user_model_job(tmp_path / "b", None, gpus=1))  # not a CPU engine


def test_the_head_sizes_are_vllms() -> None:
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    assert tuple(cpu_attn.CPUAttentionBackend.get_supported_head_sizes()) == (
        CPU_ATTENTION_HEAD_SIZES)


def test_tensor_parallel_size_must_equal_the_gpus_except_in_stored_jobs() -> None:
    from rlpacer.api._base import read_stored
    from rlpacer.api.job import ManifestError, RolloutSpec, parse_spec

    for rollout, why in [({"gpusPerReplica": 4, "tensorParallelSize": 2},
                          r"tensorParallelSize must equal gpusPerReplica \(4\)"),
                         ({"gpusPerReplica": 0, "tensorParallelSize": 2},
                          "tensorParallelSize must be 1 when gpusPerReplica is 0")]:
        spec = {"model": {"source": "builtin://tiny-chain"}, "steps": 1, "promptsPerStep": 1,
                "data": {"source": "builtin://chain"}, "rollout": rollout}
        with pytest.raises(ManifestError, match=why):
            parse_spec(spec)
        # a job stored before the rule (tensorParallelSize <= gpusPerReplica) still reads
        parse_spec(spec, stored=True)
        read_stored(RolloutSpec, rollout, drop_invalid=False)
    with pytest.raises(ManifestError, match="must be <= gpusPerReplica"):
        parse_spec({"model": {"source": "builtin://tiny-chain"}, "steps": 1, "promptsPerStep": 1,
                    "data": {"source": "builtin://chain"},
                    "rollout": {"gpusPerReplica": 2, "tensorParallelSize": 4}}, stored=True)
