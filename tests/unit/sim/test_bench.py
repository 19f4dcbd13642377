"""`rlpacer bench`: the policies' relations on the default scenario, the JSON and the plot.

The full default bench (200 steps) takes 10-20 s; this runs it at 100 steps, where every
target already holds (see rlpacer.sim.bench for the full-size figures).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlpacer.cli import main
from rlpacer.sim.bench import POLICY_NAMES, run_bench
from rlpacer.sim.workload import scenario

pytestmark = pytest.mark.unit

KEYS = {
    "wall_clock_s",
    "straggler_rate",
    "bubble_fraction",
    "mean_group_size",
    "responses_per_s",
    "prompts_trained",
    "speedup_vs_fixed16",
    "setups",
}
SETUP_KEYS = {"small", "large", "elastic", "elastic_vs_large", "elastic_vs_small", "target_met"}


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    out, _ = run_bench(scenario("default").with_steps(100), seed=0)
    return out


def test_every_policy_trains_the_same_prompts(report: dict[str, Any]) -> None:
    pol = report["policies"]
    assert set(pol) == set(POLICY_NAMES)
    assert {p["prompts_trained"] for p in pol.values()} == {100 * 32}


def test_targets_on_the_default_scenario(report: dict[str, Any]) -> None:
    pol, delta = report["policies"], report["delta"]
    assert pol["sagc_tail"]["speedup_vs_fixed16"] >= 2.0
    assert pol["sagc_tail"]["bubble_fraction"] < pol["fixed16"]["bubble_fraction"]
    assert pol["fixed8"]["wall_clock_s"] / pol["tail8"]["wall_clock_s"] >= 1.3
    assert pol["sagc"]["straggler_rate"] <= delta + 0.05
    # tau is chosen so the constraint binds: fixed4 below delta, fixed16 above it.
    assert pol["fixed4"]["straggler_rate"] < delta < pol["fixed16"]["straggler_rate"]
    assert pol["fixed16"]["speedup_vs_fixed16"] == 1.0
    # veRL's breakdown: rollout dominates the baseline's step time (66-72%).
    assert 0.6 < pol["fixed16"]["rollout_share"] < 0.78
    assert pol["tail8"]["mean_group_size"] == 8.0
    assert 4.0 <= pol["sagc"]["mean_group_size"] < 16.0


def test_elastic_target_on_the_default_scenario(report: dict[str, Any]) -> None:
    """The issue's target, as measured (docs/benchmarks.md): elastic long rounds within 10% of
    the large pool's wall clock with at least 25% fewer rollout GPU-seconds. On this workload long
    rounds last about as long as their longest response, so the large pool is itself only a
    few percent faster than the small one (rlpacer.sim.bench)."""
    pol = report["policies"]
    for name in ("tail8", "sagc_tail"):
        st = pol[name]["setups"]
        assert st["target_met"], name
        assert st["elastic_vs_large"]["wall_ratio"] <= 1.10
        assert st["elastic_vs_large"]["gpu_s_ratio"] <= 0.75
        assert st["elastic"]["scale_ups"] > 0
        assert st["large"]["wall_clock_s"] <= st["elastic"]["wall_clock_s"]
        assert st["elastic"]["wall_clock_s"] <= st["small"]["wall_clock_s"]
    for name in ("fixed4", "fixed8", "fixed16", "sagc"):
        st = pol[name]["setups"]
        assert st["small"] == st["large"]
        assert st["elastic"]["scale_ups"] == 0


def test_cli_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(["bench", "--steps", "6", "--seed", "1", "--json", str(out_json),
                 "--plot", str(out_png)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "sagc_tail" in printed and "vs fixed16" in printed
    data = json.loads(out_json.read_text())
    assert data["scenario"] == "default"
    assert data["delta"] == 0.2 and data["tau"] == 16.0
    assert set(data["policies"]) == set(POLICY_NAMES)
    for entry in data["policies"].values():
        assert set(entry) >= KEYS
        assert set(entry["setups"]) >= SETUP_KEYS
        for k in ("small", "large", "elastic"):
            assert set(entry["setups"][k]) >= {
                "rollout_replicas", "wall_clock_s", "rollout_gpu_s", "rollout_gpu_s_per_prompt"
            }
    assert data["elastic"]["long_replicas"] == 4 and data["elastic"]["scale_up_s"] == 90.0
    assert "elastic/large" in printed and "GPU-s/pr" in printed
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_elastic_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "bench.json"
    code = main(["bench", "--steps", "4", "--long-round-replicas", "6", "--scale-up-s", "20",
                 "--json", str(out_json)])
    assert code == 0
    data = json.loads(out_json.read_text())
    assert data["elastic"]["long_replicas"] == 6 and data["elastic"]["scale_up_s"] == 20.0
    assert data["policies"]["tail8"]["setups"]["large"]["rollout_replicas"] == 6
    assert data["policies"]["fixed8"]["setups"]["large"]["rollout_replicas"] == 2
    capsys.readouterr()
    assert main(["bench", "--steps", "4", "--scale-up-s", "-1"]) == 2
    assert "scale_up_s" in capsys.readouterr().err


def test_cli_rejects_unknown_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--scenario", "nope"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["cpu", "light-tail"])
def test_other_scenarios_run(name: str) -> None:
    out, _ = run_bench(scenario(name).with_steps(4), seed=0)
    assert {p["prompts_trained"] for p in out["policies"].values()} == {
        4 * scenario(name).prompts_per_step
    }
