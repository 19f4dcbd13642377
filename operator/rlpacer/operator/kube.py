"""A small asyncio Kubernetes client (aiohttp) for the operator's own writes.

Kopf watches and dispatches; the writes the operator makes itself (server-side apply of
children, status replaced under a resourceVersion precondition, Events, the Lease) go through
this client so that they run in the same event loop as Kopf and the step-report endpoint,
without threads. Credentials come from one place (:class:`Credentials`): a kubeconfig file
or the in-cluster service account; Kopf is given the same ones (``kopf.on.login``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pydantic_core

from rlpacer.operator import kubeconfig

Obj = dict[str, Any]

#: ``Accept`` for metadata-only lists and watches (PartialObjectMetadata[List], what
#: controller-runtime's metadata informers use): the API server sends no spec or status.
METADATA_ONLY_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
#: An apply patch is YAML (``application/apply-patch+yaml``).
APPLY_PATCH = "application/apply-patch+yaml"

#: Characters a YAML stream may not carry as themselves: not printable to YAML (DEL, the C1
#: controls, the byte-order mark, U+FFFE/U+FFFF) or line breaks to it (U+0085, U+2028,
#: U+2029: folded inside a quoted scalar). Surrogates never reach a str read from the API.
_YAML_UNPRINTABLE = re.compile("[\x7f-\x9f\u2028\u2029\ufeff\ufffe\uffff]")


def yaml_json(body: Any) -> str:
    """``body`` as JSON that the API server's YAML decoder reads back exactly (an apply patch
    is YAML). Plain ``json.dumps`` writes a character past U+FFFF as a surrogate-pair escape
    (``"\\ud83d\\ude00"``), which JSON allows and YAML refuses ("found invalid Unicode
    character escape code"): a job whose spec held one (model source, nodeSelector value, ...)
    could never have its children applied. So non-ASCII characters go as themselves (UTF-8),
    and only those YAML does not allow raw are escaped (all of them in the BMP)."""
    text = json.dumps(body, ensure_ascii=False)
    return _YAML_UNPRINTABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _loads(raw: bytes) -> Any:
    """A JSON document from the API server (pydantic-core's parser: about half the time of
    ``json.loads`` on the objects and watch events the operator reads per step report)."""
    return pydantic_core.from_json(raw)


class ApiError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class ChildRefused(Exception):
    """The API server refused a child built from the job's spec: invalid for it (400/422,
    e.g. a toleration or node selector the model lets through; a Workload Kueue's webhook
    refuses) or forbidden by an admission check (403: a ResourceQuota, a PriorityClass that
    does not exist). Not the operator's fault and not fixed by retrying at once: a Warning
    Event (FailedCreate) and a warning naming the child, then retries on the error backoff,
    not counted as reconcile errors."""

    def __init__(self, kind: str, name: str, error: ApiError) -> None:
        super().__init__(f"{kind} {name}: {error.status} {error.reason}: {error.message}")
        self.kind, self.name, self.error = kind, name, error


@dataclass
class Credentials:
    server: str
    ca_path: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    token: str | None = None
    token_path: str | None = None  # re-read (bound tokens rotate)
    insecure: bool = False
    #: An exec credential plugin (kubeconfig ``users[].user.exec``): run again before
    #: ``token_expiry`` (epoch seconds; None: the credential does not expire).
    exec_plugin: kubeconfig.ExecPlugin | None = None
    token_expiry: float | None = None

    @classmethod
    def load(cls, kubeconfig_path: str | None = None) -> Credentials:
        """From ``kubeconfig_path`` (or $KUBECONFIG / ~/.kube/config), else in-cluster."""
        got = kubeconfig.load(kubeconfig_path)
        return cls(**dataclasses.asdict(got) | {"exec_plugin": got.exec_plugin})

    def refresh(self) -> None:
        """Fetch an exec credential again when it is about to expire (else nothing)."""
        if kubeconfig.exec_due(self):
            kubeconfig.refresh_exec(self)

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        ctx = ssl.create_default_context(cafile=self.ca_path)
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert_path and self.key_path:
            ctx.load_cert_chain(self.cert_path, self.key_path)
        return ctx


class KubeClient:
    """Just the calls the operator needs. Paths are API paths (``/api/v1/...``)."""

    def __init__(self, creds: Credentials, timeout: float = 30.0,
                 counted: Callable[[str, str], None] | None = None) -> None:
        self.creds = creds
        #: Called with (verb, resource) before each request (the operator's request counter).
        self._counted = counted
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._token_read = 0.0

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self) -> dict[str, str]:
        c = self.creds
        c.refresh()
        if c.token_path and time.monotonic() - self._token_read > 60:
            c.token = Path(c.token_path).read_text().strip()
            self._token_read = time.monotonic()
        return {"Authorization": f"Bearer {c.token}"} if c.token else {}

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            conn = aiohttp.TCPConnector(ssl=self.creds.ssl_context(), limit=64)
            self._session = aiohttp.ClientSession(connector=conn, timeout=self._timeout)
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        body: Obj | list[Any] | None = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
        accept: str = "application/json",
    ) -> Obj:
        if self._counted is not None:
            self._counted(_verb(method, path, params), resource_of(path))
        headers = {**self._headers(), "Accept": accept}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = (yaml_json(body).encode() if content_type == APPLY_PATCH
                    else pydantic_core.to_json(body))
        async with self._get_session().request(
            method, self.creds.server + path, data=data, params=params, headers=headers
        ) as resp:
            raw = await resp.read()
            if resp.status >= 300:
                text = raw.decode("utf-8", "replace")
                try:
                    err = json.loads(text)
                    raise ApiError(resp.status, err.get("reason", ""), err.get("message", text))
                except (ValueError, AttributeError):
                    raise ApiError(resp.status, resp.reason or "", text) from None
            return _loads(raw) if raw else {}

    async def get_text(self, path: str) -> str:
        """GET a non-JSON path (e.g. /metrics)."""
        async with self._get_session().get(self.creds.server + path,
                                           headers=self._headers()) as resp:
            text = await resp.text()
            if resp.status >= 300:
                raise ApiError(resp.status, resp.reason or "", text[:500])
            return text

    async def watch(
        self, path: str, resource_version: str, timeout_seconds: int = 300,
        accept: str = "application/json",
    ) -> AsyncIterator[Obj]:
        """Watch events of a collection from ``resource_version`` (with bookmarks).
        ``accept``: e.g. :data:`METADATA_ONLY` for metadata-only events."""
        params = {
            "watch": "1", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
        }
        timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_seconds + 30)
        if self._counted is not None:
            self._counted("WATCH", resource_of(path))
        async with self._get_session().get(
            self.creds.server + path, params=params,
            headers={**self._headers(), "Accept": accept}, timeout=timeout,
        ) as resp:
            if resp.status >= 300:
                raise ApiError(resp.status, resp.reason or "", (await resp.text())[:500])
            async for line in resp.content:
                if line.strip():
                    yield _loads(line)

    # --- helpers ----------------------------------------------------------------------------
    async def get(self, path: str) -> Obj | None:
        try:
            return await self.request("GET", path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def apply(self, obj: Obj, field_manager: str) -> Obj:
        """Server-side apply (force: the operator owns these fields)."""
        path = object_path(obj["apiVersion"], plural_of(obj["kind"]),
                           obj["metadata"].get("namespace"), obj["metadata"]["name"])
        return await self.request(
            "PATCH", path, obj,
            params={"fieldManager": field_manager, "force": "true"},
            content_type=APPLY_PATCH,
        )

    async def create(self, obj: Obj) -> Obj:
        path = object_path(obj["apiVersion"], plural_of(obj["kind"]),
                           obj["metadata"].get("namespace"), None)
        return await self.request("POST", path, obj)

    async def delete(self, path: str, propagation: str = "Background") -> bool:
        try:
            await self.request(
                "DELETE", path, {"kind": "DeleteOptions", "apiVersion": "v1",
                                 "propagationPolicy": propagation},
            )
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise


_PLURALS = {
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Service": "services",
    "Pod": "pods",
    "StatefulSet": "statefulsets",
    "NetworkPolicy": "networkpolicies",
    "Event": "events",
    "Lease": "leases",
    "RLTrainingJob": "rltrainingjobs",
    "Workload": "workloads",
}


def resource_of(path: str) -> str:
    """The resource an API path names: its plural, with the subresource if any
    (``/apis/g/v/namespaces/ns/rltrainingjobs/x/status`` -> ``rltrainingjobs/status``)."""
    parts = path.split("?", 1)[0].strip("/").split("/")
    # /api/v1/... or /apis/group/version/...
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:] if parts[:1] == ["apis"] else []
    if len(rest) >= 2 and rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    if not rest:
        return "other"
    return rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")


def _verb(method: str, path: str, params: dict[str, str] | None) -> str:
    """Verbs as the API server counts them: a GET of a collection is a LIST."""
    if method != "GET":
        return method
    parts = path.split("?", 1)[0].strip("/").split("/")
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:] if parts[:1] == ["apis"] else []
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    return "LIST" if len(rest) == 1 else "GET"


def plural_of(kind: str) -> str:
    return _PLURALS[kind]


def object_path(api_version: str, plural: str, namespace: str | None, name: str | None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespace:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    if name:
        base += f"/{name}"
    return base
