"""LongRoundYield: a due long round runs only when it is expected to train."""

from __future__ import annotations

import json

import pytest

from rlpacer.api.protocol import RoundKind
from rlpacer.control.errors import ConfigError, StateError
from rlpacer.control.long_rounds import LongRoundYield, YieldConfig

pytestmark = pytest.mark.unit
S, L = RoundKind.SHORT, RoundKind.LONG


def test_runs_until_both_kinds_were_measured() -> None:
    y = LongRoundYield()
    assert y.should_run_long()  # nothing known
    y.observe(S, 20, 2.0)
    assert y.should_run_long()  # no long round measured yet
    y.observe(L, 0, 2.0)
    assert not y.should_run_long()  # 0 groups/s against 10 groups/s


def test_a_long_round_that_trains_as_well_as_a_short_one_runs() -> None:
    y = LongRoundYield(YieldConfig(min_ratio=0.25))
    y.observe(S, 20, 2.0)  # 10/s
    y.observe(L, 6, 2.0)  # 3/s >= 0.25 * 10/s
    assert y.should_run_long()
    y.observe(L, 1, 4.0)  # the running sums: (1.5 + 0.5) / (0.5 + 2) = 0.8/s < 2.5/s
    assert y.yield_per_s(L) == pytest.approx(2.0 / 2.5)
    assert not y.should_run_long()


def test_probe_after_retiring_several_in_a_row() -> None:
    y = LongRoundYield(YieldConfig(probe_every=3))
    y.observe(S, 20, 2.0)
    y.observe(L, 0, 2.0)
    decisions = []
    for _ in range(3):
        decisions.append(y.should_run_long())
        y.note_retired()
    assert decisions == [False, False, False] and y.should_run_long()  # the probe
    y.observe(L, 0, 2.0)  # the probe ran and still trained nothing
    assert not y.should_run_long() and y.retired_in_a_row == 0 and y.retired_rounds == 3


def test_min_ratio_zero_always_runs() -> None:
    y = LongRoundYield(YieldConfig(min_ratio=0.0))
    y.observe(S, 20, 2.0)
    y.observe(L, 0, 2.0)
    assert y.should_run_long()


def test_state_round_trip_and_old_states() -> None:
    y = LongRoundYield()
    y.observe(S, 20, 2.0)
    y.observe(L, 1, 3.0)
    y.note_retired()
    back = LongRoundYield.from_state_dict(json.loads(json.dumps(y.state_dict())))
    assert back.state_dict() == y.state_dict()
    assert back.should_run_long() == y.should_run_long()
    assert LongRoundYield.from_state_dict(None).state_dict() == LongRoundYield().state_dict()
    with pytest.raises(StateError):
        LongRoundYield.from_state_dict({"sums": {}})


@pytest.mark.parametrize("kw", [{"min_ratio": -0.1}, {"probe_every": 0}, {"smoothing": 0.0},
                                {"smoothing": 1.5}])
def test_bad_config_names_the_field(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match=next(iter(kw))):
        YieldConfig(**kw)  # type: ignore[arg-type]


def test_impossible_observations_are_refused() -> None:
    with pytest.raises(ValueError):
        LongRoundYield().observe(S, -1, 1.0)
    with pytest.raises(ValueError):
        LongRoundYield().observe(S, 1, float("nan"))
