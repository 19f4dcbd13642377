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
