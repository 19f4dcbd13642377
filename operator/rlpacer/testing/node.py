"""A real Kubernetes node beside the KWOK nodes of :class:`~rlpacer.testing.cluster.LocalCluster`:
a kubelet that runs pods as containers, so a pod spec is started as a real cluster would.

Parts, all on this machine as the launcher's other processes:

* **containerd** (Debian's 1.6 package) with its CRI plugin and **runc**. Its image store is kept
  in the cache (``${RLPACER_CACHE}/containerd``) so the project's images are imported once per
  build, not per cluster; its state (sockets, tasks) lives in the cluster's folder. No registry
  is reachable: the pod sandbox ("pause") image is built locally (``hack/pause``, by
  ``scripts/build-images.sh``) and every image comes from podman's store (``podman save`` +
  ``ctr images import``), so pods must use ``imagePullPolicy: IfNotPresent`` or ``Never``.
* **CNI bridge networking** (the ``containernetworking-plugins`` package): pods get addresses in
  :data:`POD_SUBNET` on the bridge :data:`BRIDGE`, whose host side :data:`GATEWAY` is the node's
  address. The API server listens there too (``--advertise-address``), so the ``kubernetes``
  Service has a reachable endpoint.
* **kube-proxy** (iptables mode): ClusterIP Services from pods and from this host (the API server
  calls webhooks through their Service).
* **CoreDNS** (built with only the plugins a cluster's DNS needs, ``hack/coredns``) on the
  node's address, port 53, as the kubelet's ``clusterDNS``: pods find Services by name
  (``<service>.<namespace>.svc.cluster.local``) with the identity ``system:coredns``, which may
  only read Services, EndpointSlices and Namespaces. It answers nothing outside the cluster's
  domain (no upstream is reachable here): such names fail at once instead of timing out.
* **kube-router**'s network-policy controller (``--run-firewall`` only: no routing, no service
  proxy; built like the control plane, ``hack/versions.env`` says why this one): NetworkPolicies
  are enforced on the node's pods (iptables and ipset rules in the host's tables, from the
  identity ``system:rlpacer:network-policy``, which may only read pods, namespaces, nodes,
  Services, endpoints and NetworkPolicies). Traffic from the node itself (kubelet probes, the
  API server's webhook calls, this machine's tests) always passes, as NetworkPolicy semantics
  leave it.
* **kubelet** v1.33 (built like the control plane, ``hack/build-binaries.sh``) with credentials
  for the Node authorizer (``system:node:<name>`` in ``system:nodes``), serving its API over TLS
  (``kubectl logs``/``exec`` through the API server, which authenticates with a client
  certificate of its own).

What this machine's kernel refuses, and what the node does instead (each found by running it):

* lowering ``oom_score_adj`` and raising rlimits need CAP_SYS_RESOURCE, which the machine lacks:
  containerd's CRI runs with ``restrict_oom_score_adj = true`` (containers keep the kubelet's
  score or higher) and the kubelet with ``oomScoreAdj: 0``; its "Failed to set rlimit" is logged
  and harmless;
* cgroup v1 only: the kubelet runs with ``failCgroupV1: false`` and the ``cgroupfs`` driver (no
  systemd here).

One real node per machine at a time (the bridge, the kubelet's port and kube-proxy's iptables
chains are the host's): a second start fails with :class:`NodeBusyError`. :meth:`RealNode.stop`
deletes the node's pods, stops the containers, then the processes, and removes the bridge, the
pods' network namespaces, kube-proxy's and kube-router's rules and kube-router's ipsets.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

from rlpacer.testing.base import _Http, bin_dir, cache_dir, find_binary, free_ports

T = TypeVar("T")


class NodeHost(Protocol):
    """What a real node uses of the cluster it joins (``rlpacer.testing.cluster.LocalCluster``;
    typed here so this module does not import the launcher, which imports it)."""

    data_dir: Path
    startup_timeout: float
    service_cidr: str

    @property
    def http(self) -> _Http: ...

    def _spawn(self, name: str, exe: Path, args: list[str]) -> object: ...

    def _wait(self, what: str, check: Callable[[], T | None], deadline: float,
              interval: float = 0.2) -> T: ...

NODE_NAME = "rlpacer-node-0"
BRIDGE = "rlpacer0"
GATEWAY = "10.88.0.1"
POD_SUBNET = "10.88.0.0/24"
#: kube-proxy's cluster CIDR (traffic from outside it to a Service is masqueraded).
CLUSTER_CIDR = "10.88.0.0/16"
#: The label every real node carries (KWOK nodes do not), for nodeSelectors in tests.
NODE_LABEL = ("rlpacer.io/node", "real")
PAUSE_IMAGE = "localhost/rlpacer/pause:3.10"
CNI_BIN_DIRS = ("/usr/lib/cni", "/opt/cni/bin")
#: Ports on the node's address (kubelet) and loopback (kube-proxy).
KUBELET_PORT = 10250
KUBE_PROXY_HEALTHZ = "127.0.0.1:10256"
KUBE_PROXY_METRICS = "127.0.0.1:10249"

SETUP_HINT = ("run bash scripts/setup.sh (it installs containerd and ipset and builds kubelet,"
              " kube-proxy, coredns and kube-router)")


class NodeError(RuntimeError):
    """The real node could not start (what is missing or failed, and how to fix it)."""


class NodeBusyError(NodeError):
    """Another real node runs on this machine."""


def _cache() -> Path:
    return cache_dir()


def _run(*cmd: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise NodeError(f"{' '.join(cmd)} -> exit {p.returncode}: {(p.stderr or p.stdout)[-2000:]}")
    return p


def cni_bin_dir() -> Path | None:
    return next((Path(d) for d in CNI_BIN_DIRS if (Path(d) / "bridge").is_file()), None)


def missing_prerequisites() -> list[str]:
    """What this machine lacks to run a real node, each with its fix (empty: nothing)."""
    out = []
    for tool, pkg in (("containerd", "containerd"), ("ctr", "containerd"), ("runc", "runc"),
                      ("iptables", "iptables"), ("ip", "iproute2"), ("podman", "podman")):
        if shutil.which(tool) is None:
            out.append(f"{tool} (apt-get install {pkg}, or {SETUP_HINT})")
    if cni_bin_dir() is None:
        out.append("the CNI plugins in /usr/lib/cni or /opt/cni/bin (apt-get install"
                   " containernetworking-plugins)")
    if shutil.which("ipset") is None:
        out.append("ipset (apt-get install ipset), for kube-router's NetworkPolicy rules")
    for b in ("kubelet", "kube-proxy", "coredns", "kube-router"):
        if not (bin_dir() / b).is_file():
            out.append(f"{bin_dir() / b} ({SETUP_HINT})")
    if os.geteuid() != 0:
        out.append("root (a kubelet and containerd need it)")
    return out


def _podman() -> list[str]:
    from rlpacer.testing.containers import podman_base

    return podman_base()


def podman_image_id(ref: str) -> str | None:
    p = subprocess.run([*_podman(), "image", "inspect", "--format", "{{.Id}}", ref],
                       capture_output=True, text=True)
    return p.stdout.strip() or None if p.returncode == 0 else None


class RealNode:
    """containerd + CNI + kube-proxy + kubelet, registered with ``cluster`` as
    :data:`NODE_NAME`. Started by ``LocalCluster(real_node=True)``; see the module's doc."""

    def __init__(self, cluster: NodeHost, images: Sequence[str] = ()) -> None:
        self.cluster = cluster
        self.images = tuple(images)
        self.dir = cluster.data_dir / "node"
        self.store = _cache() / "containerd"
        self.socket = self.dir / "containerd" / "containerd.sock"
        self._lock: IO[str] | None = None
        #: set once this handle owns the host's node parts (prepare_host, or detached)
        self._active = False
        self.import_seconds: dict[str, float] = {}

    @classmethod
    def detached(cls, cluster: NodeHost, data_dir: Path) -> RealNode:
        """A handle on the node of a cluster started by another process (``cluster down``)."""
        node = cls(cluster)
        node.dir = data_dir / "node"
        node.socket = node.dir / "containerd" / "containerd.sock"
        node._active = True
        return node

    # ---- start -------------------------------------------------------------------------------

    def prepare_host(self) -> None:
        """Before the API server starts: take the machine's node lock and bring up the bridge
        (the API server advertises its address)."""
        missing = missing_prerequisites()
        if missing:
            raise NodeError("a real node needs: " + "; ".join(missing))
        _cache().mkdir(parents=True, exist_ok=True)
        self._lock = open(_cache() / ".real-node.lock", "w")  # noqa: SIM115 (held until stop)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            holder = (_cache() / ".real-node.owner").read_text() if (
                _cache() / ".real-node.owner").exists() else "?"
            raise NodeBusyError(
                f"another real node runs on this machine (cluster {holder}); stop it first"
                " (python -m rlpacer.testing.cluster down)") from None
        (_cache() / ".real-node.owner").write_text(str(self.cluster.data_dir))
        self._active = True
        self._cleanup_host()  # what a killed run may have left
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        for host, port, what in ((GATEWAY, KUBELET_PORT, "the kubelet"), (GATEWAY, 53, "DNS"),
                                 (*KUBE_PROXY_HEALTHZ.split(":"), "kube-proxy's health check"),
                                 (*KUBE_PROXY_METRICS.split(":"), "kube-proxy's metrics")):
            with socket.socket() as sock:
                try:
                    sock.bind((str(host), int(port)))
                except OSError as e:
                    raise NodeBusyError(
                        f"port {host}:{port} for {what} is taken ({e}): another kubelet or"
                        " kube-proxy runs on this machine; stop it first") from None

    def start(self) -> None:
        """After the control plane is up: containerd, images, kube-proxy, kubelet; returns
        when the node is Ready."""
        c = self.cluster
        d = self.dir
        (d / "containerd").mkdir(parents=True, exist_ok=True)
        (d / "cni" / "net.d").mkdir(parents=True, exist_ok=True)
        self.store.mkdir(parents=True, exist_ok=True)
        (d / "containerd" / "config.toml").write_text(
            containerd_config(self.store, d, self.socket))
        (d / "cni" / "net.d" / "10-rlpacer.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "rlpacer",
            "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True,
                 "hairpinMode": True,
                 "ipam": {"type": "host-local",
                          "ranges": [[{"subnet": POD_SUBNET, "gateway": GATEWAY}]],
                          "routes": [{"dst": "0.0.0.0/0"}],
                          "dataDir": str(d / "cni" / "ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
                {"type": "loopback"},
            ]}, indent=2))
        containerd = shutil.which("containerd")
        assert containerd is not None
        c._spawn("containerd", Path(containerd),
                 ["--config", str(d / "containerd" / "config.toml")])
        deadline = time.monotonic() + c.startup_timeout
        c._wait("containerd", lambda: self._ctr("version", check=False).returncode == 0,
                deadline, interval=0.3)
        self._remove_leftover_containers()
        for ref in (PAUSE_IMAGE, *self.images):
            self.import_image(ref)
        deadline = time.monotonic() + c.startup_timeout  # imports take minutes when cold

        pki = c.data_dir / "pki"
        kc_node, kc_proxy = c.data_dir / "node.kubeconfig", c.data_dir / "kube-proxy.kubeconfig"
        (d / "kube-proxy.yaml").write_text(json.dumps({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kc_proxy)},
            "hostnameOverride": NODE_NAME, "mode": "iptables", "clusterCIDR": CLUSTER_CIDR,
            "bindAddress": GATEWAY, "healthzBindAddress": KUBE_PROXY_HEALTHZ,
            "metricsBindAddress": KUBE_PROXY_METRICS,
            # this machine's conntrack table is the host's: leave its size alone
            "conntrack": {"maxPerCore": 0, "min": 0},
            "iptables": {"localhostNodePorts": False},
            "nodePortAddresses": [f"{GATEWAY}/32"],
        }, indent=2))
        self._start_dns(find_binary("coredns"), deadline)
        c._spawn("kube-proxy", find_binary("kube-proxy"), [f"--config={d / 'kube-proxy.yaml'}",
                                                          "--v=1"])
        (d / "kubelet.yaml").write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": GATEWAY, "port": KUBELET_PORT, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": 0,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(pki / "ca.crt")}},
            "authorization": {"mode": "Webhook"},
            "tlsCertFile": str(pki / "kubelet-serving.crt"),
            "tlsPrivateKeyFile": str(pki / "kubelet-serving.key"),
            "cgroupDriver": "cgroupfs", "failCgroupV1": False,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "clusterDomain": "cluster.local", "clusterDNS": [GATEWAY],
            "resolvConf": "/etc/resolv.conf",
            "failSwapOn": False, "makeIPTablesUtilChains": False,
            "protectKernelDefaults": False, "oomScoreAdj": 0,
            "enforceNodeAllocatable": [], "cgroupsPerQOS": True,
            # a test machine: never evict or collect images (they cannot be pulled again)
            "evictionHard": {}, "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99, "localStorageCapacityIsolation": False,
            "serializeImagePulls": False, "syncFrequency": "10s",
            "nodeStatusUpdateFrequency": "10s", "podPidsLimit": -1, "maxPods": 50,
        }, indent=2))
        c._spawn("kubelet", find_binary("kubelet"), [
            f"--config={d / 'kubelet.yaml'}", f"--kubeconfig={kc_node}",
            f"--root-dir={d / 'kubelet'}", f"--hostname-override={NODE_NAME}",
            f"--node-ip={GATEWAY}", f"--node-labels={NODE_LABEL[0]}={NODE_LABEL[1]}", "--v=1",
        ])

        def ready() -> bool:
            st, node = c.http.request("GET", f"/api/v1/nodes/{NODE_NAME}", timeout=3)
            if st != 200:
                return False
            return any(x["type"] == "Ready" and x["status"] == "True"
                       for x in node.get("status", {}).get("conditions", []))

        c._wait(f"the kubelet to register {NODE_NAME} Ready", ready, deadline)
        self._start_network_policies(deadline)

    def _create_rbac(self, objs: list[dict[str, Any]]) -> None:
        """Create RBAC objects (ClusterRoles, ClusterRoleBindings) unless they exist."""
        for obj in objs:
            kind = obj["kind"].lower() + "s"
            st, body = self.cluster.http.request(
                "POST", f"/apis/rbac.authorization.k8s.io/v1/{kind}", obj, timeout=10)
            if st not in (200, 201, 409):
                raise NodeError(f"creating {obj['kind']} {obj['metadata']['name']}: {st} {body}")

    def _start_network_policies(self, deadline: float) -> None:
        """kube-router's network-policy controller, once the Node exists (it reads its address
        there); returns after its first sync (its health endpoint answers only then)."""
        c = self.cluster
        self._create_rbac(_network_policy_rbac())
        (health,) = free_ports(1)
        c._spawn("kube-router", find_binary("kube-router"), [
            "--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
            "--enable-cni=false", "--enable-ipv6=false",
            f"--kubeconfig={c.data_dir / 'network-policy.kubeconfig'}",
            f"--hostname-override={NODE_NAME}", f"--health-port={health}",
            # the node's Service range (kube-router lets pods' traffic to Service addresses
            # through before kube-proxy's DNAT; the policies then apply to the real peer)
            f"--service-cluster-ip-range={c.service_cidr}",
            "--iptables-sync-period=30s", "--v=1",
        ])

        def synced() -> bool:
            return _Http(f"http://127.0.0.1:{health}", None).request(
                "GET", "/healthz", timeout=2)[0] == 200

        c._wait("kube-router's network-policy controller (its first sync)", synced, deadline)

    def _start_dns(self, coredns: Path, deadline: float) -> None:
        c = self.cluster
        self._create_rbac(_dns_rbac())
        health, ready = free_ports(2)
        corefile = self.dir / "Corefile"
        corefile.write_text(f"""cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {{
    bind {GATEWAY}
    errors
    health 127.0.0.1:{health}
    ready 127.0.0.1:{ready}
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {c.data_dir / 'coredns.kubeconfig'}
        pods insecure
        ttl 5
    }}
    cache 5
}}
.:53 {{
    bind {GATEWAY}
    errors
}}
""")
        c._spawn("coredns", coredns, ["-conf", str(corefile)])

        def dns_ready() -> bool:
            return _Http(f"http://127.0.0.1:{ready}", None).request(
                "GET", "/ready", timeout=2)[0] == 200

        c._wait("CoreDNS /ready (its Kubernetes caches synced)", dns_ready, deadline)

    # ---- images ------------------------------------------------------------------------------

    def _ctr(self, *args: str, check: bool = True, timeout: float = 600,
             ) -> subprocess.CompletedProcess[str]:
        return _ctr_at(self.socket, *args, check=check, timeout=timeout)

    def import_image(self, ref: str) -> None:
        """Import ``ref`` from podman's store into the node's containerd, unless it is there."""
        took = import_image(self.socket, self.dir, ref)
        if took is not None:
            self.import_seconds[ref] = took

    # ---- stop --------------------------------------------------------------------------------

    def stop_pods(self, timeout: float = 60.0) -> None:
        """Cordon the node, delete every pod bound to it (grace 0) and wait until containerd
        runs no container. Cordoned first, so that a controller still running (a Deployment's
        ReplicaSet) cannot place a replacement on the node while it empties."""
        c = self.cluster
        try:
            c.http.request("PATCH", f"/api/v1/nodes/{NODE_NAME}",
                           {"spec": {"unschedulable": True}}, timeout=5,
                           content_type="application/merge-patch+json")
            st, pods = c.http.request(
                "GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{NODE_NAME}", timeout=5)
        except Exception:
            return
        if st != 200:
            return
        for p in pods.get("items", []):
            m = p["metadata"]
            c.http.request("DELETE", f"/api/v1/namespaces/{m['namespace']}/pods/{m['name']}",
                           {"gracePeriodSeconds": 0}, timeout=5)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._running_tasks():
                return
            time.sleep(0.5)

    def _running_tasks(self) -> list[str]:
        """containerd's tasks whose process still runs (a stopped task stays listed until its
        container is removed, which the kubelet may leave to its garbage collection)."""
        out = self._ctr("tasks", "ls", check=False)
        if out.returncode != 0:
            return []
        return [ln.split()[0] for ln in out.stdout.splitlines()[1:]
                if len(ln.split()) >= 3 and ln.split()[2] == "RUNNING"]

    def _remove_leftover_containers(self) -> None:
        """Kill and remove whatever containers the store holds (a run killed before its
        teardown leaves them, and the kubelet of a new cluster would not know them)."""
        for cid in self._ctr("tasks", "ls", "-q", check=False).stdout.split():
            self._ctr("tasks", "kill", "-s", "SIGKILL", cid, check=False)
        deadline = time.monotonic() + 10
        while self._ctr("tasks", "ls", "-q", check=False).stdout.split() and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        for cid in self._ctr("tasks", "ls", "-q", check=False).stdout.split():
            self._ctr("tasks", "rm", "-f", cid, check=False)
        ids = self._ctr("containers", "ls", "-q", check=False).stdout.split()
        if ids:
            self._ctr("containers", "rm", *ids, check=False)

    def before_processes_stop(self) -> None:
        """Called by the cluster's stop() while the API server still runs."""
        if not self._active:
            return
        try:
            self.stop_pods()
        finally:
            if self.socket.exists():
                self._remove_leftover_containers()

    def after_processes_stop(self) -> None:
        """Called by the cluster's stop() once its processes are gone."""
        if not self._active:
            return
        try:
            self._cleanup_host()
        finally:
            self._active = False
            if self._lock is not None:
                self._lock.close()
                self._lock = None

    def _cleanup_host(self) -> None:
        # shims of containers a killed run left (they outlive containerd): a shim's -address is
        # its node's socket, <cluster dir>/node/containerd/containerd.sock (one real node per
        # machine, so every such shim is a real node's)
        _run("pkill", "-KILL", "-f", "containerd-shim-runc-v2 -namespace k8s.io -id [^ ]+"
             " -address [^ ]*/node/containerd/containerd[.]sock", check=False)
        # kube-router's rules and ipsets (its chains are KUBE-* too; the ipsets only it knows)
        if (bin_dir() / "kube-router").is_file():
            _run(str(bin_dir() / "kube-router"), "--cleanup-config", check=False, timeout=60)
        # kube-proxy's chains (iptables only; the kube-proxy binary knows them all)
        if (bin_dir() / "kube-proxy").is_file():
            _run(str(bin_dir() / "kube-proxy"), "--cleanup", check=False, timeout=60)
        _remove_kube_chains()
        _remove_kube_router_ipsets()
        # the pods' network namespaces (containerd's CRI names them cni-<uuid>)
        netns = Path("/var/run/netns")
        if netns.is_dir():
            for ns in netns.glob("cni-*"):
                _run("umount", str(ns), check=False)
                ns.unlink(missing_ok=True)
        _run("ip", "link", "del", BRIDGE, check=False)
        # overlay mounts of the store's snapshots
        mounts = Path("/proc/mounts").read_text().splitlines()
        for line in mounts:
            parts = line.split()
            if len(parts) > 1 and (str(self.store) in parts[1] or str(self.dir) in parts[1]):
                _run("umount", "-l", parts[1], check=False)


def _remove_kube_chains() -> None:
    """Delete the ``KUBE-*`` chains kube-proxy and the kubelet leave in the host's iptables
    (``kube-proxy --cleanup`` keeps a few: the canaries, KUBE-MARK-MASQ)."""
    for tool in ("iptables", "ip6tables"):
        if shutil.which(tool) is None:
            continue
        for table in ("nat", "filter", "mangle"):
            rules = _run(tool, "-t", table, "-S", check=False).stdout.splitlines()
            for r in rules:  # jumps into our chains from the built-in chains first
                f = shlex.split(r)  # kube-router's rules carry quoted comments
                if f[:1] == ["-A"] and not f[1].startswith("KUBE-") and "-j" in f and \
                        f[f.index("-j") + 1].startswith("KUBE-"):
                    _run(tool, "-t", table, "-D", *f[1:], check=False)
            chains = [r.split()[1] for r in rules if r.startswith("-N KUBE-")]
            for ch in chains:
                _run(tool, "-t", table, "-F", ch, check=False)
            for ch in chains:
                _run(tool, "-t", table, "-X", ch, check=False)


def _dns_rbac() -> list[dict[str, Any]]:
    """What CoreDNS's kubernetes plugin reads, granted to its user ``system:coredns``."""
    return _user_role("rlpacer:coredns", "system:coredns", [
        {"apiGroups": [""], "resources": ["services", "namespaces"], "verbs": ["list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
         "verbs": ["list", "watch"]},
    ])


def _user_role(name: str, user: str, rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A ClusterRole ``name`` with ``rules``, bound to the user ``user`` (a client
    certificate's CN)."""
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": name}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": name},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": name},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]},
    ]


def _remove_kube_router_ipsets() -> None:
    """Destroy the ipsets kube-router's policy controller made (``KUBE-SRC-*``, ``KUBE-DST-*``,
    ``kube-router-*``) that its ``--cleanup-config`` left: those still referenced by rules
    when it ran (a node whose controller was killed). Nothing else here makes ipsets."""
    if shutil.which("ipset") is None:
        return
    for name in _run("ipset", "list", "-n", check=False).stdout.split():
        if name.startswith(("KUBE-", "kube-router-")):
            _run("ipset", "destroy", name, check=False)


def _network_policy_rbac() -> list[dict[str, Any]]:
    """What kube-router's network-policy controller reads (its informers), granted to its user
    ``system:rlpacer:network-policy``: read only."""
    read = ["get", "list", "watch"]
    return _user_role("rlpacer:network-policy", "system:rlpacer:network-policy", [
        {"apiGroups": [""], "resources": ["pods", "namespaces", "nodes", "services", "endpoints"],
         "verbs": read},
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": read},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": read},
    ])


def node_cert_clients() -> dict[str, tuple[str, str]]:
    """The client certificates a real node adds: {file name: (CN, O)}."""
    return {
        "node": (f"system:node:{NODE_NAME}", "system:nodes"),
        "kube-proxy": ("system:kube-proxy", ""),
        "coredns": ("system:coredns", ""),
        "network-policy": ("system:rlpacer:network-policy", ""),
        # The API server's client certificate towards kubelets (logs, exec, port-forward).
        "kubelet-client": ("kube-apiserver-kubelet-client", "system:masters"),
    }


def apiserver_args(pki: Path) -> list[str]:
    """kube-apiserver flags for a cluster with a real node."""
    return [
        # pods reach the API server on the bridge (the kubernetes Service's endpoint)
        "--bind-address=0.0.0.0",
        f"--advertise-address={GATEWAY}",
        "--endpoint-reconciler-type=lease",
        "--kubelet-preferred-address-types=InternalIP",
        f"--kubelet-client-certificate={pki / 'kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'kubelet-client.key'}",
        f"--kubelet-certificate-authority={pki / 'ca.crt'}",
    ]


def containerd_config(store: Path, node_dir: Path, sock: Path) -> str:
    """The node's containerd configuration: images and snapshots in ``store`` (kept across
    clusters), state, socket and CNI configuration under ``node_dir``."""
    return f"""version = 2
root = "{store}"
state = "{node_dir / 'containerd' / 'state'}"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin_dir()}"
    conf_dir = "{node_dir / 'cni' / 'net.d'}"
"""


def _ctr_at(sock: Path, *args: str, check: bool = True, timeout: float = 600,
            ) -> subprocess.CompletedProcess[str]:
    return _run("ctr", "--address", str(sock), "-n", "k8s.io", *args, check=check,
                timeout=timeout)


def image_digests(sock: Path) -> dict[str, str]:
    """The image refs of the containerd at ``sock`` -> the digest each points to."""
    out = {}
    for ln in _ctr_at(sock, "images", "ls").stdout.splitlines()[1:]:
        f = ln.split()
        if len(f) > 2:
            out[f[0]] = f[2]
    return out


def image_config(sock: Path, manifest: str) -> str | None:
    """The config digest (an image's ID) of the manifest ``manifest`` in the containerd at
    ``sock``, or None if it cannot be read."""
    p = _ctr_at(sock, "content", "get", manifest, check=False)
    try:
        return str(json.loads(p.stdout)["config"]["digest"]) if p.returncode == 0 else None
    except (ValueError, KeyError, TypeError):
        return None


def import_image(sock: Path, work_dir: Path, ref: str) -> float | None:
    """Import ``ref`` from podman's store into the containerd at ``sock`` (the tar in
    ``work_dir``), unless the same image is there already: ``ref``'s manifest there names
    podman's image ID as its config (podman's ID is the config's digest, and ``podman save``
    keeps the config as it is). Returns the seconds the import took, None if skipped."""
    pid = podman_image_id(ref)
    if pid is None:
        raise NodeError(f"image {ref} is not in podman's store: build it (bash"
                        " scripts/build-images.sh)")
    manifest = image_digests(sock).get(ref)
    if manifest is not None and \
            image_config(sock, manifest) == f"sha256:{pid.removeprefix('sha256:')}":
        return None
    t0 = time.monotonic()
    tar = work_dir / "image.tar"
    try:
        _run(*_podman(), "save", "--format", "docker-archive", "-o", str(tar), ref,
             timeout=1200)
        _ctr_at(sock, "images", "import", str(tar), timeout=1200)
    finally:
        tar.unlink(missing_ok=True)
    return time.monotonic() - t0


def preload(images: Sequence[str]) -> dict[str, float | None] | None:
    """Import ``images`` (and the pause image) into the real node's image store ahead of its
    start: set-up does this right after building them, in the background beside the control
    plane's build, so a cold run's first real node finds them (the trainer image's import
    is minutes). Runs a containerd of its own on the store for the imports. Returns the
    seconds each import took (None: already there), or None if a real node runs now (it
    imports what it lacks when it starts)."""
    import tempfile

    missing = [t for t in ("containerd", "ctr", "podman") if shutil.which(t) is None]
    if missing:
        raise NodeError(f"preloading the node's images needs {', '.join(missing)} ({SETUP_HINT})")
    _cache().mkdir(parents=True, exist_ok=True)
    with open(_cache() / ".real-node.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        store = _cache() / "containerd"
        store.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="rlpacer-preload-") as tmp:
            d = Path(tmp)
            (d / "containerd").mkdir()
            sock = d / "containerd" / "containerd.sock"
            (d / "containerd" / "config.toml").write_text(containerd_config(store, d, sock))
            containerd = shutil.which("containerd")
            assert containerd is not None
            with open(d / "containerd.log", "wb") as log:
                proc = subprocess.Popen(
                    [containerd, "--config", str(d / "containerd" / "config.toml")],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                deadline = time.monotonic() + 60
                while _ctr_at(sock, "version", check=False).returncode != 0:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise NodeError("containerd did not start for the image preload: "
                                        + (d / "containerd.log").read_text()[-2000:])
                    time.sleep(0.3)
                return {ref: import_image(sock, d, ref)
                        for ref in dict.fromkeys((PAUSE_IMAGE, *images))}
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                # overlay mounts an unpack may have left under the temporary state
                for line in Path("/proc/mounts").read_text().splitlines():
                    parts = line.split()
                    if len(parts) > 1 and parts[1].startswith(str(d)):
                        _run("umount", "-l", parts[1], check=False)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m rlpacer.testing.node",
        description="The real node's image store (scripts/setup.sh runs this after building"
                    " the images).")
    ap.add_argument("command", choices=["preload"],
                    help="preload: import the project's images into the node's containerd store")
    ap.parse_args(argv)
    from rlpacer.testing.containers import project_images

    try:
        took = preload(tuple(project_images().values()))
    except NodeError as e:
        print(f"error: {e}")
        return 1
    if took is None:
        print("a real node runs now: it imports what it lacks when it starts")
        return 0
    for ref, s in took.items():
        print(f"{ref}: " + ("already in the node's store" if s is None
                            else f"imported in {s:.0f} s"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
