"""Conditions: transitions, summary, terminal states."""

from __future__ import annotations

import pytest

from rlpacer.api.status import (
    ConditionStatus,
    ConditionType,
    Reason,
    RLTrainingJobStatus,
    Summary,
    is_terminal,
    set_condition,
    summarize,
    truncate,
)

pytestmark = pytest.mark.unit

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"


def test_transition_time_changes_only_on_flip() -> None:
    c, flipped = set_condition([], ConditionType.TRAINING, True, Reason.RUNNING, "go", T0, 1)
    assert flipped and c[0].last_transition_time == T0
    c, flipped = set_condition(c, ConditionType.TRAINING, True, Reason.RUNNING, "still", T1, 2)
    assert not flipped and c[0].last_transition_time == T0 and c[0].message == "still"
    assert c[0].observed_generation == 2
    c, flipped = set_condition(c, ConditionType.TRAINING, False, Reason.STOPPED, "x", T1, 2)
    assert flipped and c[0].last_transition_time == T1 and c[0].status == ConditionStatus.FALSE


def test_summary_from_conditions() -> None:
    c: list = []
    assert summarize(c) == Summary.PENDING
    c, _ = set_condition(c, ConditionType.ADMITTED, True, Reason.CREATED, "", T0, 1)
    assert summarize(c) == Summary.STARTING
    c, _ = set_condition(c, ConditionType.TRAINING, True, Reason.RUNNING, "", T0, 1)
    assert summarize(c) == Summary.RUNNING
    c, _ = set_condition(c, ConditionType.LONG_ROUND, True, Reason.SCALING_UP, "", T0, 1)
    assert summarize(c) == Summary.LONG_ROUND
    c, _ = set_condition(c, ConditionType.FAILED, True, Reason.BACKOFF_LIMIT_EXCEEDED, "", T0, 1)
    assert summarize(c) == Summary.FAILED and is_terminal(c)


def test_messages_truncated_and_status_roundtrip() -> None:
    assert len(truncate("x" * 5000)) == 1024
    st = RLTrainingJobStatus(lambda_="0.5", controller_state='{"a":1}')
    wire = st.to_wire()
    assert wire["lambda"] == "0.5" and wire["controllerState"] == '{"a":1}'
    assert RLTrainingJobStatus.model_validate(wire) == st
