"""`rlpacer plan`: SLO feasibility per tau, rollout options and the advice, from a trace."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rlpacer.api.trace import read_trace
from rlpacer.cli import main
from rlpacer.sim.plan import MODELS, advise_tau, make_plan, model_profile

pytestmark = pytest.mark.unit

DAPO = Path(__file__).resolve().parents[3] / "traces" / "dapo-qwen2.5-32b.jsonl"


def _trace(tail: bool) -> list[str]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(96):
        g = [int(v) for v in rng.integers(300, 500, size=8)]
        if tail and i % 3 == 0:
            g[i % 8] *= 30  # a third of the prompts ramble once
        out.append(json.dumps({"input": 120, "output": g}))
    return out


def test_model_profiles_scale_with_the_weights_per_gpu() -> None:
    p14 = model_profile(MODELS["qwen2.5-14b"], 2)
    p32_4 = model_profile(MODELS["qwen2.5-32b"], 4)
    p32_8 = model_profile(MODELS["qwen2.5-32b"], 8)
    assert p32_8.base_s < p32_4.base_s and p32_4.kv_capacity_tokens < p32_8.kv_capacity_tokens
    assert abs(p14.base_s - 9e-3) < 1e-9  # the reference roofline itself
    with pytest.raises(ValueError, match="does not fit"):
        model_profile(MODELS["qwen2.5-72b"], 1)


def test_advise_tau_is_the_smallest_that_binds() -> None:
    rates = {2.0: {4: 0.9, 16: 1.0}, 4.0: {4: 0.1, 16: 0.5}, 8.0: {4: 0.0, 16: 0.1}}
    assert advise_tau(rates, 0.2) == 4.0
    assert advise_tau({2.0: {4: 1.0, 16: 1.0}, 4.0: {4: 0.0, 16: 0.0}}, 0.2) is None


def test_a_tail_makes_low_taus_infeasible_and_the_advice_follows() -> None:
    kw = dict(nodes=1, gpus_per_node=8, trainer_gpus=4, tp=None, delta=0.2,
              taus=[1.5, 2.0, 4.0, 16.0, 64.0], policy_tau=2.0, steps=12, seed=0)
    flat = make_plan(read_trace(_trace(False), "flat"), MODELS["qwen2.5-14b"], **kw)
    tail = make_plan(read_trace(_trace(True), "tail"), MODELS["qwen2.5-14b"], **kw)
    assert flat["max_rollout_replicas"] == 2 and tail["trainer_gpus"] == 4
    # flat lengths (max/median < 2): every tau from 2 is met at every G
    assert all(v == 0.0 for v in flat["straggler_rates"]["2"].values())
    assert flat["policy_tau_feasible"] is True
    # a third of the prompts with a 30x response: tau 4 and 16 are broken at every G
    assert min(tail["straggler_rates"]["16"].values()) > 0.2
    assert tail["feasible"]["16"] is False and tail["policy_tau_feasible"] is False
    assert tail["feasible"]["64"] is True
    for p in (flat, tail):
        assert p["options"] and p["advised"] in p["options"]
        fastest = min(o["wall_clock_h"] for o in p["options"])
        assert p["advised"]["wall_clock_h"] <= 1.1 * fastest


def test_cli_prints_the_plan_and_calls_out_an_infeasible_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--trace", str(DAPO), "--model", "qwen2.5-32b", "--nodes", "4",
                 "--steps", "40", "--policy-tau", "4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "WARNING: an SLO at tau 4 and delta 0.2 is infeasible" in text
    assert "advised (tail batching on): groupControl.stragglerRatio" in text
    assert "longRounds: {maxRolloutReplicas:" in text
    plan = json.loads(out.read_text())
    assert plan["max_rollout_replicas"] == 4 and plan["tp"] == 4
    assert plan["straggler_rates"]["4"]["4"] > 0.9  # DAPO's plain rounds straggle at tau 4
    assert all(o["speedup_vs_fixed16"] > 1.5 for o in plan["options"])
    # the long round's size: on DAPO fewer, larger long rounds are faster; filling them with
    # 8 steps' fresh prompts faster still where fresh prompts are left (mid-epoch)
    sizes = {o["prompts"]: o for o in plan["long_round_sizes"] if o["fill"] == 0}
    filled = {o["prompts"]: o for o in plan["long_round_sizes"] if o["fill"] == 256}
    assert sorted(sizes)[:3] == [32, 64, 128] and max(sizes) == 576  # one an epoch
    assert sorted(filled) == sorted(sizes)
    assert sizes[64]["long_rounds"] < sizes[32]["long_rounds"]
    assert sizes[64]["wall_clock_h"] < sizes[32]["wall_clock_h"]
    assert filled[64]["wall_clock_h"] < sizes[64]["wall_clock_h"]
    best = plan["advised_long_round"]
    assert best["wall_clock_h"] == min(o["wall_clock_h"] for o in plan["long_round_sizes"])
    assert best["prompts"] > 32 and best["fill"] == 256
    assert "long-round size on the advised replicas" in text
    assert f"longRound: {{rolloutReplicas: {plan['advised']['long_round_replicas']}," \
           f" prompts: {best['prompts']}, fillPrompts: 256}}" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "0"], "--nodes must be >= 1"),
        (["--delta", "1.5"], "--delta must be in (0, 1)"),
        (["--trainer-gpus", "16"], "--trainer-gpus must be in [1, 15]"),
        (["--taus", "0.5"], "--taus must all be >= 1"),
        (["--model", "qwen2.5-72b", "--tp", "1"], "does not fit"),
    ],
)
def test_cli_refuses_bad_input(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--trace", str(DAPO), *argv]) == 2
    assert message in capsys.readouterr().err
