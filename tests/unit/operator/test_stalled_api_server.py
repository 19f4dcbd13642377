"""A stalled API server (stopped, or its etcd away: requests hang, no error) while step
reports come in: each is answered 503 with Retry-After within report_write_timeout_seconds,
never left hanging, and its retry once the API server answers again is counted once
(issue 32, defect 3). Over the in-memory API server; against the real one, stopped with
SIGSTOP: tests/integration/test_control_plane_outage.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from operator_fakekube import FakeKube
from test_reports import NS, add_job, open_env, report, run

from rlpacer.operator.settings import OperatorSettings

pytestmark = pytest.mark.unit

BOUND = 0.5


class Stalling(FakeKube):
    """Requests hang while ``stalled`` is set (as an API server stopped with SIGSTOP holds
    its connections), then go on."""

    def __init__(self) -> None:
        super().__init__()
        self.stalled = asyncio.Event()
        self.resumed = asyncio.Event()

    async def request(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        if self.stalled.is_set():
            await self.resumed.wait()
        return await super().request(method, path, body, **kw)


def test_a_report_is_answered_503_while_the_status_write_hangs_then_counted_once() -> None:
    async def body() -> None:
        fk = Stalling()
        add_job(fk, "job")
        cfg = OperatorSettings(leader_election=False, resync_seconds=3600,
                               report_write_timeout_seconds=BOUND)
        env, close = await open_env(fk, cfg)
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            tok = await env.token("job")
            g = (await env.plan("job"))["groupSize"]
            code, plan = await env.post("job", report(0, g, 20.0), tok)
            assert code == 200, plan
            body1 = report(1, plan["groupSize"], 20.0)

            async def stalled_post() -> None:
                t0 = time.monotonic()
                r = await asyncio.wait_for(env.client.post(  # never left hanging
                    f"/v1/namespaces/{NS}/rltrainingjobs/job/steps", json=body1,
                    headers={"Authorization": f"Bearer {tok}"}), BOUND + 3)
                took = time.monotonic() - t0
                err = await r.json()
                assert r.status == 503 and r.headers["Retry-After"] == "1", err
                assert err["reason"] == "Unavailable" and "did not" in err["message"], err
                assert BOUND * 0.9 <= took < BOUND + 1.0, took

            fk.stalled.set()
            await stalled_post()  # its status write hangs
            rt.applied_at = float("-inf")  # a full pass: it re-reads the job under the job's lock
            pass_ = asyncio.create_task(env.jobs.reconcile(rt))
            await asyncio.sleep(0.05)
            assert rt.lock.locked()
            await stalled_post()  # waits for the lock the hung pass holds
            fk.stalled.clear()
            fk.resumed.set()
            await pass_
            code, plan = await env.post("job", body1, tok)
            assert code == 200 and plan["step"] == 2, plan
            assert env.status("job")["step"] == 2
            code, again = await env.post("job", body1, tok)  # a repeat: same answer
            assert code == 200 and again == plan
        finally:
            await close()

    run(body)
