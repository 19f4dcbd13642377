"""A driver that exits with contract.EXIT_DATA_INVALID fails the job with reason DataInvalid
and the driver's error line (its termination message), with no new attempt; any other exit
code is a new attempt within backoffLimit. Through the operator's real observe/reconcile
against a fake API server."""

from __future__ import annotations

import pytest
from operator_fakekube import FakeKube
from test_reports import NS, add_job, open_env, run

from rlpacer.api import contract
from rlpacer.operator import names
from rlpacer.operator.kube import object_path

pytestmark = pytest.mark.unit

LOG_TAIL = ("Loading the run config\nerror: data invalid: spec.data.source:"
            " /mnt/rlpacer/claims/d/train.jsonl line 7: field 'meta.question'"
            " (spec.data.promptField) missing\n")


@pytest.mark.parametrize("code", [contract.EXIT_DATA_INVALID, 1])
def test_a_data_invalid_exit_fails_the_job_without_a_retry(code: int) -> None:
    async def body() -> None:
        fk = FakeKube()
        add_job(fk, "job")
        env, close = await open_env(fk)
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            driver = object_path("v1", "pods", NS, names.driver_pod("job", 0))
            fk.objects[driver]["status"] = {"phase": "Failed", "containerStatuses": [{
                "name": "main", "state": {"terminated": {
                    "exitCode": code, "reason": "Error", "message": LOG_TAIL}}}]}
            rt.children_changed = True  # the driver pod's watch event (Kopf's handler sets it)
            await env.jobs.reconcile(rt)
            st = env.status("job")
            reasons = [e.get("reason") for e in fk.of_kind("events")]
            if code != contract.EXIT_DATA_INVALID:
                assert st["attempt"] == 1 and st["failures"] == 1
                assert "Restarting" in reasons and "DataInvalid" not in reasons
                return
            assert st["summary"] == "Failed" and st["attempt"] == 0
            assert st.get("failures", 0) == 0
            failed = next(c for c in st["conditions"] if c["type"] == "Failed")
            assert failed["reason"] == "DataInvalid"
            assert failed["message"] == (
                "data invalid: spec.data.source:"
                " /mnt/rlpacer/claims/d/train.jsonl line 7: field 'meta.question'"
                " (spec.data.promptField) missing")
            assert "DataInvalid" in reasons and "Restarting" not in reasons
            assert not fk.of_kind("statefulsets")  # the workloads are released
        finally:
            await close()

    run(body)
