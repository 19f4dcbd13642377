"""Step reports are typed strictly (issue 32, defect 6): the protocol is JSON with integers, so
a string, a boolean or a float (even a whole one) where an integer is meant, and a string or a
boolean where a number is meant, is refused with the field named; never coerced. What the
trainer sends (its models' JSON) is accepted."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from pydantic import ValidationError
from test_reports import admitted, report, run

from rlpacer.api.protocol import RoundKind, StepReport, StepSeconds

pytestmark = pytest.mark.unit

#: (where, value) replacing one field of a valid report; each must be refused naming ``where``.
LOOSE: list[tuple[str, Any]] = [
    ("groupSize", "8"), ("lengths.count", "64"), ("step", 0.0), ("step", True),
    ("attempt", False), ("lengths.max", "150"), ("lengths.max", 150.0), ("longQueue", 1.0),
    ("lengths.aborted", True), ("lengths.median", "10"), ("lengths.p90", True),
    ("seconds.rollout", "1.5"), ("seconds.train", False), ("reward", "0.5"), ("reward", True),
]


def _with(body: dict[str, Any], where: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    node = out
    *path, last = where.split(".")
    for k in path:
        node = node[k]
    node[last] = value
    return out


def _loc(err: ValidationError) -> set[str]:
    return {".".join(str(p) for p in e["loc"]) for e in err.errors()}


@pytest.mark.parametrize(("where", "value"), LOOSE)
def test_the_model_refuses_loose_types_naming_the_field(where: str, value: Any) -> None:
    ok = report(0, 8, 20)
    StepReport.model_validate(ok)  # the template is valid
    with pytest.raises(ValidationError) as exc:
        StepReport.model_validate(_with(ok, where, value))
    assert _loc(exc.value) == {where}, exc.value.errors()


def test_the_model_takes_json_numbers_as_they_are() -> None:
    # an integer is a number: a whole median or seconds value may come without ".0"
    r = StepReport.model_validate({**report(0, 8, 20), "reward": 1,
                                   "seconds": {"rollout": 2, "train": 0.5}})
    assert r.seconds == StepSeconds(rollout=2.0, train=0.5) and r.reward == 1.0


def test_what_the_trainer_sends_is_accepted() -> None:
    """The driver's own report (``rlpacer_trainer.driver``), through JSON as its client sends
    it (``report.to_wire()``), validates unchanged: the strict types refuse no trainer."""
    from rlpacer_trainer.driver import length_summary

    for lengths, aborted in (([12, 40, 7, 33], 3), ([], 0)):
        sent = StepReport(
            attempt=0, step=3, group_size=8, round_kind=RoundKind.SHORT,
            lengths=length_summary(lengths, aborted),
            seconds=StepSeconds(rollout=1.25, reward=0.0, train=0.5, sync=0.1),
            long_queue=2, next_round_kind=RoundKind.LONG, reward=0.0)
        wire = json.loads(json.dumps(sent.to_wire()))
        assert StepReport.model_validate(wire) == sent


def test_the_endpoint_answers_422_naming_the_field_and_changes_nothing() -> None:
    async def body() -> None:
        env, close = await admitted()
        try:
            g = (await env.plan("job"))["groupSize"]
            ok = report(0, g, 20)
            before = env.status("job")
            for where, value in [("groupSize", str(g)), ("lengths.count", str(4 * g)),
                                 ("step", True), ("step", 0.0), ("attempt", False),
                                 ("lengths.max", "150")]:
                code, err = await env.post("job", _with(ok, where, value))
                assert code == 422, (where, value, err)
                assert err["message"].startswith(f"{where}: "), (where, err)
                assert env.status("job") == before
            code, plan = await env.post("job", ok)
            assert code == 200 and plan["step"] == 1, plan
        finally:
            await close()

    run(body)
