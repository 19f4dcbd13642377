"""Pods and the processes that play them: the kubelet's part in end-to-end tests.

KWOK pods run no containers. :class:`PodHarness` watches a namespace's pods and, for each
Running pod whose role it plays, starts the pod's container command as a local process with
the env and files the pod spec carries; when the process exits it marks the KWOK pod
Succeeded or Failed with the exit code (``LocalCluster.mark_pod_exit``), so the operator sees
what a kubelet would report. A pod that is deleted while its process runs has the process
terminated (SIGTERM, then SIGKILL after the grace period), as a kubelet would.

The translation from pod spec to process is one pure function, :func:`local_command`
(DESIGN.md "Pods and the processes that play them"); every rule is explicit there:

* **Command.** The container's ``command`` + ``args``; a leading ``python``/``python3`` is
  this interpreter (the image's Python is the venv's). The image itself is not used, and a
  container without ``command`` is an error (its entrypoint is unknown here). Exactly one
  container; init containers and sidecars are errors.
* **Volumes.** A ``configMap`` or ``secret`` volume becomes a folder holding its keys (or its
  ``items``); a ``projected`` one (the ServiceAccount's ``kube-api-access``) a folder with its
  ConfigMap/Secret keys, downward-API fields and a real ServiceAccount token; an
  ``emptyDir`` (``medium: Memory`` too: the builders' ``/dev/shm``) a folder of the pod, emptied
  whenever a new pod is played (a pod that comes back under the same name, as a replaced driver
  or StatefulSet pod does, finds nothing its predecessor wrote: a kubelet never carries an
  emptyDir over to another pod; the process of the pod it replaces is stopped first); a
  ``persistentVolumeClaim`` a folder of the claim shared by every pod that mounts it (it
  outlives pods, as a volume does); a pod that mounts claims where model and data sources
  are read (``rlpacer.api.sources.CLAIMS_DIR``) gets ``RLPACER_CLAIMS_DIR`` pointing at the
  namespace's claim folders, since a ``pvc://`` source is named in the job's spec file, which
  no rewriting reaches. Every
  ``mountPath`` (with ``subPath``) maps to that folder; env values and args that name a path
  under a mount are rewritten to the local folder. Other volume kinds are errors.
* **Security settings.** ``securityContext`` and ``automountServiceAccountToken`` are not
  played: the process runs as the test's user, on the real root filesystem, and a Secret's
  ``defaultMode`` is not applied. The builders' writable mounts (``/tmp``, ``HOME``, ``/dev/shm``)
  are folders of the pod like any emptyDir, so ``HOME`` and ``XDG_CACHE_HOME`` point into it.
* **Env.** ``value``, ``valueFrom`` (``fieldRef``: name, namespace, uid, labels, annotations,
  node and service-account names, pod/host IPs as ``127.0.0.1``; ``configMapKeyRef``;
  ``secretKeyRef``), ``envFrom``, and ``$(VAR)`` references, resolved as a kubelet does.
* **Addresses.** Services do not route on this machine: every in-cluster Service host
  (``<svc>.<ns>.svc``, with or without ``.cluster.local``) in an env value or argument becomes
  ``127.0.0.1`` with the same port, or what ``services`` maps ``"<svc>.<ns>"`` (or
  ``"<svc>.<ns>:<port>"``) to. The operator runs as a local process listening on the port its
  Service exposes, so the step-report URL the operator gives its pods reaches it unchanged but
  for the host.
* **Played hosts.** With ``hosts`` (:class:`rlpacer.testing.netns.TestHosts`) every played
  pod runs on a host of its own, named after the pod: its own network namespace and address
  (``status.podIP``), hostname and PID namespace, and home folder. Service names are then
  not rewritten: each Service of the namespace resolves in every host to the played pods its
  selector picks (a ClusterIP Service to one of them, a headless one per pod as
  ``<pod>.<svc>.<ns>.svc``), and ``names`` (e.g. the operator's Service, served from the root
  namespace at the hosts' gateway) to the given addresses, as cluster DNS would. A pod that
  is deleted takes its host with it; a pod that comes back gets a fresh one.
* **Roles not played.** Only pods whose role label (:data:`rlpacer.api.contract.LABEL_ROLE`)
  is in ``roles`` get a process; by default that is the driver alone. The driver's engines are
  in-process Ray actors (``RAY_ADDRESS`` is dropped, so ``ray.init`` starts Ray locally), so
  the Ray head, learner and rollout pods are played by nothing: they only need to be Running
  (and Ready) in KWOK, which is what the operator's rollout scaler reads. Playing the head too
  (``roles`` with ``head``) keeps ``RAY_ADDRESS``, rewritten to loopback, and the driver then
  joins that head.

The harness acts as a kubelet, so it reads ConfigMaps and Secrets with the cluster's admin
credentials; the operator under test keeps its own (the chart's ServiceAccount).
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlpacer.api import contract, sources
from rlpacer.testing.cluster import ApiError

if TYPE_CHECKING:
    from rlpacer.testing.cluster import LocalCluster
    from rlpacer.testing.netns import TestHosts

__all__ = [
    "DEFAULT_ROLES",
    "HarnessError",
    "LocalCommand",
    "ObjectLookup",
    "PlayedPod",
    "PodHarness",
    "local_command",
]

Obj = dict[str, Any]

#: Roles whose pods get a local process by default (see the module docstring).
DEFAULT_ROLES: frozenset[str] = frozenset({contract.Role.DRIVER.value})
#: Env the harness's own environment must not leak into a played pod.
_HOST_ENV_PREFIXES = ("RLPACER_", "KUBECONFIG", "RAY_")
_SVC_HOST = re.compile(
    r"(?P<svc>[a-z0-9]([-a-z0-9]*[a-z0-9])?)\.(?P<ns>[a-z0-9]([-a-z0-9]*[a-z0-9])?)"
    r"\.svc(\.cluster\.local)?(?::(?P<port>\d+))?(?![-a-z0-9.])"
)
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")
_FIELD_LABEL = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


class HarnessError(RuntimeError):
    """A pod spec the harness cannot play (the message names the field)."""


class ObjectLookup(Protocol):
    """What :func:`local_command` reads from the API: the data of ConfigMaps and Secrets."""

    def config_map(self, namespace: str, name: str) -> Mapping[str, bytes] | None: ...

    def secret(self, namespace: str, name: str) -> Mapping[str, bytes] | None: ...

    def service_account_token(
        self, namespace: str, name: str, audience: str | None, expiration_seconds: int
    ) -> str: ...


@dataclass(frozen=True)
class LocalCommand:
    """How to play one pod: run ``argv`` in ``cwd`` with ``env`` (added to a clean base
    environment) after writing ``files`` and creating ``dirs``."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    files: dict[Path, bytes]
    dirs: list[Path]
    #: mountPath -> local folder (what stands in for each volume mount).
    mounts: dict[str, Path]
    #: The folders standing in for the pod's emptyDir volumes: emptied before it is played.
    empty_dirs: list[Path] = field(default_factory=list)


def pod_dir(root: Path, namespace: str, name: str) -> Path:
    """The folder of one pod under the harness root (its volumes, work dir, log)."""
    return root / namespace / "pods" / name


def claim_dir(root: Path, namespace: str, claim: str) -> Path:
    """The folder standing in for a PersistentVolumeClaim (shared by the pods mounting it)."""
    return root / namespace / "pvc" / claim


def rewrite_addresses(text: str, services: Mapping[str, str] | None = None) -> str:
    """Replace in-cluster Service hosts with loopback (or ``services``' mapping)."""
    services = services or {}

    def sub(m: re.Match[str]) -> str:
        key = f"{m['svc']}.{m['ns']}"
        port = m["port"]
        target = services.get(f"{key}:{port}") if port else None
        if target is not None:
            return target
        host = services.get(key, "127.0.0.1")
        return f"{host}:{port}" if port and ":" not in host else host

    return _SVC_HOST.sub(sub, text)


def _rewrite_paths(text: str, mounts: Mapping[str, Path]) -> str:
    # The longest mount path first, so /a/b wins over /a.
    for mount in sorted(mounts, key=len, reverse=True):
        if text == mount:
            return str(mounts[mount])
        if text.startswith(mount.rstrip("/") + "/"):
            return str(mounts[mount]) + text[len(mount.rstrip("/")):]
    return text


def _expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined names are replaced, ``$$`` escapes."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR_REF.sub(sub, value)


def _field_ref(pod: Obj, path: str, pod_ip: str = "127.0.0.1") -> str:
    meta = pod.get("metadata", {})
    spec = pod.get("spec", {})
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": pod_ip,
        "status.hostIP": pod_ip,
        "status.podIPs": pod_ip,
    }
    if path in simple:
        return str(simple[path] or "")
    m = _FIELD_LABEL.fullmatch(path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    raise HarnessError(f"env valueFrom.fieldRef.fieldPath {path!r} is not supported")


def _key_ref(
    kind: str, ref: Obj, namespace: str, lookup: ObjectLookup, what: str
) -> str | None:
    data = (lookup.config_map if kind == "configMap" else lookup.secret)(namespace, ref["name"])
    optional = bool(ref.get("optional"))
    if data is None or ref["key"] not in data:
        if optional:
            return None
        raise HarnessError(f"{what}: {kind} {namespace}/{ref['name']} key {ref['key']!r} missing")
    return data[ref["key"]].decode()


def _volume_files(
    vol: Obj, folder: Path, namespace: str, lookup: ObjectLookup
) -> dict[Path, bytes]:
    if "configMap" in vol:
        src, kind, name = vol["configMap"], "configMap", vol["configMap"].get("name", "")
        data = lookup.config_map(namespace, name)
    else:
        src, kind, name = vol["secret"], "secret", vol["secret"].get("secretName", "")
        data = lookup.secret(namespace, name)
    if data is None:
        if src.get("optional"):
            return {}
        raise HarnessError(f"volume {vol['name']}: {kind} {namespace}/{name} not found")
    items = src.get("items")
    if not items:
        return {folder / k: v for k, v in data.items()}
    out = {}
    for it in items:
        if it["key"] not in data:
            raise HarnessError(f"volume {vol['name']}: {kind} {name} has no key {it['key']!r}")
        out[folder / it["path"]] = data[it["key"]]
    return out


def _projected_files(pod: Obj, vol: Obj, folder: Path, lookup: ObjectLookup) -> dict[Path, bytes]:
    """A projected volume (e.g. the kube-api-access volume the ServiceAccount admission adds):
    ConfigMaps, Secrets, downward API items and a ServiceAccount token, in one folder."""
    ns = pod["metadata"].get("namespace", "default")
    out: dict[Path, bytes] = {}
    for src in vol["projected"].get("sources") or []:
        if "configMap" in src or "secret" in src:
            kind = "configMap" if "configMap" in src else "secret"
            inner = dict(src[kind])
            if kind == "secret":
                inner["secretName"] = inner.pop("name", "")
            out.update(_volume_files({"name": vol["name"], kind: inner}, folder, ns, lookup))
        elif "downwardAPI" in src:
            for it in src["downwardAPI"].get("items") or []:
                if "fieldRef" not in it:
                    raise HarnessError(f"volume {vol['name']}: downwardAPI {it} not supported")
                out[folder / it["path"]] = _field_ref(pod, it["fieldRef"]["fieldPath"]).encode()
        elif "serviceAccountToken" in src:
            sat = src["serviceAccountToken"]
            sa = pod.get("spec", {}).get("serviceAccountName") or "default"
            token = lookup.service_account_token(ns, sa, sat.get("audience"),
                                                 int(sat.get("expirationSeconds", 3600)))
            out[folder / sat["path"]] = token.encode()
        else:
            raise HarnessError(f"volume {vol['name']}: projected source {sorted(src)} "
                               "not supported")
    return out


def local_command(
    pod: Obj,
    lookup: ObjectLookup,
    *,
    root: Path,
    python: str = sys.executable,
    services: Mapping[str, str] | None = None,
    drop_env: Iterable[str] = (),
    pod_ip: str | None = None,
) -> LocalCommand:
    """The local process that plays ``pod`` (pure but for ``lookup``; see the module docstring).

    ``root`` holds the pods' folders (:func:`pod_dir`) and the claims' (:func:`claim_dir`);
    ``drop_env`` names env variables the process must not get (e.g. ``RAY_ADDRESS`` when the
    Ray head is not played). With ``pod_ip`` (the pod plays on a host of its own, see
    :class:`PodHarness`' ``hosts``) Service names are kept as they are, for the host's
    resolver, and the downward API's ``status.podIP`` is that address.
    """
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    ns, name = meta.get("namespace", "default"), meta.get("name", "")
    if spec.get("initContainers"):
        raise HarnessError(f"pod {ns}/{name}: spec.initContainers are not supported")
    containers = spec.get("containers") or []
    if len(containers) != 1:
        raise HarnessError(f"pod {ns}/{name}: expected one container, got {len(containers)}")
    (c,) = containers
    if not c.get("command"):
        raise HarnessError(
            f"pod {ns}/{name}: container {c.get('name')!r} has no command (the image's"
            " entrypoint is unknown here)"
        )
    home = pod_dir(root, ns, name)

    # volumes -> folders
    vol_dirs: dict[str, Path] = {}
    files: dict[Path, bytes] = {}
    dirs: list[Path] = []
    empty_dirs: list[Path] = []
    for vol in spec.get("volumes") or []:
        vname = vol["name"]
        if "configMap" in vol or "secret" in vol:
            folder = home / "volumes" / vname
            files.update(_volume_files(vol, folder, ns, lookup))
        elif "projected" in vol:
            folder = home / "volumes" / vname
            files.update(_projected_files(pod, vol, folder, lookup))
        elif "emptyDir" in vol:
            folder = home / "volumes" / vname
            empty_dirs.append(folder)
        elif "persistentVolumeClaim" in vol:
            folder = claim_dir(root, ns, vol["persistentVolumeClaim"]["claimName"])
        else:
            kinds = sorted(set(vol) - {"name"})
            raise HarnessError(f"pod {ns}/{name}: volume {vname} of kind {kinds} not supported")
        vol_dirs[vname] = folder
        dirs.append(folder)
    mounts: dict[str, Path] = {}
    for m in c.get("volumeMounts") or []:
        if m["name"] not in vol_dirs:
            raise HarnessError(f"pod {ns}/{name}: volumeMount {m['name']} has no volume")
        folder = vol_dirs[m["name"]]
        if m.get("subPath"):
            folder = folder / m["subPath"]
            dirs.append(folder)
        mounts[m["mountPath"].rstrip("/") or "/"] = folder

    # env, in the kubelet's order: envFrom, then env (later wins), $(VAR) against earlier ones
    env: dict[str, str] = {}
    for src in c.get("envFrom") or []:
        prefix = src.get("prefix", "")
        ref = src.get("configMapRef") or src.get("secretRef") or {}
        kind = "configMap" if "configMapRef" in src else "secret"
        data = (lookup.config_map if kind == "configMap" else lookup.secret)(ns, ref["name"])
        if data is None:
            if ref.get("optional"):
                continue
            raise HarnessError(f"pod {ns}/{name}: envFrom {kind} {ref['name']} not found")
        env.update({prefix + k: v.decode() for k, v in data.items()})
    for e in c.get("env") or []:
        what = f"pod {ns}/{name} env {e['name']}"
        if "valueFrom" in e:
            vf = e["valueFrom"]
            if "fieldRef" in vf:
                value: str | None = _field_ref(pod, vf["fieldRef"]["fieldPath"],
                                               pod_ip or "127.0.0.1")
            elif "configMapKeyRef" in vf:
                value = _key_ref("configMap", vf["configMapKeyRef"], ns, lookup, what)
            elif "secretKeyRef" in vf:
                value = _key_ref("secret", vf["secretKeyRef"], ns, lookup, what)
            else:
                raise HarnessError(f"{what}: valueFrom {sorted(vf)} not supported")
            if value is None:
                continue
        else:
            value = _expand(str(e.get("value", "")), env)
        env[e["name"]] = value
    for k in drop_env:
        env.pop(k, None)
    def addresses(text: str) -> str:
        return text if pod_ip else rewrite_addresses(text, services)

    env = {k: addresses(_rewrite_paths(v, mounts)) for k, v in env.items()}
    # A model or data source pvc://CLAIM/PATH is named in the job's spec (a file the trainer
    # reads), not in an env value, so no rewriting reaches it: the trainer's documented
    # override of the claims' root points at this namespace's claim folders instead.
    claims = sources.CLAIMS_DIR.rstrip("/") + "/"
    if any(mp.startswith(claims) for mp in mounts):
        env[sources.ENV_CLAIMS_DIR] = str(claim_dir(root, ns, "-").parent)

    argv = [*c["command"], *(c.get("args") or [])]
    argv = [addresses(_rewrite_paths(_expand(a, env), mounts)) for a in argv]
    if Path(argv[0]).name in ("python", "python3"):
        argv[0] = python
    cwd = home / "work"
    dirs.append(cwd)
    return LocalCommand(argv=argv, env=env, cwd=cwd, files=files, dirs=dirs, mounts=mounts,
                        empty_dirs=empty_dirs)


# --- the watcher -----------------------------------------------------------------------------


@dataclass
class PlayedPod:
    """One pod the harness played: its command, process and outcome."""

    namespace: str
    name: str
    uid: str
    role: str
    command: LocalCommand
    log: Path
    proc: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)
    exit_code: int | None = None
    #: Reported to the API (the pod was marked Succeeded/Failed).
    marked: bool = False
    #: The pod was deleted while its process ran (the harness killed it).
    killed: bool = False
    #: The played host it runs on (PodHarness with ``hosts``), while the pod exists.
    host: str | None = None
    #: Its address on that host (its ``status.podIP``); kept after the host is gone.
    address: str | None = None

    def mount(self, mount_path: str) -> Path:
        """The local folder standing in for ``mount_path`` (e.g. the checkpoint volume)."""
        return self.command.mounts[mount_path.rstrip("/")]

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class ApiLookup:
    """ConfigMaps, Secrets and ServiceAccount tokens read from the API server (as a kubelet
    does, with the cluster's admin credentials)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster

    def _get(self, plural: str, namespace: str, name: str) -> Obj | None:
        path = f"/api/v1/namespaces/{namespace}/{plural}/{name}"
        status, body = self.cluster.request("GET", path)
        if status == 404:
            return None
        if status != 200:
            raise HarnessError(f"GET {plural} {namespace}/{name}: HTTP {status}: {body}")
        return body  # type: ignore[no-any-return]

    def config_map(self, namespace: str, name: str) -> Mapping[str, bytes] | None:
        obj = self._get("configmaps", namespace, name)
        if obj is None:
            return None
        out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return out

    def service_account_token(
        self, namespace: str, name: str, audience: str | None, expiration_seconds: int
    ) -> str:
        return self.cluster.service_account_token(
            namespace, name, expiration_seconds=max(600, expiration_seconds),
            audiences=[audience] if audience else None)

    def secret(self, namespace: str, name: str) -> Mapping[str, bytes] | None:
        obj = self._get("secrets", namespace, name)
        if obj is None:
            return None
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}


def _main_pid(pod: PlayedPod) -> int:
    """The container's main process: on a played host the process ``unshare`` forked (PID 1
    of the pod's PID namespace), else the process itself."""
    if pod.host is None:
        return pod.proc.pid
    for _ in range(100):  # unshare forks it right after starting
        with contextlib.suppress(OSError, ValueError):
            children = Path(f"/proc/{pod.proc.pid}/task/{pod.proc.pid}/children").read_text()
            if children.split():
                return int(children.split()[0])
        time.sleep(0.05)
    raise HarnessError(f"pod {pod.name}: no main process under {pod.proc.pid}")


def _exit_code(returncode: int) -> int:
    # A container killed by signal N exits 128+N, as a container runtime reports it.
    return 128 - returncode if returncode < 0 else returncode


class PodHarness:
    """Plays the pods of ``namespace`` (optionally only those matching ``label_selector``)
    whose role is in ``roles``; see the module docstring. Use as a context manager, or call
    :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        cluster: LocalCluster,
        namespace: str,
        root: Path,
        *,
        roles: Iterable[str] = DEFAULT_ROLES,
        label_selector: str | None = None,
        services: Mapping[str, str] | None = None,
        extra_env: Mapping[str, str] | None = None,
        poll_seconds: float = 0.5,
        grace_seconds: float = 20.0,
        hosts: TestHosts | None = None,
        names: Mapping[str, str] | None = None,
    ) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.root = Path(root)
        self.roles = frozenset(str(r) for r in roles)
        self.label_selector = label_selector or contract.LABEL_ROLE
        self.services = dict(services or {})
        self.extra_env = dict(extra_env or {})
        self.poll_seconds = poll_seconds
        self.grace_seconds = grace_seconds
        self.hosts = hosts
        self.names = dict(names or {})
        self.pods: dict[str, PlayedPod] = {}  # uid -> played pod
        self.errors: list[str] = []
        self._lookup = ApiLookup(cluster)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._host_uid: dict[str, str] = {}  # host -> uid of the pod it plays now

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> PodHarness:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> PodHarness:
        self._thread = threading.Thread(target=self._run, name="pod-harness", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching and end every process still running (SIGTERM, then SIGKILL)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            self._terminate_all(list(self.pods.values()))
        if self.hosts is not None:
            shutil.rmtree(Path("/tmp") / self.hosts.tag, ignore_errors=True)

    # -- queries --------------------------------------------------------------------------

    def played(self, name: str) -> list[PlayedPod]:
        """Every play of pods named ``name`` (a name may come back with a new uid)."""
        with self._lock:
            return [p for p in self.pods.values() if p.name == name]

    def by_role(self, role: str) -> list[PlayedPod]:
        with self._lock:
            return sorted((p for p in self.pods.values() if p.role == role),
                          key=lambda p: p.started)

    def pause(self, pod: PlayedPod) -> None:
        """Freeze a played process (SIGSTOP), e.g. to hold a trainer still while the operator
        restarts. :meth:`resume` continues it."""
        if pod.proc.poll() is None:
            pid = _main_pid(pod)
            os.kill(pid, signal.SIGSTOP)
            for _ in range(50):  # stopped ("T") before this returns
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] \
                            in ("T", "t"):
                        return
                time.sleep(0.02)
            raise HarnessError(f"pod {pod.name}: process {pid} did not stop")

    def resume(self, pod: PlayedPod) -> None:
        if pod.proc.poll() is None:
            os.kill(_main_pid(pod), signal.SIGCONT)

    def crash(self, pod: PlayedPod) -> None:
        """The pod's container dies: every process of it killed at once (SIGKILL), as an OOM
        kill or a lost GPU would end it. The harness then reports the pod Failed (exit 137),
        and its controller (a StatefulSet) replaces it, as on a cluster."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pod.proc.pid, signal.SIGKILL)
        pod.proc.wait(10)

    def describe(self) -> str:
        """Every played pod with its command and log tail (for assertion messages)."""
        with self._lock:
            pods = list(self.pods.values())
        parts = [f"harness errors: {self.errors}"] if self.errors else []
        for p in pods:
            parts.append(
                f"--- {p.namespace}/{p.name} ({p.role}) exit={p.exit_code} killed={p.killed}\n"
                f"$ {shlex.join(p.command.argv)}\n{p.log_tail()}"
            )
        return "\n".join(parts)

    # -- the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as err:  # keep watching; the test sees .errors
                self.errors.append(f"{type(err).__name__}: {err}")
            self._stop.wait(self.poll_seconds)

    def sync(self) -> None:
        """One pass: start processes for new Running pods, report exits, kill for deletions."""
        from urllib.parse import quote

        path = (f"/api/v1/namespaces/{self.namespace}/pods"
                f"?labelSelector={quote(self.label_selector)}")
        status, body = self.cluster.request("GET", path)
        if status != 200:
            raise HarnessError(f"GET {path}: HTTP {status}: {body}")
        live = {p["metadata"]["uid"]: p for p in body.get("items", [])}
        with self._lock:
            if self.hosts is not None:
                self._resolve_services(live)
            # every deleted pod's process at once (each may take its grace period), as a
            # kubelet stops the pods it is told to; before any new pod starts, so that one
            # replacing a pod of its name never shares a folder with its predecessor's process
            doomed = [p for uid, p in self.pods.items()
                      if (uid not in live or live[uid]["metadata"].get("deletionTimestamp"))
                      and p.exit_code is None and p.proc.poll() is None]
            for p in doomed:
                p.killed = True
            self._terminate_all(doomed)
            launched = False
            for uid, pod in live.items():
                role = pod["metadata"].get("labels", {}).get(contract.LABEL_ROLE, "")
                if (uid in self.pods or role not in self.roles
                        or pod.get("status", {}).get("phase") != "Running"
                        or pod["metadata"].get("deletionTimestamp")):
                    continue
                self.pods[uid] = self._launch(pod, role)
                launched = True
            if launched and self.hosts is not None:
                self._resolve_services(live)  # the new pods' names, before they look them up
            for uid, p in self.pods.items():
                gone = uid not in live or bool(live[uid]["metadata"].get("deletionTimestamp"))
                if gone and self.hosts is not None and p.host is not None:
                    if self.hosts.hosts.get(p.host) is not None and p.uid == self._host_uid.get(
                            p.host):
                        self.hosts.remove(p.host)  # the pod and its address are gone
                        self._host_uid.pop(p.host, None)
                    p.host = None
                rc = p.proc.poll()
                if rc is not None and p.exit_code is None:
                    p.exit_code = _exit_code(rc)
                    # A container's processes end with its main process (Ray's daemons too).
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(p.proc.pid, signal.SIGKILL)
                if p.exit_code is not None and not p.marked and not gone:
                    try:
                        self.cluster.mark_pod_exit(p.namespace, p.name, p.exit_code)
                    except ApiError as err:
                        if err.status != 404:  # 404: deleted meanwhile
                            raise
                    p.marked = True

    def _launch(self, pod: Obj, role: str) -> PlayedPod:
        drop = () if contract.Role.HEAD.value in self.roles else (contract.ENV_RAY_ADDRESS,)
        pod_ip = self._host_for(pod) if self.hosts is not None else None
        cmd = local_command(pod, self._lookup, root=self.root, services=self.services,
                            drop_env=drop, pod_ip=pod_ip)
        for d in cmd.empty_dirs:  # a new pod's emptyDirs are empty, whatever its name
            shutil.rmtree(d, ignore_errors=True)
        for d in cmd.dirs:
            d.mkdir(parents=True, exist_ok=True)
        for path, data in cmd.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        meta = pod["metadata"]
        log = pod_dir(self.root, meta["namespace"], meta["name"]) / "log.txt"
        base = {k: v for k, v in os.environ.items() if not k.startswith(_HOST_ENV_PREFIXES)}
        env = {**base, "PYTHONUNBUFFERED": "1", **self.extra_env, **cmd.env}
        if self.hosts is not None:
            # a home of its own, as a container has: nothing shared through ~ (Ray's token),
            # not even with the pod of its name it replaces (a new container's filesystem)
            home = pod_dir(self.root, meta["namespace"], meta["name"]) / "home"
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir(parents=True)
            env["HOME"] = str(home)
            # and a /tmp of its own (Ray's sockets and session folders live there); short,
            # since unix socket paths are limited to 108 characters
            tmp = Path("/tmp") / self.hosts.tag / meta["name"]
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            env["TMPDIR"] = env["RAY_TMPDIR"] = str(tmp)
            # Ray hands a joining node the head's temp dir unless it names its own: on one
            # filesystem every played node must (a real pod's /tmp is its own anyway)
            env.setdefault(contract.ENV_RAY_TEMP_DIR, str(tmp / "ray"))
            with log.open("ab") as out:
                proc = self.hosts.popen(meta["name"], cmd.argv, env=env, cwd=cmd.cwd,
                                        stdout=out, stderr=subprocess.STDOUT)
            return PlayedPod(meta["namespace"], meta["name"], meta["uid"], role, cmd, log,
                             proc, host=meta["name"],
                             address=self.hosts.address(meta["name"]))
        with log.open("ab") as out:
            proc = subprocess.Popen(cmd.argv, cwd=cmd.cwd, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return PlayedPod(meta["namespace"], meta["name"], meta["uid"], role, cmd, log, proc)

    # -- played hosts ---------------------------------------------------------------------

    def _host_for(self, pod: Obj) -> str:
        """A host for ``pod`` named after it (a pod that comes back gets a fresh one)."""
        assert self.hosts is not None
        name = pod["metadata"]["name"]
        if name in self.hosts.hosts:
            self.hosts.remove(name)
        self.hosts.add(name)
        self._host_uid[name] = pod["metadata"]["uid"]
        return self.hosts.address(name)

    def _resolve_services(self, live: Mapping[str, Obj]) -> None:
        """Each Service of the namespace resolves, in every host, to the played pods its
        selector picks (a ClusterIP Service to one of them, a headless one per pod as
        ``<pod>.<svc>.<ns>.svc``), and ``names`` to their addresses, as cluster DNS would."""
        assert self.hosts is not None
        status, body = self.cluster.request(
            "GET", f"/api/v1/namespaces/{self.namespace}/services")
        if status != 200:
            raise HarnessError(f"GET services in {self.namespace}: HTTP {status}: {body}")
        names = dict(self.names)
        played = [(p, self.hosts.hosts[p.host].address) for p in self.pods.values()
                  if p.host is not None and p.host in self.hosts.hosts and p.uid in live]
        for svc in body.get("items", []):
            sel = svc.get("spec", {}).get("selector") or {}
            if not sel:
                continue
            base = f"{svc['metadata']['name']}.{self.namespace}.svc"
            for p, address in played:
                labels = live[p.uid]["metadata"].get("labels", {})
                if any(labels.get(k) != v for k, v in sel.items()):
                    continue
                if svc["spec"].get("clusterIP") == "None":  # headless: the pods by name too
                    for n in (f"{p.name}.{base}", f"{p.name}.{base}.cluster.local"):
                        names[n] = address
                # the Service's own name: one of its pods (a headless Service's name lists
                # them all in cluster DNS; one is what a single-backend Service needs)
                names.setdefault(base, address)
                names.setdefault(f"{base}.cluster.local", address)
        self.hosts.map_names(names)

    def _terminate_all(self, pods: list[PlayedPod]) -> None:
        """SIGTERM to every pod's processes, then SIGKILL to those still running after the
        grace period (one grace period for all of them, not one each)."""
        running = [p for p in pods if p.proc.poll() is None]
        for p in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.proc.pid, signal.SIGCONT)  # a paused process must see its SIGTERM
                os.killpg(p.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        for p in running:
            try:
                p.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait(10)
