"""A real Kubernetes control plane as local processes, for tests (no Docker).

Starts etcd, kube-apiserver (secure port on loopback, generated certificates, Node+RBAC
authorization, service-account signing keys, the default admission plugins including the
validating/mutating webhooks), kube-controller-manager (all controllers, incl. garbage collection,
service accounts and tokens), kube-scheduler and KWOK (simulated nodes and pod lifecycles), then
creates simulated nodes: CPU nodes and GPU nodes with ``nvidia.com/gpu`` capacity, GPU labels and
the ``nvidia.com/gpu=present:NoSchedule`` taint that real GPU clusters carry.

Binaries come from ``hack/build-binaries.sh`` (``bash scripts/setup.sh``), cached in
``${RLPACER_CACHE:-~/.cache/rlpacer}/bin`` (or ``$RLPACER_BIN_DIR``).

Python::

    with LocalCluster() as c:            # starts everything, waits until usable
        c.kubectl("get", "nodes")
        api = c.api_client()             # kubernetes.client.ApiClient, admin
        kc = c.kubeconfig_for_service_account("ns", "sa")   # exactly RBAC's rights

Command line (a cluster that outlives the command, for iterating by hand)::

    python -m rlpacer.testing.cluster up      # prints `export KUBECONFIG=...` lines
    eval "$(python -m rlpacer.testing.cluster env)"
    python -m rlpacer.testing.cluster down

With ``RLPACER_KUBECONFIG`` set (``env`` prints it), the pytest fixture reuses that running
cluster instead of starting one.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import yaml

# The launcher's errors, locations and HTTP client live in rlpacer.testing.base (the real node
# imports them from there, not from here: no import cycle); re-exported for this module's users.
from rlpacer.testing.base import BUILD_COMMAND as BUILD_COMMAND
from rlpacer.testing.base import SETUP_COMMAND as SETUP_COMMAND
from rlpacer.testing.base import ApiError as ApiError
from rlpacer.testing.base import ClusterError as ClusterError
from rlpacer.testing.base import ClusterStartError as ClusterStartError
from rlpacer.testing.base import MissingBinaryError as MissingBinaryError
from rlpacer.testing.base import PortInUseError as PortInUseError
from rlpacer.testing.base import _Http
from rlpacer.testing.base import bin_dir as bin_dir
from rlpacer.testing.base import cache_dir as cache_dir
from rlpacer.testing.base import check_port_free as check_port_free
from rlpacer.testing.base import find_binary as find_binary
from rlpacer.testing.base import find_kubectl as find_kubectl
from rlpacer.testing.base import free_ports as free_ports
from rlpacer.testing.base import pinned_versions as pinned_versions
from rlpacer.testing.base import repo_root as repo_root
from rlpacer.testing.kwok_stages import EXIT_ANNOTATION, NODE_ANNOTATION, stages_yaml

T = TypeVar("T")

#: Reuse an already running cluster: path of its admin kubeconfig.
ENV_KUBECONFIG = "RLPACER_KUBECONFIG"
CONTROL_PLANE_BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
)
SERVICE_CIDR = "10.96.0.0/16"
#: The Services of a cluster with a real node: its kube-proxy writes the host's iptables rules
#: for them, so they must not be another local cluster's Service addresses (10.96.0.1 is every
#: cluster's ``kubernetes`` Service, which an in-cluster client of another cluster would use).
REAL_NODE_SERVICE_CIDR = "10.97.0.0/16"
POD_CIDR = "10.244.0.1/16"
NODE_IP = "10.0.0.1"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
#: A real node's address (rlpacer.testing.node.GATEWAY): in the API server's certificate always.
REAL_NODE_IP = "10.88.0.1"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_TAINT: dict[str, str] = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
#: A toleration that lets a pod onto the GPU nodes.
GPU_TOLERATION: dict[str, str] = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


# --------------------------------------------------------------------------------------------
# certificates (openssl CLI; EC P-256 for TLS, RSA for service-account tokens)


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if not exe:
        raise MissingBinaryError(
            "openssl not found on PATH: needed to generate the cluster's certificates "
            "(apt-get install openssl)"
        )
    r = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise ClusterStartError(f"openssl {' '.join(args)} failed: {r.stderr.strip()}")


@dataclass(frozen=True)
class _Certs:
    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    def crt(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"


def _make_certs(d: Path, clients: Mapping[str, tuple[str, str]],
                servers: Mapping[str, str] | None = None) -> _Certs:
    """CA, apiserver serving cert, client certs {name: (CN, O)}, other serving certs
    {name: subjectAltName}, SA key pair."""
    d.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "3650",
        "-subj",
        "/CN=rlpacer-local-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        cwd=d,
    )

    def leaf(name: str, subj: str, ext: str) -> None:
        (d / f"{name}.ext").write_text(ext)
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subj, cwd=d)
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-set_serial",
            "0x" + secrets.token_hex(8),
            "-days",
            "3650",
            "-out",
            f"{name}.crt",
            "-extfile",
            f"{name}.ext",
            cwd=d,
        )

    sans = ",".join(
        [
            "IP:127.0.0.1",
            "IP:10.96.0.1",  # the kubernetes Service (SERVICE_CIDR)
            "IP:10.97.0.1",  # ... of a cluster with a real node (REAL_NODE_SERVICE_CIDR)
            f"IP:{REAL_NODE_IP}",  # a real node's pods reach the API server there
            "DNS:localhost",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
        ]
    )
    leaf(
        "apiserver",
        "/CN=kube-apiserver",
        f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n",
    )
    for name, san in (servers or {}).items():
        leaf(name, f"/CN={name}", f"subjectAltName={san}\nextendedKeyUsage=serverAuth\n"
             "keyUsage=critical,digitalSignature,keyEncipherment\n")
    for name, (cn, org) in clients.items():
        subj = (f"/O={org}" if org else "") + f"/CN={cn}"
        leaf(
            name,
            subj,
            "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n",
        )
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    for p in d.glob("*.key"):
        p.chmod(0o600)
    return _Certs(d)


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(
    path: Path,
    server: str,
    ca_data: str,
    user: Mapping[str, str],
    name: str = "rlpacer-local",
    namespace: str | None = None,
) -> Path:
    """Write a one-context kubeconfig. ``user`` is the kubeconfig `user` entry (token or certs)."""
    ctx: dict[str, str] = {"cluster": name, "user": name}
    if namespace:
        ctx["namespace"] = namespace
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": name, "cluster": {"server": server, "certificate-authority-data": ca_data}}
        ],
        "users": [{"name": name, "user": dict(user)}],
        "contexts": [{"name": name, "context": ctx}],
        "current-context": name,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg, sort_keys=False))
    tmp.chmod(0o600)
    tmp.replace(path)
    return path


# --------------------------------------------------------------------------------------------
# simulated nodes


@dataclass(frozen=True)
class NodeSpec:
    """A KWOK node. GPU nodes get nvidia.com/gpu capacity, GPU labels and the GPU taint."""

    name: str
    cpu: str = "32"
    memory: str = "128Gi"
    pods: str = "110"
    gpus: int = 0
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"
    gpu_memory_mib: int = 81559
    instance_type: str = "kwok-cpu-32"
    zone: str = "local-a"
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: Sequence[Mapping[str, str]] = ()

    def manifest(self) -> dict[str, Any]:
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "kubernetes.io/role": "agent",
            "node.kubernetes.io/instance-type": self.instance_type,
            "topology.kubernetes.io/zone": self.zone,
            "type": "kwok",
        }
        capacity = {
            "cpu": self.cpu,
            "memory": self.memory,
            "pods": self.pods,
            "ephemeral-storage": "1Ti",
        }
        taints: list[dict[str, str]] = [dict(t) for t in self.taints]
        if self.gpus:
            labels.update(
                {
                    "nvidia.com/gpu.present": "true",
                    "nvidia.com/gpu.count": str(self.gpus),
                    "nvidia.com/gpu.product": self.gpu_product,
                    "nvidia.com/gpu.memory": str(self.gpu_memory_mib),
                    "nvidia.com/cuda.driver.major": "550",
                }
            )
            capacity[GPU_RESOURCE] = str(self.gpus)
            taints.append(dict(GPU_TAINT))
        labels.update(self.labels)
        node: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": labels,
                "annotations": {NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": {"taints": taints} if taints else {},
            "status": {
                "capacity": capacity,
                "allocatable": dict(capacity),
                "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux"},
            },
        }
        return node


DEFAULT_NODES: tuple[NodeSpec, ...] = (
    NodeSpec("kwok-cpu-0"),
    NodeSpec("kwok-cpu-1"),
    NodeSpec("kwok-gpu-0", cpu="96", memory="1Ti", gpus=8, instance_type="p5.48xlarge"),
    NodeSpec("kwok-gpu-1", cpu="96", memory="1Ti", gpus=8, instance_type="p5.48xlarge"),
)


# --------------------------------------------------------------------------------------------
# processes


@dataclass
class _Proc:
    name: str
    pid: int
    exe: str
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return _pid_runs(self.pid, self.exe)

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])


def _parent_death_signal() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _pid_runs(pid: int, exe: str) -> bool:
    """True if pid is alive, leads its own process group, and runs `exe` (guards pid reuse)."""
    try:
        cmd0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return cmd0 == exe and state != "Z" and os.getpgid(pid) == pid


def _stop_group(
    pid: int, exe: str, popen: subprocess.Popen[bytes] | None, timeout: float = 10.0
) -> None:
    """SIGTERM the process group we started (pgid == pid), then SIGKILL after `timeout`."""
    if popen is not None:
        if popen.poll() is not None:
            return
    elif not _pid_runs(pid, exe):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen is not None:
            if popen.poll() is not None:
                return
        elif not _pid_runs(pid, exe):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    if popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(5)


# --------------------------------------------------------------------------------------------
# the cluster


class LocalCluster:
    """etcd + kube-apiserver + controller-manager + scheduler + KWOK, as local processes.

    Use as a context manager (``with LocalCluster() as c``) or call ``start()``/``stop()``.
    ``stop()`` ends only the processes this object started (each in its own process group).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        nodes: Sequence[NodeSpec] = DEFAULT_NODES,
        ports: Mapping[str, int] | None = None,
        binaries: str | os.PathLike[str] | None = None,
        keep_data: bool = False,
        startup_timeout: float = 120.0,
        extra_args: Mapping[str, Sequence[str]] | None = None,
        die_with_parent: bool = True,
        real_node: bool = False,
        node_images: Sequence[str] = (),
    ) -> None:
        """
        data_dir: where certs, kubeconfigs, etcd data and logs go (default: a new temp dir,
            removed by stop() unless keep_data).
        nodes: the simulated nodes to create.
        ports: fixed ports by component ("etcd", "etcd-peer", "apiserver", "controller-manager",
            "scheduler"); others are picked free. A fixed port that is taken raises PortInUseError.
        binaries: folder of the built binaries (default $RLPACER_BIN_DIR or ~/.cache/rlpacer/bin).
        extra_args: extra command-line flags by component name (same names as ports, or "kwok").
        real_node: also run a real node (containerd, CNI, kube-proxy, kubelet: pods run as
            containers; rlpacer.testing.node), beside the simulated ones.
        node_images: images (podman refs) the real node gets from podman's store.
        """
        self._own_dir = data_dir is None
        self.data_dir = (
            Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="rlpacer-cluster-"))
        )
        self.nodes = tuple(nodes)
        self._fixed_ports = dict(ports or {})
        self._bin_dir = Path(binaries) if binaries else bin_dir()
        self.keep_data = keep_data
        # Components get SIGTERM if this process dies without stop() (e.g. a killed pytest).
        self._die_with_parent = die_with_parent
        self.startup_timeout = startup_timeout
        self._extra = {k: list(v) for k, v in (extra_args or {}).items()}
        self._procs: list[_Proc] = []
        #: Each started component's executable and arguments (to restart it: start_component).
        self._commands: dict[str, tuple[Path, list[str]]] = {}
        self._owns_processes = True
        self.ports: dict[str, int] = {}
        self.server = ""
        self.kubeconfig = self.data_dir / "admin.kubeconfig"
        self.ca_file = self.data_dir / "pki" / "ca.crt"
        self._admin_cert: tuple[Path, Path] | None = None
        self._http: _Http | None = None
        self.startup_seconds: float | None = None
        self._sa_counter = 0
        self.node: Any = None
        self.service_cidr = REAL_NODE_SERVICE_CIDR if real_node else SERVICE_CIDR
        if real_node:
            from rlpacer.testing.node import RealNode

            self.node = RealNode(self, node_images)

    # ---- lifecycle ------------------------------------------------------------------------

    @classmethod
    def attach(cls, kubeconfig: str | os.PathLike[str]) -> LocalCluster:
        """A handle on an already running cluster (e.g. `python -m ... up`); stop() is a no-op."""
        kc_path = Path(kubeconfig).resolve()
        if not kc_path.is_file():
            raise ClusterError(f"kubeconfig {kc_path} (from ${ENV_KUBECONFIG}?) does not exist")
        self = cls(data_dir=Path(tempfile.mkdtemp(prefix="rlpacer-attach-")))
        self._own_dir = True
        self._owns_processes = False
        self.kubeconfig = kc_path
        cfg = yaml.safe_load(kc_path.read_text())
        ctx_name = cfg.get("current-context")
        ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
        cl = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
        self.server = cl["server"]
        pki = self.data_dir / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        self.ca_file = pki / "ca.crt"
        if "certificate-authority-data" in cl:
            self.ca_file.write_bytes(base64.b64decode(cl["certificate-authority-data"]))
        else:
            shutil.copy(cl["certificate-authority"], self.ca_file)
        token = user.get("token")
        if "client-certificate-data" in user:
            (pki / "admin.crt").write_bytes(base64.b64decode(user["client-certificate-data"]))
            (pki / "admin.key").write_bytes(base64.b64decode(user["client-key-data"]))
            self._admin_cert = (pki / "admin.crt", pki / "admin.key")
        elif "client-certificate" in user:
            self._admin_cert = (Path(user["client-certificate"]), Path(user["client-key"]))
        self._http = _Http(self.server, self.ca_file, self._admin_cert, token=token)
        self._http.call("GET", "/readyz", ok=(200,))
        return self

    def __enter__(self) -> LocalCluster:
        if not self.server:
            self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> LocalCluster:
        t0 = time.monotonic()
        self._allocate_ports()
        bins = {name: find_binary(name, self._bin_dir) for name in CONTROL_PLANE_BINARIES}
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start(bins, t0)
        except BaseException:
            self._stop_processes()
            raise
        self.startup_seconds = time.monotonic() - t0
        self._write_state()
        return self

    def stop(self) -> None:
        """Stop the processes this object started (reverse order) and remove its temp dir."""
        if self._owns_processes:
            self._stop_processes()
        if self._own_dir and not self.keep_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def _stop_processes(self) -> None:
        if self.node is not None:
            self.node.before_processes_stop()
        for p in reversed(self._procs):
            _stop_group(p.pid, p.exe, p.popen)
        self._procs.clear()
        if self.node is not None:
            self.node.after_processes_stop()

    def _allocate_ports(self) -> None:
        names = ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler")
        what = {
            "etcd": "etcd clients",
            "etcd-peer": "etcd peers",
            "apiserver": "kube-apiserver",
            "controller-manager": "kube-controller-manager",
            "scheduler": "kube-scheduler",
        }
        for n, p in self._fixed_ports.items():
            if n not in names:
                raise ValueError(f"unknown port name {n!r}; known: {', '.join(names)}")
            check_port_free(p, what[n])
        free = iter(free_ports(len(names)))
        self.ports = {n: self._fixed_ports.get(n) or next(free) for n in names}
        if len(set(self.ports.values())) != len(names):
            raise PortInUseError(f"port clash between components: {self.ports}")

    def _spawn(self, name: str, exe: Path, args: list[str]) -> _Proc:
        logs = self.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{name}.log"
        cmd = [str(exe), *args, *self._extra.get(name, [])]
        self._commands[name] = (exe, list(args))
        (logs / f"{name}.cmd").write_text(" ".join(cmd) + "\n")
        with open(log, "ab") as f:
            popen = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.data_dir,
                start_new_session=True,
                preexec_fn=_parent_death_signal if self._die_with_parent else None,
            )
        p = _Proc(name, popen.pid, str(exe), log, popen)
        self._procs.append(p)
        return p

    def _check_alive(self) -> None:
        for p in self._procs:
            if not p.alive():
                tail = p.log_tail()
                code = p.popen.returncode if p.popen else "?"
                if "address already in use" in tail:
                    raise PortInUseError(
                        f"{p.name} exited (code {code}): a port it needs is already in use "
                        f"(ports: {self.ports}). Log {p.log}:\n{tail}"
                    )
                raise ClusterStartError(
                    f"{p.name} exited during start-up (code {code}). Log {p.log}:\n{tail}"
                )

    def _wait(
        self, what: str, check: Callable[[], T | None], deadline: float, interval: float = 0.2
    ) -> T:
        last: BaseException | None = None
        while True:
            self._check_alive()
            try:
                v = check()
                if v is not None and v is not False:
                    return v
            except (OSError, ClusterError, ValueError, ssl.SSLError) as e:
                last = e
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name} ({p.log}):\n{p.log_tail(15)}" for p in self._procs)
                raise ClusterStartError(
                    f"timed out after {self.startup_timeout:.0f} s waiting for {what}"
                    f"{f' (last error: {last})' if last else ''}\n{logs}"
                )
            time.sleep(interval)

    def _start(self, bins: Mapping[str, Path], t0: float) -> None:
        deadline = t0 + self.startup_timeout
        d = self.data_dir
        ports = self.ports
        clients = {
            "admin": ("rlpacer-admin", "system:masters"),
            "controller-manager": ("system:kube-controller-manager", ""),
            "scheduler": ("system:kube-scheduler", ""),
            "kwok": ("kwok-controller", "system:masters"),
            # The aggregation layer's client (kube-apiserver -> aggregated API servers).
            "front-proxy-client": ("front-proxy-client", ""),
        }
        servers: dict[str, str] = {}
        if self.node is not None:
            from rlpacer.testing import node as real

            clients.update(real.node_cert_clients())
            servers["kubelet-serving"] = f"IP:{real.GATEWAY},IP:127.0.0.1,DNS:{real.NODE_NAME}"
        certs = _make_certs(d / "pki", clients, servers)
        self.ca_file = certs.ca_crt
        self._admin_cert = (certs.crt("admin"), certs.key("admin"))
        self.server = f"https://127.0.0.1:{ports['apiserver']}"
        ca_data = _b64(certs.ca_crt)
        kcs: dict[str, Path] = {}
        for name in clients:
            if name == "front-proxy-client":
                continue
            kcs[name] = write_kubeconfig(
                d / ("admin.kubeconfig" if name == "admin" else f"{name}.kubeconfig"),
                self.server,
                ca_data,
                {
                    "client-certificate-data": _b64(certs.crt(name)),
                    "client-key-data": _b64(certs.key(name)),
                },
            )
        self.kubeconfig = kcs["admin"]
        (d / "kwok.yaml").write_text(stages_yaml())

        if self.node is not None:
            self.node.prepare_host()
        # etcd
        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        peer_url = f"http://127.0.0.1:{ports['etcd-peer']}"
        self._spawn(
            "etcd",
            bins["etcd"],
            [
                "--name=rlpacer",
                f"--data-dir={d / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=rlpacer={peer_url}",
                "--initial-cluster-state=new",
                "--unsafe-no-fsync=true",
                "--auto-compaction-mode=periodic",
                "--auto-compaction-retention=5m",
                "--quota-backend-bytes=4294967296",
                "--log-level=warn",
            ],
        )
        etcd_http = _Http(etcd_url, None)

        def etcd_ok() -> bool:
            status, body = etcd_http.request("GET", "/health", timeout=2)
            return status == 200 and isinstance(body, dict) and body.get("health") == "true"

        self._wait("etcd /health", etcd_ok, deadline)

        # kube-apiserver
        self._spawn(
            "apiserver",
            bins["kube-apiserver"],
            [
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={ports['apiserver']}",
                f"--cert-dir={d / 'apiserver'}",
                f"--tls-cert-file={certs.crt('apiserver')}",
                f"--tls-private-key-file={certs.key('apiserver')}",
                f"--client-ca-file={certs.ca_crt}",
                f"--service-account-issuer={SA_ISSUER}",
                f"--service-account-key-file={certs.sa_pub}",
                f"--service-account-signing-key-file={certs.sa_key}",
                f"--service-cluster-ip-range={self.service_cidr}",
                "--authorization-mode=Node,RBAC",
                f"--requestheader-client-ca-file={certs.ca_crt}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={certs.crt('front-proxy-client')}",
                f"--proxy-client-key-file={certs.key('front-proxy-client')}",
                "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=true",
                # A loopback advertise address cannot be an Endpoints address; nothing routes.
                "--endpoint-reconciler-type=none",
                # RLPACER_CLUSTER_PROFILING=1: /debug/pprof on (to profile the API server
                # under bench-operator: `kubectl get --raw /debug/pprof/profile?seconds=20`)
                f"--profiling={'true' if os.environ.get('RLPACER_CLUSTER_PROFILING') else 'false'}",
                "--max-requests-inflight=800",
                "--max-mutating-requests-inflight=400",
                *([] if self.node is None else real.apiserver_args(d / "pki")),
            ],
        )
        self._http = _Http(self.server, certs.ca_crt, self._admin_cert)
        http = self._http

        def apiserver_ready() -> bool:
            status, _ = http.request("GET", "/readyz", timeout=3)
            return status == 200

        self._wait("kube-apiserver /readyz", apiserver_ready, deadline)

        # controller-manager, scheduler, KWOK
        cm_kc = str(kcs["controller-manager"])
        self._spawn(
            "controller-manager",
            bins["kube-controller-manager"],
            [
                f"--kubeconfig={cm_kc}",
                f"--authentication-kubeconfig={cm_kc}",
                f"--authorization-kubeconfig={cm_kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports['controller-manager']}",
                f"--cert-dir={d / 'controller-manager'}",
                "--controllers=*",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={certs.sa_key}",
                f"--root-ca-file={certs.ca_crt}",
                f"--cluster-signing-cert-file={certs.ca_crt}",
                f"--cluster-signing-key-file={certs.ca_key}",
                f"--service-cluster-ip-range={self.service_cidr}",
                "--cluster-name=rlpacer-local",
                "--kube-api-qps=100",
                "--kube-api-burst=200",
                "--profiling=false",
            ],
        )
        sch_kc = str(kcs["scheduler"])
        self._spawn(
            "scheduler",
            bins["kube-scheduler"],
            [
                f"--kubeconfig={sch_kc}",
                f"--authentication-kubeconfig={sch_kc}",
                f"--authorization-kubeconfig={sch_kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports['scheduler']}",
                f"--cert-dir={d / 'scheduler'}",
                "--leader-elect=false",
                "--profiling=false",
            ],
        )
        self._spawn(
            "kwok",
            bins["kwok"],
            [
                f"--kubeconfig={kcs['kwok']}",
                f"--config={d / 'kwok.yaml'}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={NODE_ANNOTATION}=fake",
                f"--cidr={POD_CIDR}",
                f"--node-ip={NODE_IP}",
                "--node-lease-duration-seconds=40",
            ],
        )

        for n in self.nodes:
            self._create_node(n)

        def nodes_ready() -> bool:
            items = http.call("GET", "/api/v1/nodes")["items"]
            ready = {
                i["metadata"]["name"]
                for i in items
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in i.get("status", {}).get("conditions", [])
                )
            }
            return {n.name for n in self.nodes} <= ready

        self._wait("KWOK to make the simulated nodes Ready", nodes_ready, deadline)
        insecure = {
            name: _Http(f"https://127.0.0.1:{ports[name]}", None, verify=False)
            for name in ("controller-manager", "scheduler")
        }
        for name, h in insecure.items():

            def healthy(h: _Http = h) -> bool:
                return h.request("GET", "/healthz", timeout=2)[0] == 200

            self._wait(f"{name} /healthz", healthy, deadline)

        def default_sa() -> bool:
            return (
                http.request(
                    "GET", "/api/v1/namespaces/default/serviceaccounts/default", timeout=3
                )[0]
                == 200
            )

        self._wait(
            "the controller-manager to create the default ServiceAccount", default_sa, deadline
        )

        def no_node_taints() -> bool:
            # The node lifecycle controller removes node.kubernetes.io/not-ready once Ready.
            items = http.call("GET", "/api/v1/nodes")["items"]
            return not any(
                t.get("key", "").startswith("node.kubernetes.io/")
                for i in items
                for t in i.get("spec", {}).get("taints", []) or []
            )

        self._wait("nodes to lose their not-ready taints", no_node_taints, deadline)
        if self.node is not None:
            self.node.start()

    def _create_node(self, spec: NodeSpec) -> None:
        assert self._http is not None
        m = spec.manifest()
        status, body = self._http.request("POST", "/api/v1/nodes", m)
        if status == 409:
            return
        if status not in (200, 201):
            raise ApiError(status, body, "POST", "/api/v1/nodes")
        # Node status is not reliably kept on create: set capacity through the status subresource.
        self._http.call(
            "PATCH",
            f"/api/v1/nodes/{spec.name}/status",
            {"status": m["status"]},
            content_type="application/strategic-merge-patch+json",
        )

    def _write_state(self) -> None:
        state = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "data_dir": str(self.data_dir),
            "ports": self.ports,
            "processes": [
                {"name": p.name, "pid": p.pid, "exe": p.exe, "log": str(p.log)} for p in self._procs
            ],
            "startup_seconds": self.startup_seconds,
            "real_node": self.node is not None,
        }
        (self.data_dir / "state.json").write_text(json.dumps(state, indent=2) + "\n")

    # ---- faults ---------------------------------------------------------------------------

    def stop_component(self, name: str) -> None:
        """Stop one component this handle started (``etcd``, ``apiserver``, ...) and keep its
        data: an outage that :meth:`start_component` ends."""
        if not self._owns_processes:
            raise ClusterError("stop_component: this handle attached to a cluster it did not"
                               " start")
        proc = next((p for p in self._procs if p.name == name), None)
        if proc is None:
            raise ClusterError(f"stop_component: no running component {name!r}; running:"
                               f" {', '.join(p.name for p in self._procs)}")
        _stop_group(proc.pid, proc.exe, proc.popen)
        self._procs.remove(proc)

    def start_component(self, name: str, timeout: float = 60.0) -> None:
        """Start a component stopped by :meth:`stop_component` again, with the same command
        and data, and wait until it is healthy (etcd ``/health``, the API server ``/readyz``)."""
        if any(p.name == name for p in self._procs):
            raise ClusterError(f"start_component: {name!r} is running")
        if name not in self._commands:
            raise ClusterError(f"start_component: {name!r} was never started here")
        exe, args = self._commands[name]
        self._spawn(name, exe, args)
        deadline = time.monotonic() + timeout
        if name == "etcd":
            h = _Http(f"http://127.0.0.1:{self.ports['etcd']}", None)
            self._wait("etcd /health", lambda: h.request("GET", "/health", timeout=2)[0] == 200,
                       deadline)
        if name in ("etcd", "apiserver"):
            self._wait("kube-apiserver /readyz",
                       lambda: self.http.request("GET", "/readyz", timeout=3)[0] == 200, deadline)
        self._write_state()

    def pids(self) -> dict[str, int]:
        """The component processes this handle runs or attached to, by name (etcd, apiserver,
        controller-manager, scheduler, kwok)."""
        return {p.name: p.pid for p in self._procs}

    # ---- using it -------------------------------------------------------------------------

    @property
    def http(self) -> _Http:
        if self._http is None:
            raise ClusterError("cluster not started")
        return self._http

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = None,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        """A raw API request as admin, or as the bearer of `token` (then no client cert)."""
        h = self.http if token is None else _Http(self.server, self.ca_file, None, token=token)
        return h.request(method, path, body, content_type=content_type)

    def env(self) -> dict[str, str]:
        """Environment for tools and child processes aimed at this cluster."""
        return {"KUBECONFIG": str(self.kubeconfig), ENV_KUBECONFIG: str(self.kubeconfig)}

    def api_client(self, kubeconfig: str | os.PathLike[str] | None = None) -> Any:
        """A kubernetes.client.ApiClient for this cluster (admin unless another kubeconfig)."""
        from kubernetes import config as k8s_config  # deferred: the launcher itself needs no client

        return k8s_config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(kubeconfig or self.kubeconfig)
        )

    def kubectl(
        self,
        *args: str,
        kubeconfig: str | os.PathLike[str] | None = None,
        check: bool = True,
        input: str | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """Run the machine's kubectl against this cluster; check=True raises with its stderr."""
        cmd = [str(find_kubectl()), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        r = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise ClusterError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def helm(
        self,
        *args: str,
        kubeconfig: str | os.PathLike[str] | None = None,
        check: bool = True,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned helm v3 against this cluster (its caches live in the data dir)."""
        exe = find_binary("helm", self._bin_dir)
        home = self.data_dir / "helm"
        env = dict(
            os.environ,
            KUBECONFIG=str(kubeconfig or self.kubeconfig),
            HELM_CONFIG_HOME=str(home / "config"),
            HELM_CACHE_HOME=str(home / "cache"),
            HELM_DATA_HOME=str(home / "data"),
        )
        cmd = [str(exe), *args]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        if check and r.returncode != 0:
            raise ClusterError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def version(self) -> dict[str, Any]:
        """The API server's /version."""
        v: dict[str, Any] = self.http.call("GET", "/version")
        return v

    def create_namespace(
        self, name: str, labels: Mapping[str, str] | None = None, timeout: float = 30
    ) -> None:
        """Create a namespace and wait for its default ServiceAccount (pods need it)."""
        body = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": dict(labels or {})},
        }
        self.http.call("POST", "/api/v1/namespaces", body, ok=(201, 409))
        self.wait_for(
            lambda: (
                self.http.request("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")[0]
                == 200
            ),
            timeout,
            f"default ServiceAccount in namespace {name}",
        )

    def delete_namespace(self, name: str) -> None:
        self.http.call("DELETE", f"/api/v1/namespaces/{name}", ok=(200, 202, 404))

    def create_service_account(self, namespace: str, name: str) -> None:
        body = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}
        self.http.call(
            "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", body, ok=(201, 409)
        )

    def service_account_token(
        self,
        namespace: str,
        name: str,
        *,
        expiration_seconds: int = 3600,
        audiences: Sequence[str] | None = None,
    ) -> str:
        """A token for the ServiceAccount from the TokenRequest API."""
        spec: dict[str, Any] = {"expirationSeconds": expiration_seconds}
        if audiences:
            spec["audiences"] = list(audiences)
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        r = self.http.call(
            "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token", body
        )
        token: str = r["status"]["token"]
        return token

    def kubeconfig_for_service_account(
        self, namespace: str, name: str, *, create: bool = False, expiration_seconds: int = 3600
    ) -> Path:
        """Path of a kubeconfig that authenticates as system:serviceaccount:<namespace>:<name>
        with a TokenRequest token, so its holder has exactly the rights RBAC grants that account.
        create=True creates the ServiceAccount first (and the namespace if needed)."""
        if create:
            self.http.call(
                "POST",
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
                ok=(201, 409),
            )
            self.create_service_account(namespace, name)
        token = self.service_account_token(namespace, name, expiration_seconds=expiration_seconds)
        self._sa_counter += 1
        path = (
            self.data_dir / "kubeconfigs" / f"sa-{namespace}-{name}-{self._sa_counter}.kubeconfig"
        )
        return write_kubeconfig(
            path,
            self.server,
            _b64(self.ca_file),
            {"token": token},
            name=f"{namespace}-{name}",
            namespace=namespace,
        )

    def mark_pod_exit(self, namespace: str, name: str, exit_code: int) -> None:
        """Make a Running KWOK pod end: exit 0 -> Succeeded, else Failed (as a kubelet reports)."""
        patch = {"metadata": {"annotations": {EXIT_ANNOTATION: str(int(exit_code))}}}
        self.http.call(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{name}",
            patch,
            content_type="application/merge-patch+json",
        )

    def wait_for(
        self,
        predicate: Callable[[], T | None],
        timeout: float = 30,
        what: str = "condition",
        interval: float = 0.2,
    ) -> T:
        """Poll predicate until it returns something truthy; TimeoutError names `what`."""
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while True:
            try:
                v = predicate()
                if v:
                    return v
            except (OSError, ClusterError, KeyError, ValueError) as e:
                last = e
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"timed out after {timeout} s waiting for {what}"
                    + (f" (last error: {last})" if last else "")
                )
            time.sleep(interval)

    def logs(self) -> dict[str, Path]:
        """Log file of each component this object started."""
        return {p.name: p.log for p in self._procs}


# --------------------------------------------------------------------------------------------
# command line


def _default_dir() -> Path:
    return cache_dir() / "cluster"


def _load_state(d: Path) -> dict[str, Any] | None:
    p = d / "state.json"
    if not p.is_file():
        return None
    state: dict[str, Any] = json.loads(p.read_text())
    return state


def _running(state: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [p for p in state.get("processes", []) if _pid_runs(int(p["pid"]), str(p["exe"]))]


def _down(d: Path) -> int:
    state = _load_state(d)
    if state is None:
        print(f"no cluster state in {d}")
        return 0
    node = None
    if state.get("real_node"):
        from rlpacer.testing.node import RealNode

        try:
            node = RealNode.detached(LocalCluster.attach(state["kubeconfig"]), d)
            node.before_processes_stop()  # the pods' containers, while the API server runs
        except Exception as e:  # the control plane may be down already: clean up the host anyway
            print(f"warning: stopping the real node's pods: {e}", file=sys.stderr)
    for p in reversed(state.get("processes", [])):
        _stop_group(int(p["pid"]), str(p["exe"]), None)
    if node is not None:
        node.after_processes_stop()
    shutil.rmtree(d, ignore_errors=True)
    print(f"stopped the cluster in {d}")
    return 0


def _env_lines(kubeconfig: str) -> str:
    return f"export KUBECONFIG={kubeconfig}\nexport {ENV_KUBECONFIG}={kubeconfig}\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m rlpacer.testing.cluster",
        description="Local Kubernetes control plane (etcd, apiserver, "
        "controller-manager, scheduler, KWOK) for rlpacer's tests.",
    )
    ap.add_argument("command", choices=["up", "down", "env", "status"])
    ap.add_argument(
        "--dir", type=Path, default=None, help=f"state/data folder (default {_default_dir()})"
    )
    ap.add_argument(
        "--port", type=int, default=None, help="kube-apiserver port (default: a free one)"
    )
    ap.add_argument(
        "--foreground", action="store_true", help="up: stay attached; Ctrl-C stops the cluster"
    )
    ap.add_argument(
        "--real-node", action="store_true",
        help="up: also run a real node (containerd, kube-proxy, kubelet; pods run as containers)"
        " with the project's images",
    )
    a = ap.parse_args(argv)
    d: Path = a.dir or _default_dir()

    if a.command == "down":
        return _down(d)
    state = _load_state(d)
    if a.command in ("env", "status"):
        if state is None or not _running(state):
            print(
                f"no running cluster in {d} (start one: python -m rlpacer.testing.cluster up)",
                file=sys.stderr,
            )
            return 1
        if a.command == "env":
            sys.stdout.write(_env_lines(state["kubeconfig"]))
        else:
            alive = {p["name"] for p in _running(state)}
            for p in state["processes"]:
                print(
                    f"{p['name']:20s} pid {p['pid']:>7}  "
                    f"{'running' if p['name'] in alive else 'STOPPED'}  log {p['log']}"
                )
            print(f"server {state['server']}  kubeconfig {state['kubeconfig']}")
        return 0

    # up
    if state is not None:
        if _running(state):
            print(
                f"a cluster is already running in {d}: "
                "`python -m rlpacer.testing.cluster down` first",
                file=sys.stderr,
            )
            return 1
        shutil.rmtree(d, ignore_errors=True)
    c = LocalCluster(
        d,
        ports={"apiserver": a.port} if a.port else None,
        keep_data=True,
        die_with_parent=a.foreground,
        real_node=a.real_node,
        node_images=_project_images() if a.real_node else (),
    )
    try:
        c.start()
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"# cluster up in {c.startup_seconds:.1f} s: {c.server}; logs in {d / 'logs'}",
        file=sys.stderr,
    )
    sys.stdout.write(_env_lines(str(c.kubeconfig)))
    sys.stdout.flush()
    if a.foreground:
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
        finally:
            c.stop()
            shutil.rmtree(d, ignore_errors=True)
    return 0


def _project_images() -> tuple[str, ...]:
    """The images scripts/build-images.sh builds (the chart's and the spec's defaults)."""
    from rlpacer.testing.containers import project_images

    return tuple(project_images().values())


@contextlib.contextmanager
def running_cluster(**kwargs: Any) -> Iterator[LocalCluster]:
    """`LocalCluster.attach($RLPACER_KUBECONFIG)` if that is set, else a fresh LocalCluster."""
    kc = os.environ.get(ENV_KUBECONFIG)
    if kc:
        c = LocalCluster.attach(kc)
        try:
            yield c
        finally:
            c.stop()
        return
    with LocalCluster(**kwargs) as c:
        yield c


if __name__ == "__main__":
    sys.exit(main())
