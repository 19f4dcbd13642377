"""``spec.algorithm``: GRPO and DAPO are presets, each knob the spec sets overrides its preset.

The knobs carry no CRD default (the API server would otherwise fill them in, and "unset" could
not be told from "set to GRPO's value"); the trainer, the operator's report bounds and the
job's status all resolve them from the same function.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from rlpacer.api import crd
from rlpacer.api.job import ManifestError, effective_algorithm, parse_spec
from rlpacer.api.status import RLTrainingJobStatus
from rlpacer.operator.decide import Observed, decide
from rlpacer.operator.reports import report_bounds
from rlpacer_trainer.config import RunConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
KNOBS = ("clipRatioLow", "clipRatioHigh", "dynamicSampling", "lossAggregation",
         "overlongPenalty", "klCoef")


def _spec(algorithm: dict[str, Any], max_tokens: int = 1000) -> Any:
    return parse_spec({"model": {"source": "builtin://tiny-chain"},
                       "data": {"source": "builtin://chain"}, "steps": 2, "promptsPerStep": 4,
                       "rollout": {"maxResponseTokens": max_tokens},
                       "algorithm": algorithm})


def _eff(algorithm: dict[str, Any], max_tokens: int = 1000) -> dict[str, Any]:
    return effective_algorithm(_spec(algorithm, max_tokens)).to_wire()  # type: ignore[no-any-return]


def test_each_preset_resolves_to_its_documented_values() -> None:
    grpo = {"name": "GRPO", "clipRatioLow": "0.2", "clipRatioHigh": "0.2",
            "lossAggregation": "SequenceMean", "dynamicSampling": False,
            "overlongBufferTokens": 0, "overlongPenalty": "1.0", "klCoef": "0",
            "learningRate": "1e-6"}
    assert _eff({}) == grpo
    assert _eff({"name": "GRPO"}) == grpo
    assert _eff({"name": "DAPO"}) == {**grpo, "name": "DAPO", "clipRatioHigh": "0.28",
                                      "lossAggregation": "TokenMean", "dynamicSampling": True,
                                      "overlongBufferTokens": 200}  # a fifth of 1000


def test_knobs_the_spec_sets_win_over_the_preset() -> None:
    e = _eff({"name": "DAPO", "clipRatioHigh": "0.3", "dynamicSampling": False,
              "lossAggregation": "SequenceMean", "klCoef": "0.01",
              "overlongPenalty": {"bufferTokens": 64, "penalty": "0.5"}})
    assert (e["clipRatioHigh"], e["dynamicSampling"], e["lossAggregation"], e["klCoef"]) == (
        "0.3", False, "SequenceMean", "0.01")
    assert (e["overlongBufferTokens"], e["overlongPenalty"]) == (64, "0.5")
    # overlong shaping: an explicit off for DAPO, an explicit on for GRPO
    assert _eff({"name": "DAPO", "overlongPenalty": {"enabled": False}})[
        "overlongBufferTokens"] == 0
    assert _eff({"name": "GRPO", "overlongPenalty": {}})["overlongBufferTokens"] == 200


def test_a_manifest_stored_with_the_old_crd_defaults_keeps_its_meaning() -> None:
    """Before the presets the CRD defaulted every knob to GRPO's value, so a DAPO job stored
    then carries GRPO's knobs explicitly: explicit values win, it trains as it did."""
    stored = {"name": "DAPO", "clipRatioLow": "0.2", "clipRatioHigh": "0.2",
              "dynamicSampling": False, "lossAggregation": "SequenceMean",
              "learningRate": "1e-6", "klCoef": "0"}
    e = _eff(stored)
    assert (e["clipRatioHigh"], e["dynamicSampling"], e["lossAggregation"]) == (
        "0.2", False, "SequenceMean")
    assert e["overlongBufferTokens"] == 200  # unset then and now: DAPO's preset turns it on


def test_bad_overrides_name_the_field() -> None:
    with pytest.raises(ManifestError, match=r"algorithm\.overlongPenalty\.bufferTokens must be <"):
        _spec({"name": "DAPO", "overlongPenalty": {"bufferTokens": 1000}})
    with pytest.raises(ManifestError, match="clipRatioHigh must be > 0"):
        _spec({"clipRatioHigh": "0"})
    with pytest.raises(ManifestError, match="lossAggregation"):
        _spec({"lossAggregation": "Sum"})


def test_the_crd_gives_the_knobs_no_default() -> None:
    doc = yaml.safe_load((ROOT / "crds" / "rlpacer.io_rltrainingjobs.yaml").read_text())
    props = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["algorithm"]["properties"]
    for knob in KNOBS:
        assert "default" not in props[knob], knob
        assert "Unset: the preset's value" in props[knob]["description"], knob
    assert props["name"]["default"] == "GRPO"
    assert crd.rltrainingjob_crd() == doc  # generated from the same models (no drift)


def test_trainer_report_bounds_and_status_resolve_the_same_knobs() -> None:
    def run_config(algorithm: dict[str, Any], tmp: Path) -> RunConfig:
        doc = yaml.safe_load((ROOT / "examples" / "tiny-local.yaml").read_text())
        doc["spec"]["algorithm"] = algorithm
        p = tmp / f"{algorithm['name']}.yaml"
        p.write_text(yaml.safe_dump(doc))
        return RunConfig.load(p)

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        grpo, dapo = (run_config({"name": n}, Path(d)) for n in ("GRPO", "DAPO"))
    lg, ld = grpo.learner_config(), dapo.learner_config()
    assert (lg.clip_high, lg.aggregation) == (0.2, "SequenceMeanTokenMean")
    assert (ld.clip_high, ld.aggregation) == (0.28, "TokenMean")
    assert (grpo.dynamic_sampling, dapo.dynamic_sampling) == (False, True)
    assert grpo.overlong_buffer == 0 and dapo.overlong_buffer > 0 and dapo.overlong_scale == 1.0
    # the operator bounds a DAPO report's counts by dynamic sampling's extra rounds
    cg = report_bounds(_spec({"name": "GRPO"}), 8)["lengths.count"][0]
    cd = report_bounds(_spec({"name": "DAPO"}), 8)["lengths.count"][0]
    assert cd > cg
    # and the job's status shows what runs
    from datetime import UTC, datetime

    spec = _spec({"name": "DAPO", "clipRatioHigh": "0.3"})
    d = decide(spec, RLTrainingJobStatus(), Observed(), datetime(2026, 1, 1, tzinfo=UTC), 1)
    assert d.status.algorithm is not None
    assert d.status.algorithm.to_wire()["clipRatioHigh"] == "0.3"
    assert d.status.algorithm.dynamic_sampling is True
