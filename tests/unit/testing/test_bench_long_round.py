"""The figures bench-long-round prints, from metrics records (the runs themselves need root
and vLLM: the command is run by hand, its figures are in the issue notes)."""

from __future__ import annotations

from typing import Any

import pytest

from rlpacer.bench.long_round import compare, compare_early, compare_mid, long_round

pytestmark = pytest.mark.unit


def _rec(step: int, kind: str, engines: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    return {"step": step, "round_kind": kind, "seconds_rollout": wall, "seconds_join": 7.5,
            "len_max": 96, "engines": engines}


def _eng(replica: int, responses: int, tokens: int, busy: float) -> dict[str, Any]:
    return {"replica": replica, "hostname": f"rollout-{replica}", "cores": str(replica),
            "responses": responses, "tokens": tokens, "busy_s": busy}


def test_long_round_figures_come_from_the_long_step_only() -> None:
    recs = [_rec(0, "Short", [_eng(0, 16, 400, 2.0)], 2.5),
            _rec(1, "Long", [_eng(1, 10, 500, 4.0), _eng(0, 6, 300, 4.5)], 5.0),
            _rec(2, "Short", [_eng(0, 16, 420, 2.0)], 2.4)]
    fig = long_round(recs)
    assert fig["step"] == 1 and fig["wall_s"] == 5.0 and fig["join_s"] == 7.5
    assert fig["responses"] == 16 and fig["tokens"] == 800 and fig["tokens_per_s"] == 160.0
    assert [e["replica"] for e in fig["engines"]] == [0, 1]
    assert fig["engines"][1]["tokens_per_busy_s"] == 125.0
    with pytest.raises(ValueError, match="no long round"):
        long_round([recs[0]])


def test_ratios_are_elastic_over_single_and_flag_different_work() -> None:
    single = {"wall_s": 10.0, "tokens_per_s": 80.0, "responses": 16, "tokens": 800}
    elastic = {"wall_s": 6.0, "tokens_per_s": 133.3, "responses": 16, "tokens": 800}
    out = compare({"single": [single], "elastic": [elastic]})
    assert out["wall_ratio_elastic_over_single"] == 0.6
    assert out["tokens_per_s_ratio_elastic_over_single"] == pytest.approx(1.666, abs=1e-3)
    assert out["same_work_in_every_run"]
    out = compare({"single": [single], "elastic": [{**elastic, "tokens": 790}]})
    assert not out["same_work_in_every_run"]


def test_early_compares_the_long_rounds_wait_for_capacity() -> None:
    recs = [_rec(0, "Short", [_eng(0, 16, 400, 2.0)], 2.5),
            {**_rec(1, "Long", [_eng(0, 8, 400, 3.0), _eng(1, 8, 400, 3.0)], 3.5),
             "seconds_capacity_wait": 0.2, "scale_up_lead_s": 19.5}]
    early = long_round(recs)
    assert early["capacity_wait_s"] == 0.2 and early["lead_s"] == 19.5
    elastic = long_round([recs[0], {**recs[1], "seconds_capacity_wait": 18.0,
                                    "scale_up_lead_s": 0.0}])
    out = compare_early({"elastic": [elastic], "early": [early]})
    assert out["capacity_wait_s"] == {"elastic": 18.0, "early": 0.2}
    assert out["wait_saved_s"] == 17.8 and out["lead_measured_s"] == [19.5]
    # records from before the field: the join is the wait
    assert long_round([recs[0], _rec(1, "Long", [_eng(0, 1, 10, 1.0)], 1.0)])[
        "capacity_wait_s"] == 7.5


def test_mid_round_compares_the_wait_plus_the_rollout_and_counts_the_moves() -> None:
    recs = [_rec(0, "Short", [_eng(0, 16, 400, 2.0)], 2.5),
            {**_rec(1, "Long", [_eng(0, 120, 2800, 28.0), _eng(1, 8, 300, 11.0)], 28.9),
             "seconds_capacity_wait": 0.001, "joined_mid_round": [[1, 17.8]],
             "moved_requests": 9, "moved_tokens": 378}]
    mid = long_round(recs)
    assert (mid["moved_requests"], mid["moved_tokens"], mid["joined_mid_round"]) == (
        9, 378, [[1, 17.8]])
    waited = long_round([recs[0], {**recs[1], "seconds_capacity_wait": 21.0,
                                   "seconds_rollout": 20.0, "joined_mid_round": [],
                                   "moved_requests": 0, "moved_tokens": 0}])
    out = compare_mid({"elastic": [waited], "midround": [mid]})
    assert out["wait_plus_rollout_s"] == {"elastic": 41.0, "midround": 28.901}
    assert out["ratio_midround_over_elastic"] == pytest.approx(28.901 / 41.0, abs=1e-3)
    assert out["moved_requests"] == [9] and out["joined_mid_round"] == [[[1, 17.8]]]
    # records from before the fields: nothing moved
    assert long_round([recs[0], _rec(1, "Long", [_eng(0, 1, 10, 1.0)], 1.0)])[
        "moved_requests"] == 0
