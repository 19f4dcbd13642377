"""The trainer's config: built from an RLTrainingJob manifest; bad input names the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlpacer.api.job import ManifestError
from rlpacer.control.sagc import GroupControlMode
from rlpacer_trainer.config import ConfigError, RunConfig

pytestmark = pytest.mark.unit
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-local.yaml"


def test_example_manifest_loads() -> None:
    cfg = RunConfig.load(EXAMPLE)
    assert cfg.algorithm.name == "DAPO" and cfg.dynamic_sampling
    lc = cfg.learner_config()
    assert (lc.clip_low, lc.clip_high, lc.aggregation) == (0.2, 0.28, "TokenMean")
    pc = cfg.planner_config()
    assert pc.enabled and pc.prompts_per_step == cfg.spec.prompts_per_step
    assert cfg.controller_config().mode is GroupControlMode.SAGC
    assert cfg.model_path.name == "tiny-chain"


def test_flags_override() -> None:
    cfg = RunConfig.load(EXAMPLE, fixed_group_size=16, tail_batching=False, steps=3)
    cc = cfg.controller_config()
    assert cc.mode is GroupControlMode.FIXED and cc.sagc.initial == 16
    assert not cfg.planner_config().enabled
    assert cfg.total_steps == 3


def _write(tmp_path: Path, mutate) -> Path:  # type: ignore[no-untyped-def]
    doc = yaml.safe_load(EXAMPLE.read_text())
    mutate(doc)
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def test_bad_manifest_names_the_field(tmp_path: Path) -> None:
    p = _write(tmp_path, lambda d: d["spec"]["algorithm"].update(clipRatioHigh="-1"))
    with pytest.raises(ManifestError, match="clipRatioHigh"):
        RunConfig.load(p)
    p = _write(tmp_path, lambda d: d["spec"]["algorithm"].update(clipRatioHihg="0.3"))
    with pytest.raises(ManifestError, match="clipRatioHihg"):
        RunConfig.load(p)


def test_unsupported_sources_fail_at_load(tmp_path: Path) -> None:
    p = _write(tmp_path, lambda d: d["spec"]["data"].update(source="pvc://x/y.jsonl"))
    with pytest.raises(ConfigError, match=r"spec\.data\.source"):
        RunConfig.load(p)
    p = _write(tmp_path, lambda d: d["spec"]["model"].update(source="builtin://nope"))
    with pytest.raises(ValueError, match=r"model\.source"):
        RunConfig.load(p)


@pytest.mark.parametrize(("reward", "message"), [
    ({"type": "Exactmatch"}, r"spec\.reward\.type: .*'Exactmatch' is not a built-in reward"
                             r" \(ExactMatch, ChainPrefix, MathAnswer, Regex\)"),
    ({"type": "my rewards:score"}, r"spec\.reward\.type: .*not an entry point: write"
                                   r" module:function"),
    ({"type": "my_rewards:"}, r"spec\.reward\.type: .*not an entry point"),
    ({"type": "Regex"}, r"spec\.reward: .*pattern is required when type is Regex"),
    ({"type": "Regex", "pattern": "(unclosed"}, r"spec\.reward: .*pattern '\(unclosed' is not a"
                                                r" valid regular expression"),
    ({"type": "MathAnswer", "pattern": "x"}, r"spec\.reward: .*pattern is read only when type"
                                             r" is Regex"),
    ({"failureScore": "1e999"}, r"spec\.reward\.failureScore: failureScore '1e999' must be a"
                                 r" finite"),
    ({"failureScore": "zero"}, r"spec\.reward\.failureScore"),
    ({"workers": 0}, r"spec\.reward\.workers"),
])
def test_bad_reward_config_fails_at_load_naming_the_field(
        tmp_path: Path, reward: dict[str, object], message: str) -> None:
    p = _write(tmp_path, lambda d: d["spec"]["reward"].update(reward))
    with pytest.raises(ManifestError, match=message):
        RunConfig.load(p)


def test_a_user_reward_must_be_importable(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    p = _write(tmp_path, lambda d: d["spec"]["reward"].update(type="rlpacer_no_such:score"))
    with pytest.raises(ConfigError, match=r"spec\.reward\.type: 'rlpacer_no_such:score': no"
                                          r" module 'rlpacer_no_such'"):
        RunConfig.load(p)
    (tmp_path / "rlpacer_cfg_reward.py").write_text("def score(r, a, p, **m):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    p = _write(tmp_path, lambda d: d["spec"]["reward"].update(type="rlpacer_cfg_reward:score"))
    assert RunConfig.load(p).spec.reward.type == "rlpacer_cfg_reward:score"
    p = _write(tmp_path, lambda d: d["spec"]["reward"].update(type="Regex", pattern=r"\d+,\Z"))
    assert RunConfig.load(p).spec.reward.pattern == r"\d+,\Z"


def test_a_pods_config_from_a_newer_operator_loads_without_the_fields_it_does_not_know(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pod's config is the operator's copy of the stored job: fields a newer operator
    knows and this trainer does not are ignored and named in one warning (the operator reads
    stored jobs the same way); a known field's bad value still fails naming it, and a
    manifest given to ``rlpacer run`` stays strict."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["trainer"]["aFieldFromTheFuture"] = True
    doc["spec"]["tailBatching"]["longRound"]["anotherOne"] = {"x": 1}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    cfg = RunConfig.load(path, stored=True)
    assert cfg.spec.steps == yaml.safe_load(EXAMPLE.read_text())["spec"]["steps"]
    err = capsys.readouterr().err
    assert "spec.trainer.aFieldFromTheFuture" in err
    assert "spec.tailBatching.longRound.anotherOne" in err
    with pytest.raises(ManifestError, match="aFieldFromTheFuture"):
        RunConfig.load(path)  # rlpacer run: strict
    doc["spec"]["steps"] = -3
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ManifestError, match=r"spec\.steps"):
        RunConfig.load(path, stored=True)


def test_stream_training_is_left_out_of_a_pods_config_unless_set() -> None:
    """``trainer.streamTraining`` is unset by default, so the operator's copy of a job that
    does not set it carries no such field, and a trainer image older than the field reads it
    (those images refuse fields they do not know)."""
    from rlpacer.api.job import load_manifest

    job = load_manifest(EXAMPLE)
    assert "streamTraining" not in job.spec.to_wire()["trainer"]
    assert RunConfig.load(EXAMPLE).stream_training is False
    job.spec.trainer.stream_training = True
    assert job.spec.to_wire()["trainer"]["streamTraining"] is True
