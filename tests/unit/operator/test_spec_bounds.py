"""What the operator computes from a spec stays finite at the spec's bounds, and a stored spec
past them is answered with the field named, never a 500 (issue 32, defect 2).

* Specs with every number at its maximum (and at its minimum), generated from the CRD's own
  bounds: the report bounds, the plan, an accepted report at those bounds, a pass of the
  reconcile decision (deadline and TTL arithmetic), the children, and policy enforcement with
  a policy at its maxima all compute.
* A running job whose stored spec carries ``promptOverprovision: "1e308"`` (written before the
  bound; here straight into the in-memory API server, as an older CRD let it through): GET
  plan and POST steps answer 422 InvalidSpec naming ``spec.tailBatching.promptOverprovision``
  (a 500 before), and the job's Admitted condition says the same; the report path itself
  refuses such a value with a 422 should an unchecked spec reach it.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from operator_fakekube import FakeKube
from test_reports import NS, SPEC, add_job, open_env, report, run

from rlpacer.api import crd
from rlpacer.api.job import MAX_STEPS, RLTrainingJobSpec, parse_spec
from rlpacer.api.policy import parse_policy
from rlpacer.api.protocol import MAX_SECONDS, StepReport
from rlpacer.api.status import RLTrainingJobStatus
from rlpacer.control.plan import ReportRejected
from rlpacer.operator import builders, enforce, hosting
from rlpacer.operator.decide import Observed, decide
from rlpacer.operator.reports import accept_report, current_plan, report_bounds
from rlpacer.operator.runtime import job_path

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)
RANGE_RULE = re.compile(
    r"double\(self\.(\w+)\) (>=|>) (-?[\d.e+]+) && double\(self\.\1\) (<=|<) (-?[\d.e+]+)")


def _at(schema: dict[str, Any], top: bool) -> dict[str, Any]:
    """An object with every integer and ranged decimal of ``schema`` at its maximum (``top``)
    or minimum, recursively (arrays and free-form maps left out)."""
    ends: dict[str, str] = {}
    for r in schema.get("x-kubernetes-validations") or []:
        m = RANGE_RULE.search(r["rule"])
        if m:
            lo_op, lo, hi_op, hi = m.group(2), float(m.group(3)), m.group(4), float(m.group(5))
            if top:
                ends[m.group(1)] = repr(hi if hi_op == "<=" else hi - max(abs(hi), 1) * 1e-6)
            else:
                ends[m.group(1)] = repr(lo if lo_op == ">=" else lo + max(abs(lo), 1) * 1e-6)
    out: dict[str, Any] = {}
    for k, v in (schema.get("properties") or {}).items():
        if v.get("type") == "integer":
            out[k] = v["maximum" if top else "minimum"]
        elif k in ends:
            out[k] = ends[k]
        elif v.get("type") == "object" and v.get("properties"):
            sub = _at(v, top)
            if sub:
                out[k] = sub
    return out


def extreme_spec(top: bool) -> RLTrainingJobSpec:
    schema = crd.rltrainingjob_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = _at(schema["properties"]["spec"], top)
    spec["model"] = {"source": "builtin://tiny-adder"}
    spec["data"] = {**spec["data"], "source": "/data/train.jsonl"}  # evalFraction: files only
    g = spec["groupControl"]["initial"]
    # the cross-field rules: candidates strictly increasing and holding initial; the overlong
    # buffer below the length cap (the cap's minimum, 1, leaves a buffer of 0)
    spec["groupControl"]["candidates"] = list(range(g - 15, g + 1)) if top else [g]
    cap = spec["rollout"]["maxResponseTokens"]
    spec["algorithm"]["overlongPenalty"]["bufferTokens"] = min(
        spec["algorithm"]["overlongPenalty"]["bufferTokens"], cap - 1)
    spec["algorithm"]["name"] = "DAPO"  # dynamic sampling: the report bounds' largest factor
    if spec["trainer"]["gpusPerReplica"]:  # CPU ranks per pod only without GPUs
        spec["trainer"]["cpuRanksPerReplica"] = 1
    spec["checkpoint"]["volumeClaim"] = "ckpt"  # an eviction grace needs a claim
    # wide long-round engines are the long round's extra replicas: one more than the rollout's
    lr = spec["tailBatching"]["longRound"]
    if top:
        spec["rollout"]["replicas"] = lr["rolloutReplicas"] - 1
    else:
        lr["rolloutReplicas"] = spec["rollout"]["replicas"] + 1
    return parse_spec(spec)


@pytest.mark.parametrize("top", [True, False], ids=["maxima", "minima"])
def test_every_computation_at_the_bounds_is_finite(top: bool) -> None:
    spec = extreme_spec(top)
    if top:
        assert spec.steps == MAX_STEPS and spec.tail_batching.prompt_overprovision == "16.0"
        assert spec.group_control.lambda_max == "1000.0" and spec.prompts_per_step == 1_000_000
    # the plan (SAGC's state from the spec) and the report bounds
    st = RLTrainingJobStatus(controller_state=hosting.new_state(spec))
    plan = current_plan(spec, st)
    g = plan.group_size
    bounds = report_bounds(spec, g)
    for name, (bound, why) in bounds.items():
        assert isinstance(bound, int) and 0 <= bound < 2**63, (name, bound, why)
    # a report at every bound: accepted, its status within the CRD's schema
    max_len = bounds["lengths.max"][0]
    body = {**report(0, g, max_len, med=max_len, nxt="Long"),
            "lengths": {"max": max_len, "median": float(max_len), "p90": float(max_len),
                        "count": bounds["lengths.count"][0],
                        "aborted": bounds["lengths.aborted"][0]},
            "seconds": {"rollout": MAX_SECONDS, "reward": MAX_SECONDS, "train": MAX_SECONDS,
                        "sync": MAX_SECONDS},
            "longQueue": bounds["longQueue"][0], "reward": 1e6}
    new, acc = accept_report(spec, st, StepReport.model_validate(body), T0, 1, None, [])
    assert acc.new and acc.plan.step == 1
    assert crd.schema_violations(crd.status_schema(), new.to_wire()) == []
    assert math.isfinite(float(new.lambda_ or "0"))
    # the reconcile decision, its deadline and TTL arithmetic included, over a long time
    d = decide(spec, RLTrainingJobStatus(), Observed(), T0, 1)
    d = decide(spec, d.status, Observed(driver_phase="Running", rollout_ready=1), T0, 1)
    far = T0 + timedelta(seconds=(spec.active_deadline_seconds or 0) + 1)
    d = decide(spec, d.status, Observed(driver_phase="Running", rollout_ready=1), far, 1)
    assert d.status.summary == "Failed", d.status.conditions  # DeadlineExceeded
    d = decide(spec, d.status, Observed(), far, 1)
    assert d.requeue_after is None or math.isfinite(d.requeue_after)
    # the children
    kids = builders.build_children(builders.BuildInputs(
        name="big", namespace=NS, uid="u", spec=spec, attempt=2**31, rollout_replicas=1024,
        report_url="https://op:8080"))
    assert kids
    # a policy at its maxima (and minima) enforced on the job
    pschema = crd.rltrainingpolicy_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    pspec = _at(pschema["properties"]["spec"], top)
    pspec.pop("defaults", None)  # (defaults must obey the limits: a separate, webhook matter)
    pol = parse_policy({"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingPolicy",
                        "metadata": {"name": "p", "namespace": NS}, "spec": pspec})
    lim = enforce.limits(spec, [pol])
    assert lim.long_round_replicas >= 1


def test_a_stored_spec_past_the_bounds_is_answered_422_naming_the_field() -> None:
    """A running job (children, token, controller state made under a valid spec) whose stored
    spec then carries a value an older CRD let through; a new operator reads it."""
    async def body() -> None:
        fk = FakeKube()
        add_job(fk, "old")
        env, close = await open_env(fk)
        try:
            rt = await env.jobs.get(NS, "old")
            assert rt is not None
            await env.jobs.reconcile(rt)
            tok = await env.jobs.token(rt)
            assert tok
            g = (await env.plan("old"))["groupSize"]
        finally:
            await close()
        obj = fk.objects[job_path(NS, "old")]
        obj["spec"]["tailBatching"]["promptOverprovision"] = "1e308"
        fk.put_object(job_path(NS, "old"), obj)
        env, close = await open_env(fk)  # the operator, started again, reads the job
        try:
            rt = await env.jobs.get(NS, "old")
            assert rt is not None
            await env.jobs.reconcile(rt)
            adm = {c["type"]: c for c in env.status("old")["conditions"]}["Admitted"]
            assert (adm["status"], adm["reason"]) == ("False", "InvalidSpec"), adm
            assert "spec.tailBatching.promptOverprovision" in adm["message"], adm
            r = await env.client.get(f"/v1/namespaces/{NS}/rltrainingjobs/old/plan",
                                     headers={"Authorization": f"Bearer {tok}"})
            err = await r.json()
            assert r.status == 422 and err["reason"] == "InvalidSpec", err
            assert "spec.tailBatching.promptOverprovision" in err["message"], err
            code, err = await env.post("old", report(0, g, 20), token=tok)
            assert code == 422 and err["reason"] == "InvalidSpec", err
            assert "spec.tailBatching.promptOverprovision" in err["message"], err
        finally:
            await close()

    run(body)


def test_the_report_path_refuses_an_unchecked_overprovision_with_a_422() -> None:
    """Should a spec reach the report path without validation, its arithmetic still raises
    no OverflowError (a 500): a ReportRejected naming the field (a 422)."""
    spec = parse_spec(SPEC)
    for bad in ("1e308", "inf", "nan"):
        unchecked = spec.model_copy(update={"tail_batching": spec.tail_batching.model_copy(
            update={"prompt_overprovision": bad})})  # model_copy: no validation
        with pytest.raises(ReportRejected) as exc:
            report_bounds(unchecked, 8)
        assert exc.value.reason == "InvalidSpec"
        assert "spec.tailBatching.promptOverprovision" in exc.value.message
        assert "[1, 16]" in exc.value.message
