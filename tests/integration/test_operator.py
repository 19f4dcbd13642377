"""The operator against the real local control plane (etcd, apiserver, controllers, KWOK).

Each test runs its own operator process (``rlpacer operator``) watching only the test's
namespace, with its Lease there; a test driver plays the trainer over HTTPS, verifying the
operator's certificate (made for these tests: :func:`report_certs`) with its CA.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from rlpacer.api import contract
from rlpacer.api.job import effective_algorithm, parse_spec
from rlpacer.api.protocol import (
    PLAN_FIELDS_HEADER,
    StepReport,
    plan_path,
    release_path,
    steps_path,
)
from rlpacer.control.plan import JobController
from rlpacer.operator import hosting, names, tls
from rlpacer.testing import harness
from rlpacer.testing.cluster import LocalCluster

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
GROUP_PATH = "/apis/rlpacer.io/v1alpha1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@functools.cache
def report_certs() -> Path:
    """The report endpoint's certificate of every operator these tests start (and its CA)."""
    return tls.generate(Path(tempfile.mkdtemp(prefix="rlpacer-test-report-tls-")),
                        ["127.0.0.1", "localhost"], days=2)


@functools.cache
def client_context() -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(report_certs() / "ca.crt"))


class OperatorProc:
    """``rlpacer operator`` as a child process (KUBECONFIG = the cluster's admin)."""

    def __init__(self, cluster: LocalCluster, namespace: str, lease: str = "rlpacer-operator",
                 identity: str = "op-a", report_url: str | None = None,
                 report_rate: float = 0, report_burst: int = 50,
                 also_watch: tuple[str, ...] = (), resync_seconds: float = 2,
                 extra_args: tuple[str, ...] = (), kubeconfig: Path | None = None) -> None:
        self.cluster = cluster
        #: The operator's credentials (default: the cluster's admin).
        self.kubeconfig = kubeconfig or Path(cluster.kubeconfig)
        #: More flags, after (so overriding) the ones below.
        self.extra_args = extra_args
        self.resync_seconds = resync_seconds
        self.namespace = namespace
        #: Namespaces watched besides ``namespace`` (which holds the Lease).
        self.also_watch = also_watch
        self.lease = lease
        self.identity = identity
        self.report_port = _free_port()
        self.metrics_port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        # Replicas share one URL in a real deployment (the Service); pods keep it.
        self.report_url = report_url or self.base
        # These tests play a driver hundreds of times faster than a real one (one report per
        # step): unlimited unless a test sets the per-job rate.
        self.report_rate, self.report_burst = report_rate, report_burst
        self.log = Path(tempfile.mkstemp(prefix=f"rlpacer-op-{identity}-", suffix=".log")[1])

    @property
    def base(self) -> str:
        return f"https://127.0.0.1:{self.report_port}"

    def start(self) -> OperatorProc:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        args = [
            sys.executable, "-m", "rlpacer.cli", "operator",
            "--namespaces", ",".join((self.namespace, *self.also_watch)),
            "--operator-namespace", self.namespace,
            "--report-host", "127.0.0.1", "--report-port", str(self.report_port),
            "--report-url", self.report_url, "--report-cert-dir", str(report_certs()),
            "--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port),
            "--lease-name", self.lease, "--identity", self.identity,
            "--lease-duration-seconds", "4", "--lease-renew-seconds", "1",
            "--lease-retry-seconds", "0.5", "--resync-seconds", str(self.resync_seconds),
            "--log-level", "INFO",
            "--report-rate-per-second", str(self.report_rate),
            "--report-burst", str(self.report_burst), *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, env=env, stdout=self.log.open("ab"),
                                     stderr=subprocess.STDOUT)
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/readyz",
                                        timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def serving(self) -> bool:
        """Whether the report server accepts connections (a standby serves before it leads)."""
        try:
            socket.create_connection(("127.0.0.1", self.report_port), timeout=2).close()
            return True
        except OSError:
            return False

    def _wait(self, until: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"operator exited: {self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"operator not {what}: {self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def wait_serving(self, timeout: float = 60) -> None:
        self._wait(self.serving, "serving", timeout)

    def wait_ready(self, timeout: float = 60) -> None:
        self._wait(self.ready, "ready", timeout)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=5) as r:
            return r.read().decode()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def crds(cluster: LocalCluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/rltrainingjobs.rlpacer.io")


@pytest.fixture
def operator(cluster: LocalCluster, crds: None, namespace: str) -> Iterator[OperatorProc]:
    op = OperatorProc(cluster, namespace).start()
    op.wait_ready()
    try:
        yield op
    finally:
        op.kill(signal.SIGTERM)


# --- helpers -------------------------------------------------------------------------------


def small_job(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": {"source": "builtin://tiny-adder"},
        "data": {"source": "builtin://adder"},
        "steps": 100,
        "promptsPerStep": 8,
        "rollout": {"replicas": 1, "gpusPerReplica": 0, "maxResponseTokens": 1024},
        "trainer": {"replicas": 1, "gpusPerReplica": 0},
        "groupControl": {"stragglerRatio": "4", "targetStragglerRate": "0.2", "seed": 3},
        "tailBatching": {"longRound": {"rolloutReplicas": 3, "scaleUpTimeoutSeconds": 30}},
        "backoffLimit": 1,
    }
    for k, v in spec.items():
        base[k] = v
    return {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingJob",
            "metadata": {"name": name, "namespace": namespace}, "spec": base}


def apply(cluster: LocalCluster, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))


def get(cluster: LocalCluster, path: str) -> dict[str, Any] | None:
    code, body = cluster.http.request("GET", path)
    return body if code == 200 else None


def job(cluster: LocalCluster, ns: str, name: str) -> dict[str, Any]:
    obj = get(cluster, f"{GROUP_PATH}/namespaces/{ns}/rltrainingjobs/{name}")
    assert obj is not None
    return obj


def status(cluster: LocalCluster, ns: str, name: str) -> dict[str, Any]:
    return job(cluster, ns, name).get("status") or {}


def wait(cluster: LocalCluster, fn: Any, what: str, timeout: float = 60) -> Any:
    return cluster.wait_for(fn, timeout=timeout, what=what, interval=0.2)


def token(cluster: LocalCluster, ns: str, name: str) -> str:
    sec = wait(cluster, lambda: get(cluster, f"/api/v1/namespaces/{ns}/secrets/"
                                             f"{names.secret(name)}"), "token secret")
    return base64.b64decode(sec["data"][contract.TOKEN_KEY]).decode()


def http(method: str, url: str, tok: str | None, body: Any = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    if tok:
        req.add_header("Authorization", f"Bearer {tok}")
    try:
        with urllib.request.urlopen(req, timeout=30, context=client_context()) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def report(step: int, g: int, mx: float, attempt: int = 0, kind: str = "Short",
           nxt: str = "Short", med: float = 100.0) -> dict[str, Any]:
    return {"attempt": attempt, "step": step, "groupSize": g, "roundKind": kind,
            "lengths": {"max": int(mx), "median": med, "p90": min(mx, med * 1.5), "count": 8 * g},
            "seconds": {"rollout": 30.0, "train": 10.0}, "longQueue": 0, "nextRoundKind": nxt}


class Driver:
    """Plays the trainer's driver: GET plan, POST steps with the job's token."""

    def __init__(self, op: OperatorProc, ns: str, name: str, tok: str) -> None:
        self.op, self.ns, self.name, self.tok = op, ns, name, tok

    def plan(self, fields: str | None = None) -> dict[str, Any]:
        code, body = http("GET", self.op.base + plan_path(self.ns, self.name), self.tok,
                          headers={PLAN_FIELDS_HEADER: fields} if fields else None)
        assert code == 200, body
        return body

    def post(self, body: dict[str, Any], tok: str | None = None) -> tuple[int, Any]:
        return http("POST", self.op.base + steps_path(self.ns, self.name),
                    self.tok if tok is None else tok, body)

    def release(self, step: int, attempt: int = 0) -> tuple[int, Any]:
        return http("POST", self.op.base + release_path(self.ns, self.name), self.tok,
                    {"attempt": attempt, "step": step})


def bound_claim(cluster: LocalCluster, ns: str, claim: str) -> None:
    """A PersistentVolumeClaim bound to a hostPath PersistentVolume made for it."""
    pv_name = f"{ns}-{claim}"[:63]
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv_name},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                   "storageClassName": "manual",
                   "hostPath": {"path": f"/tmp/rlpacer-pv/{pv_name}"},
                   "claimRef": {"namespace": ns, "name": claim}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
           "metadata": {"name": claim, "namespace": ns},
           "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "manual",
                    "volumeName": pv_name, "resources": {"requests": {"storage": "1Gi"}}}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": [pv, pvc]}))


def kube_events(cluster: LocalCluster, ns: str, name: str) -> list[dict[str, Any]]:
    body = get(cluster, f"/api/v1/namespaces/{ns}/events?fieldSelector=involvedObject.name={name}")
    return (body or {}).get("items", [])


# --- tests ---------------------------------------------------------------------------------


def test_invalid_manifests_are_rejected_with_field_messages(
    cluster: LocalCluster, crds: None, namespace: str
) -> None:
    bad = {
        "spec.groupControl.targetStragglerRate": {"groupControl": {"targetStragglerRate": "1.5"}},
        "spec.groupControl.initial": {"groupControl": {"candidates": [4, 8], "initial": 16}},
        "spec.groupControl.initial ": {"groupControl": {"initial": 32}},  # default candidates
        "spec.groupControl.candidates": {"groupControl": {"candidates": [8, 4], "initial": 8}},
        "spec.groupControl.forgetting": {"groupControl": {"forgetting": "1.5"}},
        "spec.rollout.tensorParallelSize": {"rollout": {"gpusPerReplica": 2,
                                                        "tensorParallelSize": 4}},
        "spec.tailBatching.longRound.rolloutReplicas": {
            "rollout": {"replicas": 4, "gpusPerReplica": 0},
            "tailBatching": {"longRound": {"rolloutReplicas": 2}}},
        "spec.rollout.topP": {"rollout": {"topP": "0", "gpusPerReplica": 0}},
        # wide long-round engines are the long round's extra replicas: there must be some
        "spec.tailBatching.longRound.tensorParallelSize": {
            "rollout": {"replicas": 2, "gpusPerReplica": 0},
            "tailBatching": {"longRound": {"rolloutReplicas": 2, "tensorParallelSize": 1}}},
        # and a CPU engine has no tensor parallelism
        "spec.tailBatching.longRound.tensorParallelSize ": {
            "rollout": {"gpusPerReplica": 0},
            "tailBatching": {"longRound": {"rolloutReplicas": 2, "tensorParallelSize": 2}}},
        # a long round runs at least a step's prompts (promptsPerStep 8)
        "spec.tailBatching.longRound.prompts": {
            "tailBatching": {"longRound": {"rolloutReplicas": 3, "prompts": 4}}},
        "spec.algorithm.name": {"algorithm": {"name": "PPO"}},
        "spec.algorithm.learningRate": {"algorithm": {"learningRate": 0.001}},
        "spec.algorithm.clipRatioHigh": {"algorithm": {"name": "DAPO", "clipRatioHigh": "0"}},
        "spec.algorithm.overlongPenalty.bufferTokens": {
            "algorithm": {"name": "DAPO", "overlongPenalty": {"bufferTokens": 1024}}},
        "spec.steps": {"steps": 0},
        "spec.reward.type": {"reward": {"type": "Exactmatch"}},
        "spec.reward.type ": {"reward": {"type": "my rewards:score"}},
        "spec.reward.pattern": {"reward": {"type": "Regex"}},
        "spec.reward.pattern ": {"reward": {"type": "MathAnswer", "pattern": "x"}},
        "spec.reward.failureScore": {"reward": {"failureScore": "zero"}},
        "spec.reward.workers": {"reward": {"workers": 0}},
    }
    for field, patch in bad.items():
        obj = small_job("bad", namespace)
        obj["spec"].update(patch)
        r = cluster.kubectl("apply", "-f", "-", input=json.dumps(obj), check=False)
        assert r.returncode != 0, f"{field} accepted"
        assert field.strip() in r.stderr, (field, r.stderr)
    # the reward rules pass what the model passes: a user reward, a Regex with its pattern
    for name, reward in [
        ("reward-user", {"type": "my_rewards.math:score", "workers": 4, "failureScore": "-1"}),
        ("reward-regex", {"type": "Regex", "pattern": r"answer is (?P<answer>\d+)\.\Z"}),
    ]:
        obj = small_job(name, namespace)
        obj["spec"]["reward"] = reward
        r = cluster.kubectl("apply", "-f", "-", input=json.dumps(obj), check=False)
        assert r.returncode == 0, (name, r.stderr)
    long_name = "a" * 64
    r = cluster.kubectl("apply", "-f", "-", input=json.dumps(small_job(long_name, namespace)),
                        check=False)
    assert r.returncode != 0 and "metadata.name" in r.stderr, r.stderr
    # kubectl explain teaches the API from the CRD's descriptions
    out = cluster.kubectl("explain", "rltj.spec.groupControl.stragglerRatio").stdout
    assert "straggler" in out.lower()


def test_example_job_children_owners_and_status(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "rltrainingjob.yaml").read_text())
    doc["metadata"]["namespace"] = namespace
    # the claims its model and data come from: the pods mount them, so they wait for them
    claims = [doc["spec"][k]["source"].removeprefix("pvc://").split("/")[0]
              for k in ("model", "data")]
    for claim in claims:
        bound_claim(cluster, namespace, claim)
    apply(cluster, doc)
    name = doc["metadata"]["name"]
    uid = job(cluster, namespace, name)["metadata"]["uid"]
    st = wait(cluster, lambda: status(cluster, namespace, name).get("summary") in
              ("Starting", "Running") and status(cluster, namespace, name), "admitted")
    assert st["observedGeneration"] == 1
    # the algorithm knobs have no CRD default: the stored spec keeps "unset" unset, and the
    # status shows what the preset resolves them to (the example sets some, not all)
    stored = job(cluster, namespace, name)["spec"]["algorithm"]
    assert "klCoef" not in stored and stored["name"] == "DAPO"
    want = effective_algorithm(parse_spec(doc["spec"])).to_wire()
    assert st["algorithm"] == want and want["klCoef"] == "0" and want["dynamicSampling"]
    ns_api = f"/api/v1/namespaces/{namespace}"
    apps = f"/apis/apps/v1/namespaces/{namespace}"
    children = {
        "head": f"{apps}/statefulsets/{names.statefulset(name, contract.Role.HEAD)}",
        "learner": f"{apps}/statefulsets/{names.statefulset(name, contract.Role.LEARNER)}",
        "rollout": f"{apps}/statefulsets/{names.statefulset(name, contract.Role.ROLLOUT)}",
        "driver": f"{ns_api}/pods/{names.driver_pod(name, 0)}",
        "config": f"{ns_api}/configmaps/{names.config_map(name)}",
        "secret": f"{ns_api}/secrets/{names.secret(name)}",
        "head-svc": f"{ns_api}/services/{names.head_service(name)}",
        "workers-svc": f"{ns_api}/services/{names.workers_service(name)}",
    }
    objs = {k: wait(cluster, lambda p=p: get(cluster, p), k) for k, p in children.items()}
    for k, o in objs.items():
        refs = o["metadata"]["ownerReferences"]
        assert refs[0]["uid"] == uid and refs[0]["controller"], k
    rollout = objs["rollout"]["spec"]
    assert rollout["replicas"] == 2
    c = rollout["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"][contract.GPU_RESOURCE] == "2"
    env = {e["name"]: e.get("value") for e in objs["driver"]["spec"]["containers"][0]["env"]}
    assert env[contract.ENV_REPORT_URL] == operator.report_url
    # the driver verifies the operator with the CA the ConfigMap carries
    assert operator.report_url.startswith("https://")
    assert env[contract.ENV_REPORT_CA_FILE] == contract.REPORT_CA_PATH
    assert (objs["config"]["data"][contract.REPORT_CA_KEY]
            == (report_certs() / "ca.crt").read_text())
    assert env[contract.ENV_ATTEMPT] == "0"
    # one field manager for every applied child
    managers = {m["manager"] for m in objs["rollout"]["metadata"]["managedFields"]
                if m["operation"] == "Apply"}
    assert managers == {"rlpacer-operator"}
    # KWOK runs the pods: the driver goes Running and the job is Running
    wait(cluster, lambda: status(cluster, namespace, name).get("summary") == "Running",
         "Running", timeout=90)
    out = cluster.kubectl("get", "rltj", "-n", namespace).stdout
    assert "Running" in out and "STRAGGLERS" in out
    conds = {c["type"]: c for c in status(cluster, namespace, name)["conditions"]}
    assert conds["Admitted"]["status"] == "True" and conds["Training"]["status"] == "True"


def test_step_reports_drive_sagc_exactly_like_the_library(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    gc = {"stragglerRatio": "4", "targetStragglerRate": "0.2", "seed": 3, "dualStepSize": "0.2"}
    obj = small_job("sagc", namespace, groupControl=gc)
    apply(cluster, obj)
    drv = Driver(operator, namespace, "sagc", token(cluster, namespace, "sagc"))
    spec = parse_spec(obj["spec"])
    lib = JobController(hosting.controller_config(spec))
    plan = drv.plan()
    assert plan["groupSize"] == lib.plan().group_size
    g, gs = plan["groupSize"], []
    # 35 straggler-heavy steps (max/median 8 > tau 4 whenever G >= 8), then 35 quiet ones;
    # in the quiet half each report names the next round's predicted risk (lengthPrior.context)
    for step in range(70):
        mx = (800.0 if g >= 8 else 150.0) if step < 35 else 150.0
        body = report(step, g, mx)
        if step >= 35:
            body["nextStragglerRisk"] = [{"groupSize": c, "probability": (0.1 + 0.5 * (step % 2))
                                          * c / 16} for c in (4, 8, 16)]
        code, plan = drv.post(body)
        assert code == 200, plan
        last_body = body
        want = lib.observe(hosting.to_data(StepReport.model_validate(body)))
        assert (plan["groupSize"], plan["lambda"]) == (want.group_size, want.lambda_)
        g = plan["groupSize"]
        gs.append(g)
    assert gs[25:35].count(4) >= 8, gs  # stragglers drive G down
    assert gs[-10:] == [16] * 10, gs  # quiet steps drive it back up
    st = status(cluster, namespace, "sagc")
    assert st["controllerState"] == hosting.dumps(lib.state_dict())  # bit-exact
    ctx = json.loads(st["controllerState"])["controller"]["context"]
    assert ctx["decisions"] > 0 and sum(n for n, _ in ctx["counts"]) >= 30  # the risk reached SAGC
    assert st["step"] == 70 and st["groupSize"] == g
    # a retried report is answered identically and not counted again
    code, again = drv.post(last_body)
    assert code == 200 and again == plan
    code, err = drv.post({k: v for k, v in last_body.items() if k != "nextStragglerRisk"})
    assert code == 422 and err["reason"] == "ConflictingRepeat"  # the same key, another body
    assert status(cluster, namespace, "sagc")["controllerState"] == st["controllerState"]
    # errors: wrong token 401, unknown job 404, impossible 422; state unchanged
    assert drv.post(report(70, g, 150.0), tok="nope")[0] == 401
    code, err = http("POST", operator.base + steps_path(namespace, "ghost"), "x", report(0, 4, 1))
    assert code == 404
    code, err = drv.post(report(75, g, 150.0))
    assert code == 422 and err["reason"] == "StepOutOfOrder"
    code, err = drv.post(report(70, g, 50.0))
    assert code == 422 and err["reason"] == "ImpossibleLengths"
    assert status(cluster, namespace, "sagc")["controllerState"] == st["controllerState"]
    m = operator.metrics()
    assert f'rlpacer_group_size{{job="sagc",namespace="{namespace}"}}' in m
    # each accepted report made one status PUT, timed on its own beside the whole report
    writes = _sample(m, "rlpacer_status_write_duration_seconds_count", result="ok")
    answered = _sample(m, "rlpacer_step_report_duration_seconds_count", route="steps", code="200")
    assert writes >= 70 and answered >= 70, (writes, answered)


def test_per_second_sagc_prices_reported_tokens_through_the_operator(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    """``groupControl.objective: PerSecond`` on the operator's path: each report's
    ``lengths.mean`` x ``count`` reaches SAGC as the step's tokens (the stored state keeps
    them), G follows the price to the cheapest log2(G) per second, where the same reports
    under ``PerStep`` keep the largest size, and a report without ``mean`` (an older trainer)
    is priced from its seconds alone."""
    gc = {"stragglerRatio": "4", "targetStragglerRate": "0.2", "seed": 3,
          "objective": "PerSecond"}
    obj = small_job("persec", namespace, groupControl=gc)
    apply(cluster, obj)
    drv = Driver(operator, namespace, "persec", token(cluster, namespace, "persec"))
    lib = JobController(hosting.controller_config(parse_spec(obj["spec"])))
    per_step = JobController(hosting.controller_config(parse_spec(
        {**obj["spec"], "groupControl": {**gc, "objective": "PerStep"}})))
    g = drv.plan()["groupSize"]
    g_step = per_step.plan().group_size
    gs: list[int] = []

    def body(step: int, g: int, mean: float | None) -> dict[str, Any]:
        b = report(step, g, 150.0)
        tokens = 100.0 * b["lengths"]["count"]  # every response 100 tokens on average
        b["seconds"] = {"rollout": 0.01 * tokens, "train": 0.002 * tokens}
        if mean is not None:
            b["lengths"]["mean"] = mean
        return b

    for step in range(24):
        b = body(step, g, 100.0)
        code, plan = drv.post(b)
        assert code == 200, plan
        want = lib.observe(hosting.to_data(StepReport.model_validate(b)))
        assert plan["groupSize"] == want.group_size
        g = plan["groupSize"]
        gs.append(g)
        g_step = per_step.observe(hosting.to_data(StepReport.model_validate(
            body(step, g_step, 100.0)))).group_size
    # seconds in proportion to tokens: log2(G) / G is best at the smallest size
    assert gs[-8:] == [4] * 8, gs
    assert g_step == 16  # no stragglers: per step, the largest size
    state = json.loads(status(cluster, namespace, "persec")["controllerState"])["controller"]
    assert state["config"]["objective"] == "second"
    assert state["step_tokens"][-1] == pytest.approx([4.0, 100.0 * 32, 0.012 * 100.0 * 32])
    assert len(state["step_tokens"]) == 24
    # an older trainer's report (no mean): its seconds count, no tokens are made up
    b = body(24, g, None)
    code, plan = drv.post(b)
    assert code == 200, plan
    assert plan["groupSize"] == lib.observe(
        hosting.to_data(StepReport.model_validate(b))).group_size
    st = status(cluster, namespace, "persec")
    assert st["controllerState"] == hosting.dumps(lib.state_dict())  # bit-exact
    state = json.loads(st["controllerState"])["controller"]
    assert len(state["step_tokens"]) == 24
    # a mean above the longest response is refused, naming the field; nothing changes
    code, err = drv.post(body(25, g, 151.0))
    assert code == 422 and err["reason"] == "ImpossibleLengths" and "mean" in err["message"]
    assert status(cluster, namespace, "persec")["controllerState"] == st["controllerState"]


def _sample(text: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    raise AssertionError(f"{name}{labels} not exposed")


def _sts(cluster: LocalCluster, ns: str, name: str) -> dict[str, Any]:
    return get(cluster, f"/apis/apps/v1/namespaces/{ns}/statefulsets/"
                        f"{names.statefulset(name, contract.Role.ROLLOUT)}") or {}


def test_long_round_scales_up_kwok_runs_then_scales_down(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    apply(cluster, small_job("lr", namespace))
    drv = Driver(operator, namespace, "lr", token(cluster, namespace, "lr"))
    wait(cluster, lambda: (_sts(cluster, namespace, "lr").get("status") or {})
         .get("readyReplicas") == 1, "rollout replica 1 ready", 90)
    g = drv.plan()["groupSize"]
    code, plan = drv.post(report(0, g, 150.0, nxt="Long"))
    assert code == 200 and plan["roundKind"] == "Long"
    assert plan["rollout"]["desiredReplicas"] == 3 and plan["rollout"]["state"] == "ScalingUp"
    t0 = time.monotonic()
    wait(cluster, lambda: drv.plan()["rollout"]["state"] == "Ready", "long-round capacity", 60)
    scale_up_s = time.monotonic() - t0
    # the plan says Ready from the pods seen Ready (scaler.observe); the StatefulSet's
    # own count follows them, seconds later on a busy control plane (seen in CI: 1 of 3)
    wait(cluster, lambda: (_sts(cluster, namespace, "lr").get("status") or {})
         .get("readyReplicas") == 3, "the StatefulSet counting 3 ready", 30)
    # the trainer's view: every ready rollout pod may serve the long round (older trainers,
    # which send no X-RLPacer-Plan-Fields, get the plan without the field)
    usable = wait(cluster, lambda: (u := drv.plan("usableReplicas")["rollout"]
                                    .get("usableReplicas")) == [0, 1, 2] and u,
                  "usable replicas [0, 1, 2]", 30)
    assert usable == [0, 1, 2] and "usableReplicas" not in drv.plan()["rollout"]
    code, plan = drv.post(report(1, drv.plan()["groupSize"], 400.0, kind="Long"))
    assert plan["roundKind"] == "Short" and plan["rollout"]["desiredReplicas"] == 1
    wait(cluster, lambda: _sts(cluster, namespace, "lr")["spec"]["replicas"] == 1, "scaled down")
    st = status(cluster, namespace, "lr")
    assert [a["reason"] for a in st["scaleActions"]] == ["LongRound", "LongRoundDone"]
    reasons = {e["reason"] for e in kube_events(cluster, namespace, "lr")}
    assert {"ScalingUp", "ScaledUp", "ScaledDown"} <= reasons, reasons
    print(f"long-round scale-up to Ready took {scale_up_s:.1f}s")


def test_wide_long_round_engines_get_their_own_pods_on_gpu_nodes_then_go(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    """``tailBatching.longRound.tensorParallelSize`` 4 on a job whose rollout engines have 2
    GPUs: a long round's two extra replicas are pods of the StatefulSet ``<job>-rollout-wide``,
    ordinals 1 and 2 (following the rollout's 0), 4 GPUs each, scheduled onto the KWOK GPU
    nodes beside the rollout's 2-GPU pod; the plan names all three usable (the driver routes
    the long round to 1 and 2); the rollout StatefulSet never grows, and the wide one goes
    back to 0 after the long round."""
    obj = small_job("wide", namespace,
                    rollout={"replicas": 1, "gpusPerReplica": 2, "tensorParallelSize": 2,
                             "maxResponseTokens": 1024},
                    tailBatching={"longRound": {"rolloutReplicas": 3,
                                                "tensorParallelSize": 4,
                                                "scaleUpTimeoutSeconds": 60}})
    apply(cluster, obj)
    wide_sts = names.wide_statefulset("wide")

    def wide() -> dict[str, Any]:
        return get(cluster, f"/apis/apps/v1/namespaces/{namespace}/statefulsets/"
                            f"{wide_sts}") or {}

    drv = Driver(operator, namespace, "wide", token(cluster, namespace, "wide"))
    wait(cluster, lambda: (_sts(cluster, namespace, "wide").get("status") or {})
         .get("readyReplicas") == 1, "rollout replica 0 ready", 90)
    assert wide()["spec"]["replicas"] == 0 and wide()["spec"]["ordinals"] == {"start": 1}
    code, plan = drv.post(report(0, drv.plan()["groupSize"], 150.0, nxt="Long"))
    assert code == 200 and plan["rollout"]["desiredReplicas"] == 3
    usable = wait(cluster, lambda: (p := drv.plan("usableReplicas"))["rollout"]["state"]
                  == "Ready" and p["rollout"]["usableReplicas"], "the wide engines ready", 60)
    assert usable == [0, 1, 2], usable
    pods = get(cluster, f"/api/v1/namespaces/{namespace}/pods?labelSelector="
                        f"{contract.LABEL_JOB}=wide,{contract.LABEL_ROLE}=rollout")
    assert pods is not None
    by_name = {p["metadata"]["name"]: p for p in pods["items"]}
    rollout0 = f"{names.statefulset('wide', contract.Role.ROLLOUT)}-0"
    assert sorted(by_name) == sorted([rollout0, f"{wide_sts}-1", f"{wide_sts}-2"]), by_name
    gpus = {n: p["spec"]["containers"][0]["resources"]["limits"][contract.GPU_RESOURCE]
            for n, p in by_name.items()}
    assert gpus == {rollout0: "2", f"{wide_sts}-1": "4", f"{wide_sts}-2": "4"}, gpus
    # each on a GPU node, its index the replica's (the rank its Ray node advertises)
    for n, p in by_name.items():
        assert p["spec"]["nodeName"].startswith("kwok-gpu-"), (n, p["spec"].get("nodeName"))
        assert p["metadata"]["labels"]["apps.kubernetes.io/pod-index"] == n.rsplit("-", 1)[1]
    assert _sts(cluster, namespace, "wide")["spec"]["replicas"] == 1  # never grown
    code, plan = drv.post(report(1, drv.plan()["groupSize"], 400.0, kind="Long"))
    assert plan["roundKind"] == "Short" and plan["rollout"]["desiredReplicas"] == 1
    wait(cluster, lambda: wide()["spec"]["replicas"] == 0, "the wide engines scaled down")
    assert _sts(cluster, namespace, "wide")["spec"]["replicas"] == 1


def test_a_long_round_releases_its_added_replicas_before_its_report(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    """``POST release`` (``tailBatching.longRound.releaseWhenFits``): while step 1's long round
    runs, its driver gives the added replicas back; the rollout StatefulSet shrinks to 1 at
    once (before any report), the plan says so, and the step's report then has nothing to
    scale down (scale actions LongRound, LongRoundReleased; no LongRoundDone). Refused, with
    nothing changed: another attempt's, or a step that is not a long round under way."""
    apply(cluster, small_job("rel", namespace))
    drv = Driver(operator, namespace, "rel", token(cluster, namespace, "rel"))
    wait(cluster, lambda: (_sts(cluster, namespace, "rel").get("status") or {})
         .get("readyReplicas") == 1, "rollout replica 0 ready", 90)
    code, body = drv.release(0)  # step 0 is short: nothing to release
    assert code == 422 and body["reason"] == "NotALongRound", body
    code, plan = drv.post(report(0, drv.plan()["groupSize"], 150.0, nxt="Long"))
    assert plan["roundKind"] == "Long" and plan["rollout"]["desiredReplicas"] == 3
    wait(cluster, lambda: drv.plan()["rollout"]["state"] == "Ready", "long-round capacity", 60)
    code, body = drv.release(1, attempt=7)
    assert code == 422 and body["reason"] == "AttemptMismatch", body
    assert _sts(cluster, namespace, "rel")["spec"]["replicas"] == 3
    code, plan = drv.release(1)
    assert code == 200 and plan["rollout"]["desiredReplicas"] == 1, plan
    wait(cluster, lambda: _sts(cluster, namespace, "rel")["spec"]["replicas"] == 1,
         "scaled back before the report")
    assert drv.release(1)[0] == 200  # a repeat changes nothing
    code, plan = drv.post(report(1, drv.plan()["groupSize"], 400.0, kind="Long"))
    assert code == 200 and plan["roundKind"] == "Short" and plan["rollout"]["desiredReplicas"] == 1
    st = status(cluster, namespace, "rel")
    assert [a["reason"] for a in st["scaleActions"]] == ["LongRound", "LongRoundReleased"], st
    msgs = [e["message"] for e in kube_events(cluster, namespace, "rel")
            if e["reason"] == "ScaledDown"]
    assert msgs and "released before the step's report" in msgs[0], msgs


def test_an_early_scale_up_is_ready_before_its_long_round(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    """A report whose next round is short asks ahead (``prepareLongRound``): the StatefulSet
    scales up at once while the plan's round stays short (ScalingUp, no long round begun), its
    pods come up on the KWOK nodes, and the long round's plan is Ready the moment it is asked
    for; the report after it, no longer asking, scales back down."""
    apply(cluster, small_job("early", namespace))
    drv = Driver(operator, namespace, "early", token(cluster, namespace, "early"))
    wait(cluster, lambda: (_sts(cluster, namespace, "early").get("status") or {})
         .get("readyReplicas") == 1, "rollout replica 1 ready", 90)
    g = drv.plan()["groupSize"]
    code, plan = drv.post({**report(0, g, 150.0), "prepareLongRound": True})
    assert code == 200 and plan["roundKind"] == "Short", plan
    assert plan["rollout"]["desiredReplicas"] == 3 and plan["rollout"]["state"] == "ScalingUp"
    wait(cluster, lambda: _sts(cluster, namespace, "early")["spec"]["replicas"] == 3,
         "scaled up ahead of the long round")
    wait(cluster, lambda: drv.plan()["rollout"]["state"] == "Ready", "the capacity ready", 60)
    assert status(cluster, namespace, "early").get("longRounds", 0) == 0
    code, plan = drv.post({**report(1, drv.plan()["groupSize"], 150.0, nxt="Long")})
    assert plan["roundKind"] == "Long" and plan["rollout"]["state"] == "Ready", plan
    assert plan["rollout"]["desiredReplicas"] == 3
    code, plan = drv.post(report(2, plan["groupSize"], 400.0, kind="Long"))
    assert plan["roundKind"] == "Short" and plan["rollout"]["desiredReplicas"] == 1
    wait(cluster, lambda: _sts(cluster, namespace, "early")["spec"]["replicas"] == 1,
         "scaled down")
    st = status(cluster, namespace, "early")
    assert [(a["reason"], a["step"]) for a in st["scaleActions"]] == [
        ("EarlyScaleUp", 1), ("LongRoundDone", 3)], st["scaleActions"]
    ups = [e["message"] for e in kube_events(cluster, namespace, "early")
           if e["reason"] == "ScalingUp"]
    assert ups and "forecast" in ups[0], ups


def test_gpus_short_scale_up_times_out_and_scales_back(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    # 2 GPU nodes x 8 GPUs: three 8-GPU replicas cannot all be scheduled.
    obj = small_job("short", namespace,
                    rollout={"replicas": 1, "gpusPerReplica": 8, "tensorParallelSize": 8},
                    tailBatching={"longRound": {"rolloutReplicas": 3,
                                                "scaleUpTimeoutSeconds": 5}})
    apply(cluster, obj)
    drv = Driver(operator, namespace, "short", token(cluster, namespace, "short"))
    wait(cluster, lambda: (_sts(cluster, namespace, "short").get("status") or {})
         .get("readyReplicas") == 1, "rollout replica ready", 90)
    g = drv.plan()["groupSize"]
    code, plan = drv.post(report(0, g, 150.0, nxt="Long"))
    assert plan["rollout"]["state"] == "ScalingUp"
    # one plan for all three figures: the rollout's status is read as one
    plan = wait(cluster, lambda: (p := drv.plan("usableReplicas"))["rollout"]["state"]
                == "TimedOut" and p, "scale-up timeout", 30)
    ready = plan["rollout"]["readyReplicas"]
    desired = plan["rollout"]["desiredReplicas"]
    # the rollout pods start in parallel, so the second node may hold replica 1 or 2: the
    # scale-back keeps every ready replica (a StatefulSet drops its highest ordinals first)
    usable = plan["rollout"]["usableReplicas"]
    assert ready < 3 and 0 in usable and len(usable) == ready, (ready, usable)
    assert desired == max(usable) + 1, (desired, usable)
    wait(cluster, lambda: _sts(cluster, namespace, "short")["spec"]["replicas"] == desired,
         "pending replicas scaled back")
    # no ready replica was lost by scaling back: what served before the scale-back still does
    time.sleep(2)
    assert (_sts(cluster, namespace, "short").get("status") or {}).get("readyReplicas") == ready
    assert drv.plan("usableReplicas")["rollout"]["usableReplicas"] == usable
    ev = [e for e in kube_events(cluster, namespace, "short") if e["reason"] == "ScaleUpTimedOut"]
    assert ev and ev[0]["type"] == "Warning"
    # the round runs on what is ready; afterwards back to short-round capacity
    code, plan = drv.post(report(1, drv.plan()["groupSize"], 300.0, kind="Long"))
    assert code == 200 and plan["rollout"]["desiredReplicas"] == 1


def test_operator_killed_mid_job_continues_exactly(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    apply(cluster, small_job("rs", namespace))
    drv = Driver(operator, namespace, "rs", token(cluster, namespace, "rs"))
    spec = parse_spec(small_job("rs", namespace)["spec"])
    lib = JobController(hosting.controller_config(spec))
    g = drv.plan()["groupSize"]
    step = 0
    timings = []
    for _ in range(3):
        for _ in range(8):
            body = report(step, g, 800.0 if step % 3 == 0 else 150.0)
            code, plan = drv.post(body)
            assert code == 200
            want = lib.observe(hosting.to_data(StepReport.model_validate(body)))
            assert (plan["groupSize"], plan["lambda"]) == (want.group_size, want.lambda_)
            g, step = plan["groupSize"], step + 1
        # SIGKILL right after an answer, start a new one, check nothing was lost
        operator.kill(signal.SIGKILL)
        t0 = time.monotonic()
        operator.start()
        operator.wait_ready()
        timings.append(time.monotonic() - t0)
        assert status(cluster, namespace, "rs")["controllerState"] == hosting.dumps(
            lib.state_dict())
        plan = drv.plan()
        assert plan["step"] == step and plan["groupSize"] == lib.plan().group_size
        # the last report, retried against the new process, is not double counted
        code, again = drv.post(body)
        assert code == 200 and again["step"] == step
    assert status(cluster, namespace, "rs")["step"] == 24
    print(f"operator restart to ready: {', '.join(f'{t:.1f}s' for t in timings)}")


def test_driver_failure_restarts_then_backoff_limit_fails(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    apply(cluster, small_job("fl", namespace))
    drv = Driver(operator, namespace, "fl", token(cluster, namespace, "fl"))
    pod0 = names.driver_pod("fl", 0)
    wait(cluster, lambda: (get(cluster, f"/api/v1/namespaces/{namespace}/pods/{pod0}") or {})
         .get("status", {}).get("phase") == "Running", "driver 0 running", 90)
    code, plan = drv.post(report(0, drv.plan()["groupSize"], 150.0))
    assert code == 200
    g = plan["groupSize"]  # the plan for step 1, whichever attempt runs it
    cluster.mark_pod_exit(namespace, pod0, 1)
    wait(cluster, lambda: status(cluster, namespace, "fl").get("attempt") == 1, "attempt 1")
    pod1 = names.driver_pod("fl", 1)
    p1 = wait(cluster, lambda: get(cluster, f"/api/v1/namespaces/{namespace}/pods/{pod1}"),
              "driver 1")
    env = {e["name"]: e.get("value") for e in p1["spec"]["containers"][0]["env"]}
    assert env[contract.ENV_ATTEMPT] == "1"
    # the old attempt may not report any more; the new one continues from a checkpoint
    code, err = drv.post(report(1, g, 150.0, attempt=0))
    assert code == 422 and err["reason"] == "AttemptMismatch"
    code, plan = drv.post(report(1, g, 150.0, attempt=1))
    assert code == 200 and plan["step"] == 2
    wait(cluster, lambda: (get(cluster, f"/api/v1/namespaces/{namespace}/pods/{pod1}") or {})
         .get("status", {}).get("phase") == "Running", "driver 1 running", 90)
    cluster.mark_pod_exit(namespace, pod1, 2)
    st = wait(cluster, lambda: (s := status(cluster, namespace, "fl")).get("summary") == "Failed"
              and s, "Failed", 60)
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded"
    wait(cluster, lambda: not _sts(cluster, namespace, "fl"), "workloads deleted")


def test_suspend_refuses_reports_resume_continues_and_success_with_ttl(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    apply(cluster, small_job("su", namespace, ttlSecondsAfterFinished=2))
    drv = Driver(operator, namespace, "su", token(cluster, namespace, "su"))
    pod0 = names.driver_pod("su", 0)
    wait(cluster, lambda: get(cluster, f"/api/v1/namespaces/{namespace}/pods/{pod0}"), "driver")
    g = drv.plan()["groupSize"]
    for step in range(3):
        code, plan = drv.post(report(step, g, 150.0))
        assert code == 200, plan
        g = plan["groupSize"]
    cluster.kubectl("patch", "rltj", "su", "-n", namespace, "--type=merge",
                    "-p", '{"spec":{"suspend":true}}')
    wait(cluster, lambda: status(cluster, namespace, "su").get("summary") == "Suspended",
         "Suspended")
    # a driver still running (its pod being torn down) is told to stop: 409, not retried by
    # the trainer; the step does not advance
    code, err = drv.post(report(3, g, 150.0))
    assert code == 409 and err["reason"] == "JobSuspended", err
    assert status(cluster, namespace, "su")["step"] == 3
    wait(cluster, lambda: not _sts(cluster, namespace, "su"), "pods deleted")
    cluster.kubectl("patch", "rltj", "su", "-n", namespace, "--type=merge",
                    "-p", '{"spec":{"suspend":false}}')
    st = wait(cluster, lambda: (s := status(cluster, namespace, "su")).get("attempt") == 1 and s,
              "resumed as attempt 1")
    assert st["failures"] == 0 and st["step"] == 3
    # the resumed attempt reports again, from the step the job stood at
    code, plan = drv.post(report(3, g, 150.0, attempt=1))
    assert code == 200 and plan["step"] == 4, plan
    pod1 = names.driver_pod("su", 1)
    wait(cluster, lambda: (get(cluster, f"/api/v1/namespaces/{namespace}/pods/{pod1}") or {})
         .get("status", {}).get("phase") == "Running", "driver 1 running", 90)
    cluster.mark_pod_exit(namespace, pod1, 0)
    wait(cluster, lambda: status(cluster, namespace, "su").get("summary") == "Succeeded",
         "Succeeded")
    wait(cluster, lambda: get(cluster, f"{GROUP_PATH}/namespaces/{namespace}/rltrainingjobs/su")
         is None, "deleted after ttlSecondsAfterFinished", 30)


def test_a_suspended_job_with_a_claim_checkpoints_at_its_next_report_then_stops(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    """``spec.suspend`` with a checkpoint claim (evictionGraceSeconds 120 by default): the
    pods are kept while the driver reaches its next report, which is accepted and answered
    done (its checkpoint is at that step); the driver stops, the pods go, and the resumed
    attempt reports from that step: no step lost to the suspend."""
    bound_claim(cluster, namespace, "ckpt")
    apply(cluster, small_job("sg", namespace, checkpoint={"volumeClaim": "ckpt"}))
    drv = Driver(operator, namespace, "sg", token(cluster, namespace, "sg"))
    pod0 = names.driver_pod("sg", 0)
    wait(cluster, lambda: (get(cluster, f"/api/v1/namespaces/{namespace}/pods/{pod0}") or {})
         .get("status", {}).get("phase") == "Running", "driver 0 running", 90)
    g = drv.plan()["groupSize"]
    for step in range(3):
        code, plan = drv.post(report(step, g, 150.0))
        assert code == 200 and plan["done"] is False, plan
        g = plan["groupSize"]
    cluster.kubectl("patch", "rltj", "sg", "-n", namespace, "--type=merge",
                    "-p", '{"spec":{"suspend":true}}')
    held = wait(cluster, lambda: (s := status(cluster, namespace, "sg")).get("summary")
                == "Suspended" and s, "Suspended")
    assert "checkpoints at its next step report" in next(
        c for c in held["conditions"] if c["type"] == "Suspended")["message"], held
    time.sleep(2)  # the pods stay while the driver runs
    assert _sts(cluster, namespace, "sg")
    assert (get(cluster, f"/api/v1/namespaces/{namespace}/pods/{pod0}") or {}).get(
        "status", {}).get("phase") == "Running"
    assert drv.plan()["done"] is True
    code, plan = drv.post(report(3, g, 150.0))
    assert code == 200 and plan["done"] is True and plan["step"] == 4, plan
    reasons = {e["reason"] for e in kube_events(cluster, namespace, "sg")}
    assert {"Suspended", "EvictionCheckpoint"} <= reasons, reasons
    cluster.mark_pod_exit(namespace, pod0, 0)
    wait(cluster, lambda: not _sts(cluster, namespace, "sg"), "pods deleted", 60)
    st = status(cluster, namespace, "sg")
    assert st["summary"] == "Suspended" and st["step"] == 4, st
    cluster.kubectl("patch", "rltj", "sg", "-n", namespace, "--type=merge",
                    "-p", '{"spec":{"suspend":false}}')
    st = wait(cluster, lambda: (s := status(cluster, namespace, "sg")).get("attempt") == 1
              and s, "resumed as attempt 1")
    assert st["step"] == 4 and st["failures"] == 0, st
    code, plan = drv.post(report(4, g, 150.0, attempt=1))
    assert code == 200 and plan["step"] == 5 and plan["done"] is False, plan


def test_a_controller_state_broken_by_a_status_edit_is_rebuilt_at_once_and_never_500(
    cluster: LocalCluster, crds: None, namespace: str
) -> None:
    """``status.controllerState`` patched to what cannot be restored (or removed): the job
    watch's event of that write wakes the job's pass (a periodic one is 10 minutes away
    here), which rebuilds the state from the spec and status, with condition StateRebuilt and
    a Warning Event; a report meanwhile gets 503 (retry), never 500; the driver carries on."""
    op = OperatorProc(cluster, namespace, resync_seconds=600).start()
    op.wait_ready()
    try:
        apply(cluster, small_job("cs", namespace))
        drv = Driver(op, namespace, "cs", token(cluster, namespace, "cs"))
        pod0 = names.driver_pod("cs", 0)
        wait(cluster, lambda: (get(cluster, f"/api/v1/namespaces/{namespace}/pods/{pod0}")
                               or {}).get("status", {}).get("phase") == "Running",
             "driver 0 running", 90)
        g, step = drv.plan()["groupSize"], 0
        for _ in range(4):
            code, plan = drv.post(report(step, g, 800.0 if step % 3 == 0 else 150.0))
            assert code == 200, plan
            g, step = plan["groupSize"], step + 1
        path = f"{GROUP_PATH}/namespaces/{namespace}/rltrainingjobs/cs/status"

        def rebuilt() -> list[dict[str, Any]]:
            return [e for e in kube_events(cluster, namespace, "cs")
                    if e["reason"] == "ControllerStateRebuilt"]

        took = []
        for i, broken in enumerate(['{}', "not json {", '{"version": 999}', None]):
            before = status(cluster, namespace, "cs")
            t0 = time.monotonic()
            code, body = cluster.request("PATCH", path, {"status": {"controllerState": broken}},
                                         content_type="application/merge-patch+json")
            assert code == 200, body
            if i > 0:  # a report at once: answered, never 500 (503 until rebuilt)
                code, err = drv.post(report(step, g, 150.0))
                assert code in (200, 503), err
                if code == 503:
                    assert err["reason"] in ("ControllerStateUnreadable",
                                             "ControllerStateMissing"), err
                else:
                    g, step = err["groupSize"], step + 1
            wait(cluster, lambda n=i + 1: len(rebuilt()) == n, f"rebuild {i + 1}", 15)
            took.append(time.monotonic() - t0)
            st = status(cluster, namespace, "cs")
            cond = next(c for c in st["conditions"] if c["type"] == "StateRebuilt")
            want = "ControllerStateMissing" if broken is None else "ControllerStateUnreadable"
            assert (cond["status"], cond["reason"]) == ("True", want), cond
            ctl = hosting.load(st["controllerState"])
            assert (ctl.next_step, ctl.attempt) == (step, 0)
            assert ctl.plan().group_size == g == st["groupSize"]
            assert [p["groupSize"] for p in st["posteriors"]] == [
                p["groupSize"] for p in before["posteriors"]]
            code, plan = drv.post(report(step, g, 150.0))
            assert code == 200 and plan["step"] == step + 1, plan
            g, step = plan["groupSize"], step + 1
        assert status(cluster, namespace, "cs")["step"] == step
        assert "500" not in _series_codes(op), op.metrics()
        print(f"broken controller state to rebuilt (Event): {', '.join(f'{t:.2f}s' for t in took)}")
    finally:
        op.kill(signal.SIGTERM)


def _series_codes(op: OperatorProc) -> set[str]:
    """The HTTP codes the operator's step-report endpoint answered (its latency histogram)."""
    return {s.labels["code"] for fam in text_string_to_metric_families(op.metrics())
            for s in fam.samples if "code" in s.labels}


def test_active_deadline_fails_the_job(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    apply(cluster, small_job("dl", namespace, activeDeadlineSeconds=3))
    st = wait(cluster, lambda: (s := status(cluster, namespace, "dl")).get("summary") == "Failed"
              and s, "deadline", 30)
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "DeadlineExceeded"


def test_delete_garbage_collects_children_and_metrics(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    apply(cluster, small_job("gc", namespace))
    drv = Driver(operator, namespace, "gc", token(cluster, namespace, "gc"))
    assert drv.post(report(0, drv.plan()["groupSize"], 150.0))[0] == 200
    assert f'job="gc",namespace="{namespace}"' in operator.metrics()
    wait(cluster, lambda: _sts(cluster, namespace, "gc"), "children")
    cluster.kubectl("delete", "rltj", "gc", "-n", namespace, "--wait=true")
    wait(cluster, lambda: not _sts(cluster, namespace, "gc") and not get(
        cluster, f"/api/v1/namespaces/{namespace}/secrets/{names.secret('gc')}"),
        "children garbage-collected", 60)
    wait(cluster, lambda: f'job="gc",namespace="{namespace}"' not in operator.metrics(),
         "metrics series removed", 30)


def test_two_replicas_never_act_at_once_standby_takes_over(
    cluster: LocalCluster, crds: None, namespace: str
) -> None:
    a = OperatorProc(cluster, namespace, identity="op-a").start()
    a.wait_ready()
    b = OperatorProc(cluster, namespace, identity="op-b", report_url=a.base).start()
    try:
        # b up (its start took over 3 s beside the rest of CI), then time to take the lease
        # if it wrongly would
        b.wait_serving()
        time.sleep(3)
        assert a.ready() and not b.ready()
        apply(cluster, small_job("ha", namespace))
        tok = token(cluster, namespace, "ha")
        code, err = http("GET", b.base + plan_path(namespace, "ha"), tok)
        assert code == 503 and err["reason"] == "NotLeader"
        # the report comes from attempt 0's driver, so its pod exists first (a pod missing
        # after its attempt reported is one deleted or evicted: b would start attempt 1)
        wait(cluster, lambda: get(cluster, f"/api/v1/namespaces/{namespace}/pods/"
                                  f"{names.driver_pod('ha', 0)}"), "the driver pod", 60)
        da = Driver(a, namespace, "ha", tok)
        assert da.post(report(0, da.plan()["groupSize"], 150.0))[0] == 200
        a.kill(signal.SIGKILL)  # no release: b must wait out the lease (4 s)
        t0 = time.monotonic()
        b.wait_ready(30)
        took = time.monotonic() - t0
        db = Driver(b, namespace, "ha", tok)
        plan = db.plan()
        assert plan["step"] == 1
        code, body = db.post(report(1, plan["groupSize"], 150.0))
        assert code == 200, (plan, body)
        print(f"standby took over after {took:.1f}s")
    finally:
        a.kill(signal.SIGTERM)
        b.kill(signal.SIGTERM)




@pytest.mark.parametrize("action", ["Enforce", "Warn"])
def test_policy_at_run_time_slo_violated_and_long_round_clamp(
    cluster: LocalCluster, operator: OperatorProc, namespace: str, action: str
) -> None:
    # A policy a platform team sets after the job was admitted (no webhook runs here): the
    # job's steps (40 s each, see report()) break its step-time SLO, and its long round asks
    # for 3 rollout replicas where the policy allows 2.
    apply(cluster, {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingPolicy",
                    "metadata": {"name": "team-limits", "namespace": namespace},
                    "spec": {"action": action, "stepTimeSLO": {"maxSeconds": 10},
                             "longRounds": {"maxRolloutReplicas": 2}}})
    apply(cluster, small_job("slo", namespace))
    drv = Driver(operator, namespace, "slo", token(cluster, namespace, "slo"))
    wait(cluster, lambda: (_sts(cluster, namespace, "slo").get("status") or {})
         .get("readyReplicas") == 1, "rollout replica 1 ready", 90)
    code, plan = drv.post(report(0, drv.plan()["groupSize"], 150.0, nxt="Long"))
    assert code == 200 and plan["roundKind"] == "Long"
    want = 2 if action == "Enforce" else 3
    assert plan["rollout"]["desiredReplicas"] == want
    wait(cluster, lambda: _sts(cluster, namespace, "slo")["spec"]["replicas"] == want,
         f"rollout StatefulSet at {want} replicas")
    st = status(cluster, namespace, "slo")
    (slo,) = [c for c in st["conditions"] if c["type"] == "SLOViolated"]
    assert slo["status"] == "True" and slo["reason"] == "StepTimeAboveSLO", slo
    assert "team-limits" in slo["message"] and st["stepSeconds"] == "40"
    assert st["policyNotes"] and all(
        n.startswith("Warn: ") == (action == "Warn") for n in st["policyNotes"]), st
    assert st["scaleActions"][-1]["toReplicas"] == want
    notes = "PolicyClamped" if action == "Enforce" else "PolicyWarning"
    reasons = wait(cluster, lambda: {"SLOViolated", notes, "ScalingUp"} <= (
        r := {e["reason"] for e in kube_events(cluster, namespace, "slo")}) and r, "Events")
    assert ("PolicyWarning" if action == "Enforce" else "PolicyClamped") not in reasons
    text = operator.metrics()
    lab = f'job="slo",namespace="{namespace}"'
    assert f'rlpacer_slo_violated{{{lab},reason="StepTimeAboveSLO"}} 1.0' in text, text
    assert f'rlpacer_slo_violated{{{lab},reason="StragglerRateAboveSLO"}} 0.0' in text
    assert f"rlpacer_job_active{{{lab}}} 1.0" in text
    # The clamp and the SLO are re-judged on each report; deleting the job removes the series.
    cluster.kubectl("delete", "rltj", "slo", "-n", namespace, "--wait=true")
    wait(cluster, lambda: lab not in operator.metrics(), "metrics series removed", 30)


def test_job_in_an_empty_watched_namespace_is_picked_up_at_once(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    # The namespace had no job when the operator listed it: the API server's metadata-only
    # list then says "items": null. Before the fix each relist failed on it and the watch
    # restarted with a backoff growing to 10 s, so a new job waited up to 10 s.
    time.sleep(12)
    t0 = time.monotonic()  # created by one request (not kubectl: its start is not the operator's)
    code, body = cluster.http.request(
        "POST", f"{GROUP_PATH}/namespaces/{namespace}/rltrainingjobs", small_job("late", namespace))
    assert code == 201, body
    wait(cluster, lambda: status(cluster, namespace, "late").get("observedGeneration"),
         "the job reconciled", timeout=30)
    took = time.monotonic() - t0
    print(f"new job in an empty namespace reconciled after {took:.1f}s")
    assert took < 4, took
    assert "object is not iterable" not in operator.log.read_text()  # no relist loop


def test_deleted_children_and_token_secret_come_back_and_the_driver_keeps_reporting(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    apply(cluster, small_job("cm", namespace))
    tok = token(cluster, namespace, "cm")
    ns_api = f"/api/v1/namespaces/{namespace}"
    children = {
        "configmap": f"{ns_api}/configmaps/{names.config_map('cm')}",
        "service": f"{ns_api}/services/{names.head_service('cm')}",
        "secret": f"{ns_api}/secrets/{names.secret('cm')}",
    }
    for what, path in children.items():
        uid = wait(cluster, lambda p=path: get(cluster, p), what)["metadata"]["uid"]
        cluster.kubectl("delete", "-n", namespace, what, path.rsplit("/", 1)[1])
        wait(cluster, lambda p=path, u=uid: (get(cluster, p) or {"metadata": {"uid": u}})[
            "metadata"]["uid"] != u, f"{what} re-created", timeout=15)
    assert token(cluster, namespace, "cm") == tok  # the same token
    drv = Driver(operator, namespace, "cm", tok)
    g = drv.plan()["groupSize"]
    code, plan = drv.post(report(0, g, 150.0))
    assert code == 200, plan
    # the Secret is deleted while no operator runs: the running driver keeps its token
    operator.kill(signal.SIGKILL)
    cluster.kubectl("delete", "-n", namespace, "secret", names.secret("cm"))
    operator.start()
    operator.wait_ready()
    code, plan = drv.post(report(1, plan["groupSize"], 150.0))
    assert code == 200, plan
    new = wait(cluster, lambda: get(cluster, children["secret"]), "secret re-created")
    tok2 = base64.b64decode(new["data"][contract.TOKEN_KEY]).decode()
    assert tok2 != tok and len(status(cluster, namespace, "cm")["tokenHashes"]) == 2
    code, plan = drv.post(report(2, plan["groupSize"], 150.0), tok=tok2)
    assert code == 200, plan
    code, plan = drv.post(report(3, plan["groupSize"], 150.0))
    assert code == 200, plan


def test_a_leaked_token_is_revoked_by_the_documented_procedure_keeping_the_job(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    """docs/operations.md "Revoking a leaked step-report token", way 2 (keep the job)."""
    name, sec = "rv", names.secret("rv")
    apply(cluster, small_job(name, namespace))
    leaked = token(cluster, namespace, name)
    drv = Driver(operator, namespace, name, leaked)
    pod0 = names.driver_pod(name, 0)
    wait(cluster, lambda: (get(cluster, f"/api/v1/namespaces/{namespace}/pods/{pod0}") or {})
         .get("status", {}).get("phase") == "Running", "driver 0 running", 90)
    plan = drv.plan()
    for step in range(2):
        code, plan = drv.post(report(step, plan["groupSize"], 150.0))
        assert code == 200, plan

    def restart(*between: tuple[str, ...]) -> str:
        """Stop the operator, run the kubectl commands, start it; the Secret's new token."""
        operator.kill(signal.SIGTERM)
        for args in between:
            cluster.kubectl("-n", namespace, *args)
        operator.start()
        operator.wait_ready()
        return token(cluster, namespace, name)

    def refused(tok: str) -> bool:
        get_code = http("GET", operator.base + plan_path(namespace, name), tok)[0]
        return get_code == 401 and drv.post(report(3, 4, 150.0), tok=tok)[0] == 401

    # Deleting the Secret alone revokes nothing: a new token, the leaked one still accepted.
    minted = restart(("delete", "secret", sec))
    assert minted != leaked and len(status(cluster, namespace, name)["tokenHashes"]) == 2
    code, plan = drv.post(report(2, plan["groupSize"], 150.0))
    assert code == 200 and drv.plan()["step"] == 3, plan
    before = status(cluster, namespace, name)

    # The procedure, with the docs' commands: every earlier token is refused from then on.
    new = restart(("delete", "secret", sec),
                  ("patch", "rltj", name, "--subresource=status", "--type=json",
                   "-p", '[{"op": "remove", "path": "/status/tokenHashes"}]'))
    assert new not in (leaked, minted)
    st = wait(cluster, lambda: (s := status(cluster, namespace, name))["tokenHashes"] == [
        _sha(new)] and s, "only the new token's hash")
    assert refused(leaked) and refused(minted)
    assert (st["step"], st["controllerState"]) == (3, before["controllerState"])
    assert st.get("attempt", 0) == 0 and st.get("failures", 0) == 0, st

    # The running driver's next report is refused and it exits 3: a failure, counted
    # against backoffLimit; attempt 1 mounts the re-created Secret and continues at step 3.
    cluster.mark_pod_exit(namespace, pod0, 3)
    st = wait(cluster, lambda: (s := status(cluster, namespace, name)).get("attempt") == 1
              and s, "attempt 1")
    assert st["failures"] == 1 and st["step"] == 3, st
    pod1 = wait(cluster, lambda: get(
        cluster, f"/api/v1/namespaces/{namespace}/pods/{names.driver_pod(name, 1)}"), "driver 1")
    assert sec in {v["secret"]["secretName"] for v in pod1["spec"]["volumes"] if "secret" in v}
    assert token(cluster, namespace, name) == new
    drv1 = Driver(operator, namespace, name, new)
    code, plan = drv1.post(report(3, drv1.plan()["groupSize"], 150.0, attempt=1))
    assert code == 200 and plan["step"] == 4, plan
    assert refused(leaked)


def _ray_token(cluster: LocalCluster, ns: str, name: str) -> tuple[str, str]:
    """(token, Secret uid) of the job's Ray-token Secret, once it exists."""
    sec = wait(cluster, lambda: get(cluster, f"/api/v1/namespaces/{ns}/secrets/"
                                             f"{names.ray_secret(name)}"), "Ray-token secret")
    tok = base64.b64decode(sec["data"][contract.RAY_TOKEN_KEY]).decode()
    return tok, sec["metadata"]["uid"]


def _sha(tok: str) -> str:
    import hashlib

    return hashlib.sha256(tok.encode()).hexdigest()


def test_every_pod_runs_with_the_jobs_ray_token_kept_across_restarts_and_deletion(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    name = "ray"
    apply(cluster, small_job(name, namespace))
    tok, uid = _ray_token(cluster, namespace, name)
    assert len(tok) == 64 and tok != token(cluster, namespace, name)
    ns_api = f"/api/v1/namespaces/{namespace}"
    apps = f"/apis/apps/v1/namespaces/{namespace}"
    sec = get(cluster, f"{ns_api}/secrets/{names.ray_secret(name)}")
    assert sec is not None and sec["immutable"] is True
    assert sec["metadata"]["ownerReferences"][0]["uid"] == job(cluster, namespace, name)[
        "metadata"]["uid"]

    def pods_of_the_job() -> dict[str, dict[str, Any]]:
        """name -> (metadata, spec) of every pod (template) of the job as stored."""
        out: dict[str, dict[str, Any]] = {}
        for role in (contract.Role.HEAD, contract.Role.LEARNER, contract.Role.ROLLOUT):
            sts = get(cluster, f"{apps}/statefulsets/{names.statefulset(name, role)}")
            if sts is not None:
                out[role.value] = sts["spec"]["template"]
        attempt = status(cluster, namespace, name).get("attempt", 0)
        pod = get(cluster, f"{ns_api}/pods/{names.driver_pod(name, attempt)}")
        if pod is not None:
            out[f"driver-{attempt}"] = pod
        # a pod the StatefulSet controller made from its template (what the kubelet mounts)
        head0 = get(cluster, f"{ns_api}/pods/{names.statefulset(name, contract.Role.HEAD)}-0")
        if head0 is not None:
            out["head-0"] = head0
        return out

    pods = wait(cluster, lambda: len(p := pods_of_the_job()) == 5 and p, "the job's pods")
    for what, pod in pods.items():
        spec = pod["spec"]
        (c,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env[contract.ENV_RAY_AUTH_MODE] == "token", what
        assert env[contract.ENV_RAY_AUTH_TOKEN_PATH] == contract.RAY_TOKEN_PATH, what
        vols = {v["name"]: v for v in spec["volumes"]}
        mount = next(m for m in c["volumeMounts"]
                     if m["mountPath"] == contract.RAY_TOKEN_MOUNT_DIR)
        assert mount["readOnly"] is True, what
        assert vols[mount["name"]]["secret"]["secretName"] == names.ray_secret(name), what
        assert vols[mount["name"]]["secret"]["defaultMode"] == 0o440, what
        secrets_mounted = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        want = {names.ray_secret(name)}
        if what.startswith("driver"):
            want.add(names.secret(name))  # the report token: the driver's alone
        assert secrets_mounted == want, what
        assert pod["metadata"]["annotations"][contract.ANNOTATION_RAY_TOKEN_HASH] == _sha(tok)
    wait(cluster, lambda: status(cluster, namespace, name).get("summary") == "Running",
         "Running", timeout=90)

    # Deleted while the operator runs: back with the same token, nothing restarts.
    cluster.kubectl("delete", "-n", namespace, "secret", names.ray_secret(name))
    wait(cluster, lambda: _ray_token(cluster, namespace, name)[1] != uid, "Secret re-created",
         timeout=15)
    assert _ray_token(cluster, namespace, name)[0] == tok
    # An operator restart reads it back: the same token, nothing restarts.
    operator.kill(signal.SIGKILL)
    operator.start()
    operator.wait_ready()
    time.sleep(4)  # two resyncs
    assert _ray_token(cluster, namespace, name)[0] == tok
    st = status(cluster, namespace, name)
    assert st.get("attempt", 0) == 0 and st.get("failures", 0) == 0, st

    # Deleted while no operator runs: the token is lost. A new one; the StatefulSets roll to
    # it and the running driver (another token) is replaced by attempt 1, not a failure.
    operator.kill(signal.SIGKILL)
    cluster.kubectl("delete", "-n", namespace, "secret", names.ray_secret(name))
    operator.start()
    operator.wait_ready()
    tok2, _ = _ray_token(cluster, namespace, name)
    assert tok2 != tok
    st = wait(cluster, lambda: (s := status(cluster, namespace, name)).get("attempt") == 1
              and s, "attempt 1")
    assert st.get("failures", 0) == 0, st
    wait(cluster, lambda: "driver-1" in pods_of_the_job(), "driver 1")
    # Read again: one read takes the StatefulSets before the driver, and a pass applies them
    # before it, so a read that first sees driver 1 may hold templates from before that pass.
    pods = pods_of_the_job()
    for what in ("head", "learner", "rollout", "driver-1"):
        meta = pods[what]["metadata"]
        assert meta["annotations"][contract.ANNOTATION_RAY_TOKEN_HASH] == _sha(tok2), what
    wait(cluster, lambda: get(cluster, f"{ns_api}/pods/{names.driver_pod(name, 0)}") is None,
         "the old driver deleted")
    reasons = [e for e in kube_events(cluster, namespace, name) if e["reason"] == "Restarting"]
    assert len(reasons) == 1 and "Ray token" in reasons[0]["message"], reasons


def test_reports_the_api_server_would_refuse_are_422_not_503(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    apply(cluster, small_job("big", namespace))
    drv = Driver(operator, namespace, "big", token(cluster, namespace, "big"))
    g = drv.plan()["groupSize"]
    for body in ({**report(0, g, 150.0), "longQueue": 1e19},  # int64 overflow in status
                 {**report(0, g, 150.0), "longQueue": 10**19},
                 report(0, g, 5000.0)):  # over maxResponseTokens
        code, err = drv.post(body)
        assert code == 422, (body, err)
    assert status(cluster, namespace, "big").get("step", 0) == 0
    code, plan = drv.post(report(0, g, 150.0))
    assert code == 200, plan


def test_step_reports_are_tls_only_and_a_played_driver_verifies_the_operator(
        cluster: LocalCluster, operator: OperatorProc, namespace: str, tmp_path: Path) -> None:
    """The endpoint answers no plain HTTP (a token sent that way reaches nothing), and the
    driver pod the operator builds, played from its spec (env, ConfigMap and Secret files as a
    kubelet mounts them), reaches the operator over TLS with the ConfigMap's CA; given another
    CA it fails at once, exit 3, with a message naming the CA file."""
    # a job the trainer can load (the played driver reads its run config before reporting)
    apply(cluster, small_job("tls", namespace, model={"source": "builtin://tiny-chain"},
                             data={"source": "builtin://chain"},
                             rollout={"replicas": 1, "gpusPerReplica": 0,
                                      "maxResponseTokens": 192}))
    tok = token(cluster, namespace, "tls")
    plain = f"http://127.0.0.1:{operator.report_port}" + plan_path(namespace, "tls")
    req = urllib.request.Request(plain, headers={"Authorization": f"Bearer {tok}"})
    with pytest.raises(OSError):  # the TLS server drops it: no HTTP answer at all
        urllib.request.urlopen(req, timeout=10)
    assert Driver(operator, namespace, "tls", tok).plan()["step"] == 0  # HTTPS answers

    pod = wait(cluster, lambda: get(cluster, f"/api/v1/namespaces/{namespace}/pods/"
                                             f"{names.driver_pod('tls', 0)}"), "driver pod")
    cmd = harness.local_command(pod, harness.ApiLookup(cluster), root=tmp_path,
                                drop_env=[contract.ENV_RAY_ADDRESS])
    for d in cmd.dirs:
        d.mkdir(parents=True, exist_ok=True)
    for f, data in cmd.files.items():
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
    ca_file = Path(cmd.env[contract.ENV_REPORT_CA_FILE])
    assert ca_file.read_text() == (report_certs() / "ca.crt").read_text()
    token_file = Path(cmd.env[contract.ENV_TOKEN_FILE])
    assert token_file.read_text() == tok

    def play() -> subprocess.CompletedProcess[str]:
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path),
               contract.ENV_REPORT_RETRIES: "1", **cmd.env}
        return subprocess.run(cmd.argv, env=env, cwd=cmd.cwd, capture_output=True, text=True,
                              timeout=120)

    # The right CA, a token of no job: TLS verified, the operator answered (401), exit 3
    # before any engine started. (With the real token the played driver runs the whole
    # job: tests/e2e/test_cluster_job.py.)
    token_file.write_text("not-the-token")
    r = play()
    assert r.returncode == 3, r.stderr[-3000:]
    assert "controller answered 401" in r.stderr and "verify" not in r.stderr
    # Another CA: the handshake fails, the token is never sent, and the message says why.
    token_file.write_text(tok)
    other = tls.generate(tmp_path / "other-ca", ["127.0.0.1"], ca_name="not-the-operator")
    ca_file.write_text((other / "ca.crt").read_text())
    t0 = time.monotonic()
    r = play()
    assert r.returncode == 3, r.stderr[-3000:]
    assert time.monotonic() - t0 < 60
    assert f"does not verify with the CA in {ca_file}" in r.stderr
    assert "certificate verify failed" in r.stderr and "report-ca.crt" in r.stderr
    assert "Traceback" not in r.stderr


def _series(op: OperatorProc, ns: str, name: str) -> bool:
    return f'job="{name}",namespace="{ns}"' in op.metrics()


def test_a_namespace_deleted_under_running_jobs_goes_and_the_operator_carries_on(
        cluster: LocalCluster, crds: None, namespace: str) -> None:
    """Two running jobs (children applied, reports accepted) in a namespace that is then
    deleted: the namespace goes (nothing the operator added blocks it), the jobs' metric
    series go, the operator keeps serving the jobs of its other namespace and does not loop on
    errors about the deleted one."""
    doomed = f"{namespace[:50]}-gone"
    cluster.create_namespace(doomed)
    op = OperatorProc(cluster, namespace, also_watch=(doomed,)).start()
    try:
        op.wait_ready()
        for n in ("a", "b"):
            apply(cluster, small_job(n, doomed))
        for n in ("a", "b"):
            drv = Driver(op, doomed, n, token(cluster, doomed, n))
            assert drv.post(report(0, drv.plan()["groupSize"], 150.0))[0] == 200
            wait(cluster, lambda n=n: _sts(cluster, doomed, n), f"children of {n}")
            assert _series(op, doomed, n)
        mark = len(op.log.read_text().splitlines())
        t0 = time.monotonic()
        cluster.delete_namespace(doomed)
        wait(cluster, lambda: get(cluster, f"/api/v1/namespaces/{doomed}") is None,
             "the namespace deleted", 120)
        gone_s = time.monotonic() - t0
        wait(cluster, lambda: not any(_series(op, doomed, n) for n in ("a", "b")),
             "the jobs' metric series removed", 30)
        # the operator goes on: a job of its other namespace is served as before
        apply(cluster, small_job("after", namespace))
        drv = Driver(op, namespace, "after", token(cluster, namespace, "after"))
        assert drv.post(report(0, drv.plan()["groupSize"], 150.0))[0] == 200
        time.sleep(6)  # three resync periods: a loop on the deleted jobs would show by now
        assert op.proc is not None and op.proc.poll() is None and op.ready()
        after = op.log.read_text().splitlines()[mark:]
        noisy = [x for x in after if " ERROR " in x or "Traceback" in x]
        print(f"namespace deleted in {gone_s:.1f}s")
        # the API server's refusals while the namespace terminates are expected, not errors
        assert not noisy, "\n".join(noisy)[-3000:]
        errors = {s.labels["job"]: s.value for f in text_string_to_metric_families(op.metrics())
                  if f.name == "rlpacer_reconcile_errors" for s in f.samples
                  if s.labels.get("namespace") == doomed and s.name.endswith("_total")}
        assert not errors, errors
    finally:
        op.kill(signal.SIGTERM)
        cluster.delete_namespace(doomed)


def test_two_jobs_of_one_name_in_two_namespaces_do_not_cross(
        cluster: LocalCluster, crds: None, namespace: str) -> None:
    """The same job name in two namespaces at once: separate tokens (each refused on the
    other's path), reports and plans, statuses, children and metric series."""
    other = f"{namespace[:50]}-twin"
    cluster.create_namespace(other)
    op = OperatorProc(cluster, namespace, also_watch=(other,)).start()
    try:
        op.wait_ready()
        for ns in (namespace, other):
            apply(cluster, small_job("twin", ns))
        tok = {ns: token(cluster, ns, "twin") for ns in (namespace, other)}
        assert tok[namespace] != tok[other]
        a, b = Driver(op, namespace, "twin", tok[namespace]), Driver(op, other, "twin", tok[other])
        # a token is valid for its own job only, even under the same name
        code, err = http("GET", op.base + plan_path(other, "twin"), tok[namespace])
        assert code == 401, err
        code, err = b.post(report(0, 8, 150.0), tok=tok[namespace])
        assert code == 401, err
        # three reports to a, one to b: each status counts its own
        g = a.plan()["groupSize"]
        for step in range(3):
            code, plan = a.post(report(step, g, 150.0 + step))
            assert code == 200, plan
            g = plan["groupSize"]
        assert b.post(report(0, b.plan()["groupSize"], 900.0))[0] == 200
        assert status(cluster, namespace, "twin")["step"] == 3
        assert status(cluster, other, "twin")["step"] == 1
        assert a.plan()["step"] == 3 and b.plan()["step"] == 1
        # children: the same names, each owned by its own job
        uid = {ns: job(cluster, ns, "twin")["metadata"]["uid"] for ns in (namespace, other)}
        for ns in (namespace, other):
            sts = wait(cluster, lambda ns=ns: _sts(cluster, ns, "twin"), "children")
            assert sts["metadata"]["ownerReferences"][0]["uid"] == uid[ns]
        # metric series apart: each job counts its own steps
        fams = {f.name: f for f in text_string_to_metric_families(op.metrics())}
        steps = {s.labels["namespace"]: s.value for s in fams["rlpacer_steps"].samples
                 if s.name == "rlpacer_steps_total" and s.labels.get("job") == "twin"}
        assert steps == {namespace: 3.0, other: 1.0}, steps
    finally:
        op.kill(signal.SIGTERM)
        cluster.delete_namespace(other)


def test_a_policy_tightened_while_a_scale_up_pends_cuts_that_scale_up(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    """A long round asks for 3 replicas of 8 GPUs (2 GPU nodes x 8: the third cannot be
    scheduled, the scale-up pends with a 300 s timeout). A policy allowing 2 is then applied:
    without any report, the operator cuts the pending scale-up to 2 (StatefulSet, status,
    Event), the 2 are ready, and the plan says Ready long before the timeout."""
    obj = small_job("tight", namespace,
                    rollout={"replicas": 1, "gpusPerReplica": 8, "tensorParallelSize": 8},
                    tailBatching={"longRound": {"rolloutReplicas": 3,
                                                "scaleUpTimeoutSeconds": 300}})
    apply(cluster, obj)
    drv = Driver(operator, namespace, "tight", token(cluster, namespace, "tight"))
    wait(cluster, lambda: (_sts(cluster, namespace, "tight").get("status") or {})
         .get("readyReplicas") == 1, "rollout replica ready", 90)
    code, plan = drv.post(report(0, drv.plan()["groupSize"], 150.0, nxt="Long"))
    assert code == 200 and plan["rollout"]["state"] == "ScalingUp", plan
    assert plan["rollout"]["desiredReplicas"] == 3
    wait(cluster, lambda: _sts(cluster, namespace, "tight")["spec"]["replicas"] == 3,
         "scaling up to 3")
    t0 = time.monotonic()
    apply(cluster, {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingPolicy",
                    "metadata": {"name": "tighter", "namespace": namespace},
                    "spec": {"action": "Enforce", "longRounds": {"maxRolloutReplicas": 2}}})
    plan = wait(cluster, lambda: (p := drv.plan())["rollout"]["state"] == "Ready" and p,
                "the cut scale-up ready", 60)
    took = time.monotonic() - t0
    assert plan["rollout"]["desiredReplicas"] == 2 and plan["rollout"]["readyReplicas"] >= 2
    assert took < 60, took
    wait(cluster, lambda: _sts(cluster, namespace, "tight")["spec"]["replicas"] == 2,
         "the StatefulSet at 2")
    st = status(cluster, namespace, "tight")
    assert [(a["reason"], a["toReplicas"]) for a in st["scaleActions"]] == [
        ("LongRound", 3), ("PolicyClamped", 2)], st["scaleActions"]
    # the pass that made the plan Ready posts its Event after the status write
    reasons = wait(cluster, lambda: {"ScalingUp", "PolicyClamped", "ScaledUp"} <= (
        r := {e["reason"] for e in kube_events(cluster, namespace, "tight")}) and r,
        "the scale-up's Events", 10)
    assert "ScaleUpTimedOut" not in reasons
    print(f"pending scale-up cut and ready {took:.1f}s after the policy")


def test_operator_killed_while_a_scale_up_pends_times_it_out_on_time(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    """A scale-up that cannot complete (a third 8-GPU replica on 2 x 8 GPUs, 20 s timeout)
    pends when the operator is SIGKILLed; 8 s later a new one starts. It times the scale-up
    out 20 s after it began (the start is in status), not 20 s after its own start, scales
    the pending replica back and the plan says TimedOut."""
    timeout_s = 20
    obj = small_job("pend", namespace,
                    rollout={"replicas": 1, "gpusPerReplica": 8, "tensorParallelSize": 8},
                    tailBatching={"longRound": {"rolloutReplicas": 3,
                                                "scaleUpTimeoutSeconds": timeout_s}})
    apply(cluster, obj)
    drv = Driver(operator, namespace, "pend", token(cluster, namespace, "pend"))
    wait(cluster, lambda: (_sts(cluster, namespace, "pend").get("status") or {})
         .get("readyReplicas") == 1, "rollout replica ready", 90)
    code, plan = drv.post(report(0, drv.plan()["groupSize"], 150.0, nxt="Long"))
    assert code == 200 and plan["rollout"]["state"] == "ScalingUp", plan
    started = status(cluster, namespace, "pend")["rollout"]["scaleUpStartedAt"]
    operator.kill(signal.SIGKILL)
    time.sleep(8)
    operator.start()
    operator.wait_ready()
    plan = wait(cluster, lambda: (p := drv.plan())["rollout"]["state"] == "TimedOut" and p,
                "the scale-up timed out", 60)
    ready = plan["rollout"]["readyReplicas"]
    back = plan["rollout"]["desiredReplicas"]
    # replica 1 or 2 may hold the second node (parallel pods): every ready one is kept
    usable = drv.plan("usableReplicas")["rollout"]["usableReplicas"]
    assert ready < 3 and len(usable) == ready and back == max(usable) + 1, (plan, usable)
    wait(cluster, lambda: _sts(cluster, namespace, "pend")["spec"]["replicas"] == back,
         "the pending replica scaled back")
    st = status(cluster, namespace, "pend")
    acts = st["scaleActions"]
    assert [(a["reason"], a["toReplicas"]) for a in acts] == [
        ("LongRound", 3), ("ScaleUpTimedOut", back)], acts
    from rlpacer.operator.timeutil import parse_time

    late = (parse_time(acts[1]["time"]) - parse_time(started)).total_seconds()
    print(f"timed out {late:.1f}s after the scale-up began (timeout {timeout_s}s)")
    # on time: not before the deadline, and well before a deadline restarted with the new
    # operator would have been (8 s + its start later)
    assert timeout_s <= late < timeout_s + 6, late


def test_straggler_slo_infeasible_condition_and_event(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    # Two jobs: in "hot" every step straggles at every G (max/median 8 > tau 4), so SAGC's
    # smallest G fails too; in "calm" none does. Only "hot" gets StragglerSLOMet=False and
    # one Warning Event per transition, with the measured rate per G in the message.
    gc = {"stragglerRatio": "4", "targetStragglerRate": "0.2", "seed": 3, "dualStepSize": "1"}
    for name in ("hot", "calm"):
        apply(cluster, small_job(name, namespace, groupControl=gc))
    spec = parse_spec(small_job("hot", namespace, groupControl=gc)["spec"])
    lib = JobController(hosting.controller_config(spec))
    infeasible_at = None
    prev = None
    drivers = {n: Driver(operator, namespace, n, token(cluster, namespace, n))
               for n in ("hot", "calm")}
    g = {n: drivers[n].plan()["groupSize"] for n in drivers}
    for step in range(30):
        for name, ratio in (("hot", 8.0), ("calm", 1.5)):
            code, plan = drivers[name].post(report(step, g[name], 100.0 * ratio))
            assert code == 200, plan
            g[name] = plan["groupSize"]
        lib.observe(hosting.to_data(StepReport.model_validate(report(step, lib.plan().group_size,
                                                                     800.0))))
        prev = lib.slo_verdict(prev).state
        if prev.value == "Infeasible" and infeasible_at is None:
            infeasible_at = step
    assert infeasible_at is not None, "the library judges 30 straggling steps infeasible"

    hot, calm = status(cluster, namespace, "hot"), status(cluster, namespace, "calm")
    (c,) = [c for c in hot["conditions"] if c["type"] == "StragglerSLOMet"]
    assert (c["status"], c["reason"]) == ("False", "Infeasible"), c
    assert "no candidate G can meet targetStragglerRate 0.2 at stragglerRatio 4" in c["message"]
    assert all(f"G={g} " in c["message"] for g in (4, 8, 16)), c["message"]
    assert hot["stragglerRate"] == "1"
    (ok,) = [c for c in calm["conditions"] if c["type"] == "StragglerSLOMet"]
    assert (ok["status"], ok["reason"]) == ("True", "WithinTarget"), ok
    assert calm["stragglerRate"] == "0"

    def slo_events(name: str) -> list[dict[str, Any]]:
        return [e for e in kube_events(cluster, namespace, name)
                if e["reason"].startswith("StragglerSLO")]

    evs = wait(cluster, lambda: (e := slo_events("hot")) and
               {x["reason"] for x in e} >= {"StragglerSLOInfeasible"} and e, "SLO Events")
    reasons = [e["reason"] for e in evs]
    # once per transition: Exceeded while G=4 was untried, then Infeasible, never repeated
    assert sorted(reasons) == ["StragglerSLOExceeded", "StragglerSLOInfeasible"], reasons
    (inf,) = [e for e in evs if e["reason"] == "StragglerSLOInfeasible"]
    assert inf["type"] == "Warning", inf
    assert "G=4 " in inf["message"] and "0.2" in inf["message"]
    assert slo_events("calm") == []
