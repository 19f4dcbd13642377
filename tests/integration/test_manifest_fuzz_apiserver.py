"""RLTrainingJob manifests generated from the generated CRD's openAPIV3Schema, applied to the
real API server with a real operator process watching the namespace.

The generator walks the schema (types, enums, minimum/maximum, lengths, item counts, patterns,
required fields, additionalProperties) and draws mostly in-schema manifests; about half the
draws then break one to three fields on purpose: a wrong type, one past a bound, a value
outside an enum, an unknown field. Each manifest is then either

* refused by the API server (schema, CEL rules) with a message naming a field, or
* admitted, and reconciled by the operator: status.observedGeneration catches up with a
  summary and an Admitted condition; when the operator's model refuses what the schema let
  through, Admitted is False with reason InvalidSpec and a message naming the spec field.

Throughout, the operator never exits, logs no ERROR or traceback, counts no reconcile error,
and settles: once the jobs' pods are up, no status write and no resourceVersion change for
several resync periods (no reconcile loop).

Replicas are drawn small (at most 3 per role) and only the last few admitted jobs are kept:
the point is what the operator makes of a manifest, not how many KWOK pods it gets. (No
ResourceQuota as a guard: its admission makes pod creation conflict (409) under load.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import string
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from test_operator import GROUP_PATH, ROOT, OperatorProc, crds, get

from rlpacer.api._base import DECIMAL_PATTERN
from rlpacer.testing.cluster import LocalCluster

pytestmark = pytest.mark.integration
__all__ = ["crds"]  # the module-scoped fixture, shared with test_operator

CRD = ROOT / "crds" / "rlpacer.io_rltrainingjobs.yaml"
#: Integer fields drawn small whatever their schema allows (pods, not the API, would grow).
SMALL = {("rollout", "replicas"): 2, ("trainer", "replicas"): 2,
         ("tailBatching", "longRound", "rolloutReplicas"): 3}
#: Draws per run (RLPACER_FUZZ_EXAMPLES for a longer hunt; CI keeps the default).
EXAMPLES = int(os.environ.get("RLPACER_FUZZ_EXAMPLES", "60"))


MINIMAL = {"model": {"source": "builtin://tiny-adder"}, "data": {"source": "builtin://adder"},
           "steps": 5, "promptsPerStep": 2}
REGRESSIONS = [
    {**MINIMAL, "model": {"source": "pvc://models/\U0001f600\x88"}},
    {**MINIMAL, "rollout": {"gpusPerReplica": 0},
     "scheduling": {"priorityClassName": "no-such-class", "queueName": "\u00c8\u00f1",
                    "tolerations": [{"key": "pvc://c/p.jsonl", "operator": "Exists"}]}},
]


def job_schema(path: Path = CRD) -> dict[str, Any]:
    crd = yaml.safe_load(path.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


# --- values from a schema --------------------------------------------------------------------

label_chars = string.ascii_lowercase + string.digits + "-._/"
any_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)


def decimals() -> st.SearchStrategy[str]:
    plain = st.floats(-5, 5, allow_nan=False).map(lambda x: f"{x:.6g}")
    return st.one_of(plain, st.sampled_from(["0", "1", "0.2", "4", "1e-6", "1.0", ".5", "2."]),
                     st.from_regex(DECIMAL_PATTERN, fullmatch=True).filter(lambda s: len(s) <= 32))


def strings(s: dict[str, Any]) -> st.SearchStrategy[str]:
    if "enum" in s:
        return st.sampled_from(s["enum"])
    if s.get("pattern") == DECIMAL_PATTERN:
        return decimals()
    if s.get("pattern"):
        return st.from_regex(s["pattern"], fullmatch=True)
    if s.get("format") == "date-time":
        return st.datetimes().map(lambda d: d.strftime("%Y-%m-%dT%H:%M:%SZ"))
    lo, hi = s.get("minLength", 0), min(s.get("maxLength", 40), 40)
    return st.one_of(
        st.text(label_chars, min_size=max(lo, 1), max_size=max(hi, 1)),
        st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=lo,
                max_size=hi),
        st.sampled_from(["builtin://tiny-adder", "builtin://adder", "pvc://c/p.jsonl",
                         "busybox:1", "Exists", "NoSchedule"]).filter(
            lambda v: lo <= len(v) <= s.get("maxLength", 10**6)),
    )


def values(s: dict[str, Any], path: tuple[str, ...] = ()) -> st.SearchStrategy[Any]:
    """In-schema values of ``s`` (CEL rules and cross-field rules are the API server's to
    judge: the draws need not satisfy them)."""
    t = s.get("type")
    if t == "object":
        props = s.get("properties")
        if props is None:
            ap = s.get("additionalProperties")
            if ap is None:
                return st.just({})
            return st.dictionaries(st.text(label_chars, min_size=1, max_size=12),
                                   values(ap, (*path, "*")), max_size=3)
        req = set(s.get("required", ()))
        return st.fixed_dictionaries(
            {k: values(v, (*path, k)) for k, v in props.items() if k in req},
            optional={k: values(v, (*path, k)) for k, v in props.items() if k not in req},
        )
    if t == "array":
        lo, hi = s.get("minItems", 0), min(s.get("maxItems", 4), 4)
        items = values(s["items"], (*path, "[]"))
        if path[-1:] == ("candidates",):  # sorted, usually: else CEL refuses every draw
            return st.lists(items, min_size=lo, max_size=hi, unique=True).map(
                lambda v: sorted(v) if v and v[0] % 3 else v)
        return st.lists(items, min_size=lo, max_size=hi)
    if t == "integer":
        lo = s.get("minimum", -(2**31))
        hi = s.get("maximum", lo + 10**6)
        if path in SMALL:
            hi = min(hi, SMALL[path])
        return st.integers(lo, hi)
    if t == "boolean":
        return st.booleans()
    if t == "string":
        return strings(s)
    return st.none()


def fields(s: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...],
                                                                         dict[str, Any]]]:
    """Every named field under ``s`` (object properties, depth first), with its schema."""
    for k, v in (s.get("properties") or {}).items():
        yield (*path, k), v
        yield from fields(v, (*path, k))


def broken(s: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A value the schema ``s`` refuses (or, for an unknown key, one it does not know)."""
    t = s.get("type")
    wrong_type = {
        "object": st.sampled_from(["x", 3, [1]]),
        "array": st.sampled_from([{"a": 1}, "x", 7]),
        "integer": st.sampled_from(["5", 1.5, True, 2**63, -(2**63) - 1, None]),
        "boolean": st.sampled_from(["yes", 1, "true", [True]]),
        "string": st.sampled_from([5, True, {"a": "b"}, ["x"], 0.5]),
    }.get(str(t), st.just(object()))
    out = [wrong_type]
    if t == "integer":
        if "minimum" in s:
            out.append(st.just(s["minimum"] - 1))
        if "maximum" in s:
            out.append(st.just(s["maximum"] + 1))
    if t == "string":
        if "enum" in s:
            out.append(st.sampled_from(["Bogus", s["enum"][0].lower(), ""]))
        if "maxLength" in s:
            out.append(st.just("a" * (s["maxLength"] + 1)))
        if "minLength" in s:
            out.append(st.just(""))
        if s.get("pattern") == DECIMAL_PATTERN:
            out.append(st.sampled_from(["NaN", "inf", "1,5", "0x10", "1e999", "-1e999", " 1"]))
    if t == "array" and "maxItems" in s:
        out.append(st.just([None] * (s["maxItems"] + 1)))
    return st.one_of(*out)


def set_at(obj: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        nxt = obj.get(k)
        if not isinstance(nxt, dict):
            nxt = obj[k] = {}
        obj = nxt
    obj[path[-1]] = value


@st.composite
def manifests(draw: st.DrawFn, spec_schema: dict[str, Any],
              paths: list[tuple[tuple[str, ...], dict[str, Any]]]) -> tuple[dict[str, Any], str]:
    spec = draw(values(spec_schema))
    what = "in-schema"
    if draw(st.booleans()):
        whats = []
        for _ in range(draw(st.integers(1, 3))):
            path, sub = draw(st.sampled_from(paths))
            if draw(st.integers(0, 4)) == 0:  # an unknown field beside a known one
                path = (*path[:-1], draw(st.sampled_from(["replica", "x-extra", "Steps",
                                                          "gpus"])))
                set_at(spec, path, draw(values(sub)))
                whats.append(f"unknown {'.'.join(path)}")
            else:
                set_at(spec, path, draw(broken(sub)))
                whats.append(f"broken {'.'.join(path)}")
        what = ", ".join(whats)
    return spec, what


# --- the API server's and the operator's verdicts --------------------------------------------

FIELD = re.compile(r"\b(spec|metadata)(\.|\[|:|\b)")


def names_a_field(body: Any) -> bool:
    if not isinstance(body, dict):
        return False
    causes = (body.get("details") or {}).get("causes") or []
    if any(str(c.get("field", "")).startswith(("spec", "metadata")) for c in causes):
        return True
    return bool(FIELD.search(str(body.get("message", ""))))


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def sample(metrics: str, name: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def bad_log_lines(op: OperatorProc) -> list[str]:
    return [line for line in op.log.read_text(errors="replace").splitlines()
            if " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback")]


@pytest.fixture
def watched(cluster: LocalCluster, crds: None, namespace: str) -> Iterator[OperatorProc]:
    op = OperatorProc(cluster, namespace).start()
    op.wait_ready()
    try:
        yield op
    finally:
        op.kill(signal.SIGTERM)


def test_manifests_from_the_crd_schema_are_refused_or_reconciled(
    cluster: LocalCluster, watched: OperatorProc, namespace: str
) -> None:
    op = watched
    schema = job_schema()
    spec_schema = schema["properties"]["spec"]
    paths = list(fields(spec_schema))
    jobs = f"{GROUP_PATH}/namespaces/{namespace}/rltrainingjobs"
    seen: dict[str, int] = {"refused": 0, "admitted": 0, "invalid": 0, "gone": 0}
    live: list[str] = []
    n = [0]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much])
    @given(drawn=manifests(spec_schema, paths), strict=st.booleans())
    # what earlier draws found: a character past U+FFFF (its JSON escape is no YAML: every
    # apply of the children failed); a missing PriorityClass and a toleration key Kubernetes
    # refuses (the driver pod and StatefulSets refused: an error and a traceback each pass)
    @example(drawn=(REGRESSIONS[0], "explicit"), strict=True)
    @example(drawn=(REGRESSIONS[1], "explicit"), strict=False)
    def one(drawn: tuple[dict[str, Any], str], strict: bool) -> None:
        spec, what = drawn
        n[0] += 1
        name = f"fz-{n[0]}"
        obj = {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingJob",
               "metadata": {"name": name, "namespace": namespace}, "spec": spec}
        where = f"{what}: {json.dumps(spec)[:1500]}"
        # kubectl's default (Strict: unknown fields refused) or the API's (Warn: pruned)
        q = "?fieldValidation=Strict" if strict else ""
        code, body = cluster.http.request("POST", jobs + q, obj)
        assert code in (201, 400, 422), (code, body, where)
        if code != 201:
            seen["refused"] += 1
            assert names_a_field(body), (body, where)
            return
        got = wait_reconciled(cluster, jobs, name, body["metadata"]["generation"], op, where)
        if got is None:  # finished and deleted (ttlSecondsAfterFinished) before we looked
            assert spec.get("ttlSecondsAfterFinished") is not None, where
            seen["gone"] += 1
            return
        adm = conditions(got)["Admitted"]
        if adm["status"] == "False":
            assert adm["reason"] == "InvalidSpec", (adm, where)
            assert "spec." in adm["message"], (adm, where)
            assert got["status"]["summary"] == "Pending", (got["status"], where)
            seen["invalid"] += 1
        else:
            assert adm["status"] == "True", (adm, where)
            seen["admitted"] += 1
        assert op.proc is not None and op.proc.poll() is None, op.log.read_text()[-3000:]
        m = op.metrics()
        assert sample(m, "rlpacer_reconcile_errors_total") == 0, (where, bad_log_lines(op))
        assert not bad_log_lines(op), (bad_log_lines(op)[:20], where)
        live.append(name)
        # keep a few jobs (and their KWOK pods) for the settle check; the rest go
        while len(live) > 6:
            cluster.http.request("DELETE", f"{jobs}/{live.pop(0)}")

    one()
    assert seen["refused"] >= 5 and seen["admitted"] + seen["invalid"] >= 5, seen

    # no reconcile loop: with nothing changing, the jobs' resourceVersions and the
    # operator's status writes stand still for three resync periods (2 s each)
    def versions() -> tuple[dict[str, str], float]:
        listing = get(cluster, jobs) or {}
        rvs = {i["metadata"]["name"]: i["metadata"]["resourceVersion"]
               for i in listing.get("items") or []}
        return rvs, sample(op.metrics(), "rlpacer_status_write_duration_seconds_count")

    deadline = time.monotonic() + 60
    before = versions()
    while True:
        time.sleep(6)
        after = versions()
        if after == before:
            break
        assert time.monotonic() < deadline, ("no settling", before, after)
        before = after
    assert op.proc is not None and op.proc.poll() is None, op.log.read_text()[-3000:]
    assert sample(op.metrics(), "rlpacer_reconcile_errors_total") == 0
    assert not bad_log_lines(op), bad_log_lines(op)[:20]
    print("verdicts:", seen)


def wait_reconciled(cluster: LocalCluster, jobs: str, name: str, generation: int,
                    op: OperatorProc, where: str) -> dict[str, Any] | None:
    deadline = time.monotonic() + 30
    while True:
        code, got = cluster.http.request("GET", f"{jobs}/{name}")
        if code == 404:
            return None
        assert code == 200, (code, got)
        stt = got.get("status") or {}
        if (stt.get("observedGeneration") == generation and stt.get("summary")
                and "Admitted" in conditions(got)):
            return got  # type: ignore[no-any-return]
        assert op.proc is not None and op.proc.poll() is None, op.log.read_text()[-3000:]
        assert time.monotonic() < deadline, ("not reconciled", stt, where,
                                             op.log.read_text()[-3000:])
        time.sleep(0.1)


# --- every bound of the CRDs, at the real API server (issue 32, defect 2) --------------------

BOUND_RULE = re.compile(
    r"double\(self\.(\w+)\) (>=|>) (-?[\d.e+]+) && double\(self\.\1\) (<=|<) (-?[\d.e+]+)")


def bounded_fields(s: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[
        tuple[tuple[str, ...], str, float, bool]]:
    """(path, "integer" or "decimal", the upper bound, whether the bound itself is allowed)
    for every bounded number under the object schema ``s`` (arrays left out)."""
    for r in s.get("x-kubernetes-validations") or []:
        m = BOUND_RULE.search(r["rule"])
        if m:
            yield (*path, m.group(1)), "decimal", float(m.group(5)), m.group(4) == "<="
    for k, v in (s.get("properties") or {}).items():
        if v.get("type") == "integer" and "maximum" in v:
            yield (*path, k), "integer", v["maximum"], True
        elif v.get("type") == "object":
            yield from bounded_fields(v, (*path, k))


def refused_naming(body: Any, field: str) -> bool:
    causes = (body.get("details") or {}).get("causes") or []
    return any(str(c.get("field", "")) == field for c in causes) or field in str(
        body.get("message", ""))


def test_the_api_server_refuses_every_number_past_its_bound_naming_the_field(
    cluster: LocalCluster, crds: None, namespace: str
) -> None:
    """The issue's manifest (promptOverprovision "1e308", which every step report then failed
    on) is refused with the field named; so is every bounded number of the job's and the
    policy's spec one past its maximum, and each decimal at its maximum is admitted.
    (Dry runs: validation, CEL included, runs in full; nothing is stored.)"""
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/rltrainingpolicies.rlpacer.io")
    jobs = f"{GROUP_PATH}/namespaces/{namespace}/rltrainingjobs?dryRun=All"
    pols = f"{GROUP_PATH}/namespaces/{namespace}/rltrainingpolicies?dryRun=All"

    def job_with(path: tuple[str, ...], value: Any) -> dict[str, Any]:
        spec = json.loads(json.dumps(MINIMAL))
        set_at(spec, path, value)
        return {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingJob",
                "metadata": {"name": "bounds", "namespace": namespace}, "spec": spec}

    def policy_with(path: tuple[str, ...], value: Any) -> dict[str, Any]:
        spec: dict[str, Any] = {}
        set_at(spec, path, value)
        return {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingPolicy",
                "metadata": {"name": "bounds", "namespace": namespace}, "spec": spec}

    code, body = cluster.http.request(
        "POST", jobs, job_with(("tailBatching", "promptOverprovision"), "1e308"))
    assert code == 422, (code, body)
    assert refused_naming(body, "spec.tailBatching.promptOverprovision"), body
    assert "promptOverprovision must be in [1, 16]" in body["message"], body

    policy_crd = yaml.safe_load((ROOT / "crds" / "rlpacer.io_rltrainingpolicies.yaml")
                                .read_text())["spec"]["versions"][0]["schema"]
    checked = 0
    for url, make, schema in ((jobs, job_with, job_schema()["properties"]["spec"]),
                              (pols, policy_with, policy_crd["openAPIV3Schema"]["properties"]
                               ["spec"])):
        for path, kind, top, closed in bounded_fields(schema):
            field = "spec." + ".".join(path)
            if kind == "integer":
                past: Any = int(top) + 1
            else:
                past = repr(top * (1 + 1e-6) if closed else top)
            code, body = cluster.http.request("POST", url, make(path, past))
            assert code == 422 and refused_naming(body, field), (field, past, code, body)
            if kind == "decimal":  # the largest value allowed is admitted
                at = repr(top if closed else top * (1 - 1e-6))
                code, body = cluster.http.request("POST", url, make(path, at))
                assert code == 201, (field, at, code, body)
            checked += 1
    assert checked >= 40, checked  # every integer and decimal of both specs
