"""A driver that exits with contract.EXIT_DATA_INVALID fails the job with reason DataInvalid
and the driver's error line (its termination message), with no new attempt; so does
contract.EXIT_LEARNER_DOES_NOT_FIT, with reason LearnerDoesNotFit (the numbers and the fixes);
any other exit code is a new attempt within backoffLimit. Through the operator's real
observe/reconcile against a fake API server."""

from __future__ import annotations

import pytest
from operator_fakekube import FakeKube
from test_reports import NS, add_job, open_env, run

from rlpacer.api import contract
from rlpacer.operator import names
from rlpacer.operator.kube import object_path

pytestmark = pytest.mark.unit

DATA_WHY = ("data invalid: spec.data.source: /mnt/rlpacer/claims/d/train.jsonl line 7: field"
            " 'meta.question' (spec.data.promptField) missing")
FIT_WHY = ("learner does not fit: 152.8 GiB per rank (weights 6.4 GiB, ...) exceeds 79.6 GiB"
           " per rank (GPU NVIDIA H100 80GB HBM3); fixes: spec.trainer.activationCheckpointing:"
           " true")
#: exit code -> (the Failed condition's reason, the driver's last error line)
PERMANENT = {contract.EXIT_DATA_INVALID: ("DataInvalid", DATA_WHY),
             contract.EXIT_LEARNER_DOES_NOT_FIT: ("LearnerDoesNotFit", FIT_WHY)}


@pytest.mark.parametrize("code", [contract.EXIT_DATA_INVALID,
                                  contract.EXIT_LEARNER_DOES_NOT_FIT, 1])
def test_a_data_invalid_exit_fails_the_job_without_a_retry(code: int) -> None:
    assert len({0, 2, 3, *PERMANENT}) == 2 + len(PERMANENT) + 1  # codes of their own
    reason, why = PERMANENT.get(code, ("", DATA_WHY))

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
                    "exitCode": code, "reason": "Error",
                    "message": f"Loading the run config\nerror: {why}\n"}}}]}
            rt.children_changed = True  # the driver pod's watch event (Kopf's handler sets it)
            await env.jobs.reconcile(rt)
            st = env.status("job")
            reasons = [e.get("reason") for e in fk.of_kind("events")]
            if code not in PERMANENT:
                assert st["attempt"] == 1 and st["failures"] == 1
                assert "Restarting" in reasons and "DataInvalid" not in reasons
                return
            assert st["summary"] == "Failed" and st["attempt"] == 0
            assert st.get("failures", 0) == 0
            failed = next(c for c in st["conditions"] if c["type"] == "Failed")
            assert failed["reason"] == reason
            assert failed["message"] == why
            assert reason in reasons and "Restarting" not in reasons
            assert not fk.of_kind("statefulsets")  # the workloads are released
        finally:
            await close()

    run(body)
