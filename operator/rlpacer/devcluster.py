"""A laptop's cluster for rlpacer: the local control plane, the chart, the operator, and every
pod of every job played on a host of its own (``rlpacer dev-cluster``).

``rlpacer dev-cluster up`` starts the local Kubernetes control plane (KWOK nodes, among them
GPU nodes), ``helm install``s the chart (scoped to one jobs namespace, ``team-a`` by default),
and starts a background supervisor that runs the operator as a local process with the chart's
ServiceAccount and plays every pod of every job in that namespace (head, learners, rollouts,
driver) on a played host of its own (:class:`rlpacer.testing.harness.PodHarness` with
:class:`rlpacer.testing.netns.TestHosts`: its own network namespace and address; needs root).
Then ``kubectl apply -n team-a -f examples/tiny-cluster.yaml`` trains for real on the CPU and
``kubectl get rltj -n team-a -w`` shows it. ``env`` prints the shell exports; ``down``
removes everything it made (processes, hosts, the cluster's folder).

The operator process and the chart values here are also what the whole-job test uses
(tests/e2e/test_cluster_job.py).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from rlpacer.testing.cluster import (
    ClusterError,
    LocalCluster,
    cache_dir,
    free_ports,
    repo_root,
)
from rlpacer.testing.netns import pid_alive

CHART = repo_root() / "charts" / "rlpacer"
#: Environment variables given to ``up`` with this prefix reach every played pod (the testing
#: settings of docs/testing.md, e.g. RLPACER_TEST_ENGINE_STEP_SLEEP_S).
TESTING_ENV_PREFIX = "RLPACER_TEST_"
RELEASE = "rlpacer"
SYSTEM = "rlpacer-system"


def deployment_env(dep: dict[str, Any], pod_name: str) -> dict[str, str]:
    """The operator container's env as the kubelet would resolve it for pod `pod_name`."""
    meta = {"metadata.namespace": dep["metadata"]["namespace"], "metadata.name": pod_name}
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] if "value" in e
            else meta[e["valueFrom"]["fieldRef"]["fieldPath"]] for e in c["env"]}


class OperatorProcess:
    """`rlpacer operator` as the chart's Deployment would run it, as a local process."""

    def __init__(self, cluster: LocalCluster, release: str, system: str, tmp: Path) -> None:
        self.cluster, self.release, self.system, self.tmp = cluster, release, system, tmp
        self.proc: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}
        self.log = tmp / "operator.log"
        self.starts = 0
        self.pods = 0  # the Deployment's pods so far (a restart in place keeps its pod)
        self.report_host = "127.0.0.1"  # where the played pods reach its report endpoint

    @property
    def fullname(self) -> str:
        """The chart's name for the release's objects (Helm's fullname convention: the
        release name alone when it already contains the chart's name)."""
        return self.release if "rlpacer" in self.release else f"{self.release}-rlpacer"

    def start(self, new_pod: bool = True) -> None:
        """Start the operator as a new pod of the Deployment (a rollout: a new pod name, so a
        new Lease identity), or with ``new_pod`` False as its container restarted in place
        after it exited (the same pod name and identity: it takes its own Lease back at
        once, as in a cluster)."""
        self.starts += 1
        if new_pod or not self.pods:
            self.pods += 1
        dep = json.loads(self.cluster.kubectl(
            "get", "deploy", self.fullname, "-n", self.system, "-o", "json").stdout)
        env = deployment_env(dep, pod_name=f"{self.fullname}-local-{self.pods}")
        # The kubelet mounts the serving certificate's Secret (webhooks and step reports).
        cert_dir = self.tmp / f"tls-{self.starts}"
        cert_dir.mkdir()
        secret = json.loads(self.cluster.kubectl(
            "get", "secret", f"{self.fullname}-webhook-tls", "-n", self.system,
            "-o", "json").stdout)
        for key, value in secret["data"].items():
            (cert_dir / key).write_bytes(base64.b64decode(value))
        for what in ("WEBHOOK", "REPORT"):
            if f"RLPACER_OPERATOR_{what}_CERT_DIR" in env:
                env[f"RLPACER_OPERATOR_{what}_CERT_DIR"] = str(cert_dir)
        for what in ("WEBHOOK", "METRICS"):  # the pod's IP is loopback here
            env[f"RLPACER_OPERATOR_{what}_HOST"] = "127.0.0.1"
        env["RLPACER_OPERATOR_REPORT_HOST"] = self.report_host
        env["RLPACER_OPERATOR_KUBECONFIG"] = str(self.cluster.kubeconfig_for_service_account(
            self.system, self.fullname))
        self.env = env
        full = {k: v for k, v in os.environ.items()
                if not k.startswith(("RLPACER_OPERATOR_", "KUBECONFIG"))}
        with self.log.open("ab") as out:
            out.write(f"\n===== start {self.starts} =====\n".encode())
            self.proc = subprocess.Popen([sys.executable, "-m", "rlpacer.cli", "operator"],
                                         env={**full, **env}, stdout=out,
                                         stderr=subprocess.STDOUT)
        port = env["RLPACER_OPERATOR_METRICS_PORT"]
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, f"operator exited:\n{self.tail()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"operator not ready:\n{self.tail()}"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""



def helm_values(jobs: str, ports: list[int], **extra: str) -> list[str]:
    """`--set` flags for a local install: one watched namespace, free ports, a loopback
    webhook URL (the operator runs as a local process), fast resyncs."""
    metrics, reports, webhook = ports
    values = {
        "rbac.scope": "Namespaced", "rbac.watchNamespaces": f"{{{jobs}}}",
        "service.ports.metrics": str(metrics), "service.ports.reports": str(reports),
        "webhook.port": str(webhook), "webhook.url": f"https://127.0.0.1:{webhook}",
        "operator.resyncSeconds": "2", **extra,
    }
    return [a for k, v in values.items() for a in ("--set", f"{k}={v}")]




# --- the command ------------------------------------------------------------------------------


def _dir(a: argparse.Namespace) -> Path:
    return Path(a.dir) if a.dir else cache_dir() / "dev-cluster"


def _state(d: Path) -> dict[str, Any] | None:
    p = d / "dev-cluster.json"
    return json.loads(p.read_text()) if p.is_file() else None


def _env_lines(kubeconfig: str, namespace: str) -> str:
    return (f"export KUBECONFIG={kubeconfig}\n"
            f"# jobs go into namespace {namespace}: kubectl apply -n {namespace} -f ...\n")


def cmd_up(a: argparse.Namespace) -> int:
    d = _dir(a)
    st = _state(d)
    if st is not None and pid_alive(int(st["supervisor"])):
        print(f"a dev cluster is already up in {d}: `rlpacer dev-cluster down` first",
              file=sys.stderr)
        return 1
    if d.exists():
        cmd_down(a, quiet=True)
    d.mkdir(parents=True)
    t0 = time.monotonic()
    print("==> local control plane (etcd, kube-apiserver, controller-manager, scheduler, "
          "KWOK nodes)", file=sys.stderr)
    cluster = LocalCluster(d / "cluster", keep_data=True, die_with_parent=False)
    try:
        cluster.start()
    except ClusterError as err:
        print(f"error: {err} (set up first: bash scripts/setup.sh)", file=sys.stderr)
        return 1
    try:
        for ns in (SYSTEM, a.namespace):
            cluster.create_namespace(ns)
        extra = {"kueue.enabled": "true"} if a.kueue else {}
        values = helm_values(a.namespace, free_ports(3), **extra)
        print(f"==> helm install {RELEASE} charts/rlpacer -n {SYSTEM} (watching {a.namespace})",
              file=sys.stderr)
        cluster.helm("install", RELEASE, str(CHART), "-n", SYSTEM, *values)
        state = {"kubeconfig": str(cluster.kubeconfig), "namespace": a.namespace,
                 "cluster_dir": str(d / "cluster"), "supervisor": 0, "kueue": a.kueue}
        (d / "dev-cluster.json").write_text(json.dumps(state))
        print("==> operator and pod players (background; log: "
              f"{d / 'supervisor.log'})", file=sys.stderr)
        with (d / "supervisor.log").open("ab") as log:
            sup = subprocess.Popen(
                [sys.executable, "-m", "rlpacer.devcluster", "serve", "--dir", str(d)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        state["supervisor"] = sup.pid
        (d / "dev-cluster.json").write_text(json.dumps(state))
        deadline = time.monotonic() + 180
        while not (d / "ready").exists():
            if sup.poll() is not None or time.monotonic() > deadline:
                print(f"error: the supervisor did not get ready; its log:\n"
                      f"{(d / 'supervisor.log').read_text(errors='replace')[-3000:]}",
                      file=sys.stderr)
                cmd_down(a, quiet=True)
                return 1
            time.sleep(0.5)
    except BaseException:
        cmd_down(a, quiet=True)
        raise
    if a.kueue:
        print(f"# Kueue is up: set spec.scheduling.queueName: default to queue a job in"
              f" {a.namespace}", file=sys.stderr)
    print(f"# dev cluster up in {time.monotonic() - t0:.0f} s. Try:\n"
          f"#   kubectl apply -n {a.namespace} -f examples/tiny-cluster-policy.yaml\n"
          f"#   kubectl apply -n {a.namespace} -f examples/tiny-cluster.yaml\n"
          f"#   kubectl get rltj -n {a.namespace} -w", file=sys.stderr)
    sys.stdout.write(_env_lines(str(cluster.kubeconfig), a.namespace))
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    """The background supervisor: the operator and the pod players, until SIGTERM."""
    from rlpacer.api import contract
    from rlpacer.testing.harness import PodHarness
    from rlpacer.testing.netns import TestHosts

    d = _dir(a)
    st = _state(d)
    assert st is not None, f"no dev cluster state in {d}"
    cluster = LocalCluster.attach(st["kubeconfig"])
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    kueue = None
    if st.get("kueue"):
        from rlpacer.testing.kueue import KueueProc, dev_queues

        kueue = KueueProc(cluster).start()
        dev_queues(cluster, st["namespace"])
        print("kueue ready: LocalQueue 'default' in namespace"
              f" {st['namespace']} (log: {kueue.log})", flush=True)
    hosts = TestHosts().start()
    op = OperatorProcess(cluster, RELEASE, SYSTEM, d)
    op.report_host = hosts.gateway
    svc = f"{op.fullname}.{SYSTEM}.svc"
    # testing settings (docs/testing.md) given to `up` reach every played pod
    testing = {k: v for k, v in os.environ.items() if k.startswith(TESTING_ENV_PREFIX)}
    harness = PodHarness(cluster, st["namespace"], d / "pods",
                         roles=[r.value for r in contract.Role], hosts=hosts,
                         names={svc: hosts.gateway, f"{svc}.cluster.local": hosts.gateway},
                         extra_env=testing)
    try:
        op.start()
        harness.start()
        (d / "ready").write_text(hosts.tag + "\n")  # the played hosts' name tag
        print(f"operator ready; playing pods of namespace {st['namespace']}", flush=True)
        while not stop:
            if op.proc is not None and op.proc.poll() is not None:
                print(f"operator exited ({op.proc.returncode}); restarting", flush=True)
                op.start(new_pod=False)  # the kubelet restarts the container in its pod
            for err in harness.errors[:]:
                print(f"harness: {err}", flush=True)
                harness.errors.remove(err)
            time.sleep(1)
    finally:
        harness.stop()
        hosts.close()
        op.stop()
        if kueue is not None:
            kueue.stop()
        cluster.stop()
    return 0


def cmd_down(a: argparse.Namespace, quiet: bool = False) -> int:
    from rlpacer.testing.cluster import main as cluster_main

    d = _dir(a)
    st = _state(d)
    if st is not None and int(st.get("supervisor") or 0) and pid_alive(int(st["supervisor"])):
        pid = int(st["supervisor"])
        os.kill(pid, signal.SIGTERM)
        for _ in range(120):
            if not pid_alive(pid):
                break
            time.sleep(0.5)
        else:
            os.killpg(pid, signal.SIGKILL)
    if (d / "cluster").exists():
        cluster_main(["down", "--dir", str(d / "cluster")])
    if d.exists():
        import shutil

        shutil.rmtree(d, ignore_errors=True)
    if not quiet:
        print(f"removed the dev cluster in {d}")
    return 0


def cmd_env(a: argparse.Namespace) -> int:
    st = _state(_dir(a))
    if st is None or not pid_alive(int(st.get("supervisor") or 0)):
        print("no dev cluster is up (start one: rlpacer dev-cluster up)", file=sys.stderr)
        return 1
    sys.stdout.write(_env_lines(st["kubeconfig"], st["namespace"]))
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "dev-cluster", help="a local cluster that runs jobs for real (control plane, chart, "
        "operator, every pod played on a host of its own)",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("action", choices=["up", "down", "env", "serve"],
                   help="serve: the background supervisor (started by up)")
    p.add_argument("--namespace", default="team-a", help="the jobs namespace (default team-a)")
    p.add_argument("--dir", default=None,
                   help=f"state folder (default {cache_dir() / 'dev-cluster'})")
    p.add_argument("--kueue", action="store_true",
                   help="up: also run Kueue (its CRDs, webhooks and controller manager), the"
                        " chart with kueue.enabled, and a LocalQueue 'default' in the jobs"
                        " namespace (ClusterQueue 'dev': the KWOK GPU nodes' 16 GPUs); jobs"
                        " with scheduling.queueName: default wait for its admission")
    p.set_defaults(func=lambda a: {"up": cmd_up, "down": cmd_down, "env": cmd_env,
                                   "serve": cmd_serve}[a.action](a))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlpacer.devcluster")
    sub = ap.add_subparsers(dest="command", required=True)
    register(sub)
    a = ap.parse_args(["dev-cluster", *(argv if argv is not None else sys.argv[1:])])
    return int(a.func(a))


if __name__ == "__main__":
    sys.exit(main())
