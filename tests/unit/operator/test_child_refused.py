"""A child the API server refuses (a PriorityClass that does not exist, a toleration key
Kubernetes does not allow: what the spec carries through) is the spec's doing, not the
operator's: one Warning Event and one warning per distinct refusal, retries on the error
backoff, no reconcile error counted and no traceback; the job's status stays readable."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from operator_fakekube import FakeKube
from test_reports import NS, SPEC, add_job, open_env, run

from rlpacer.operator import handlers, names
from rlpacer.operator.handlers import JobLoops
from rlpacer.operator.kube import ApiError, ChildRefused

pytestmark = pytest.mark.unit


class RefusingKube(FakeKube):
    """Refuses the driver pod as kube-apiserver's Priority admission does."""

    def __init__(self, status: int = 403) -> None:
        super().__init__()
        self.status = status
        self.refusals = 0

    async def apply(self, obj: dict[str, Any], field_manager: str) -> dict[str, Any]:
        if obj["kind"] == "Pod":
            self.refusals += 1
            msg = f'pods "{obj["metadata"]["name"]}" is forbidden: no PriorityClass with name' \
                  ' x was found'
            raise ApiError(self.status, "Forbidden" if self.status == 403 else "Invalid", msg)
        return await super().apply(obj, field_manager)


def events(fk: FakeKube) -> list[dict[str, Any]]:
    return [o for p, o in fk.objects.items() if "/events/" in p]


@pytest.mark.parametrize("status", [403, 422])
def test_a_refused_child_is_an_event_not_a_reconcile_error(
    status: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(handlers, "ERROR_BACKOFF", (0.05,))

    async def body() -> None:
        fk = RefusingKube(status)
        add_job(fk, "job", {**SPEC, "scheduling": {"priorityClassName": "x"}})
        env, close = await open_env(fk)
        loops = JobLoops(env.jobs)
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            with pytest.raises(ChildRefused, match=names.driver_pod("job", 0)):
                await env.jobs.reconcile(rt)
            loops.ensure(NS, "job")
            for _ in range(100):
                await asyncio.sleep(0.01)
                if fk.refusals >= 5:
                    break
            assert fk.refusals >= 5  # retried, on the backoff
            assert loops.running(NS, "job")
        finally:
            await loops.stop_all()
            await close()
        evs = events(fk)
        assert len(evs) == 1 + 1, evs  # Created, then FailedCreate once for the same refusal
        failed = [e for e in evs if e["reason"] == "FailedCreate"]
        assert failed[0]["type"] == "Warning" and "PriorityClass" in failed[0]["message"]
        m = env.metrics.exposition().decode()
        assert "rlpacer_reconcile_errors_total{" not in m
        assert env.status("job")["summary"] == "Starting"  # status written, readable

    with caplog.at_level(logging.WARNING, logger="rlpacer.operator"):
        run(body)
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.WARNING
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
