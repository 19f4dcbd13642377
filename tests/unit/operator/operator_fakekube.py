"""An in-memory stand-in for the API server: just what rlpacer.operator.runtime calls, with
resourceVersion preconditions on PUT (409 on a stale one) like the real one."""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

from rlpacer.operator.kube import METADATA_ONLY, ApiError, object_path, plural_of

Obj = dict[str, Any]


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[str, Obj] = {}
        self._rv = itertools.count(1)
        self._uid = itertools.count(1)
        self.calls: list[tuple[str, str]] = []
        self.fail_next_put: int = 0  # answer 409 to this many status PUTs (after a bump)

    def _bump(self, obj: Obj) -> None:
        obj.setdefault("metadata", {})["resourceVersion"] = str(next(self._rv))

    def put_object(self, path: str, obj: Obj) -> Obj:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", f"uid-{next(self._uid)}")
        meta.setdefault("generation", 1)
        self._bump(obj)
        self.objects[path] = obj
        return copy.deepcopy(obj)

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
        accept: str = "application/json",
    ) -> Obj:
        self.calls.append((method, path))
        if method == "GET" and path not in self.objects and (params or {}).get("labelSelector"):
            want = dict(kv.split("=", 1) for kv in params["labelSelector"].split(","))  # type: ignore[index]
            items = [copy.deepcopy(o) for p, o in sorted(self.objects.items())
                     if p.rsplit("/", 1)[0] == path
                     and want.items() <= ((o.get("metadata") or {}).get("labels") or {}).items()]
            return {"kind": "List", "items": items}
        if method == "GET":
            if path not in self.objects:
                raise ApiError(404, "NotFound", path)
            return copy.deepcopy(self.objects[path])
        if method == "PUT" and path.endswith("/status"):
            base = path[: -len("/status")]
            cur = self.objects.get(base)
            if cur is None:
                raise ApiError(404, "NotFound", base)
            if self.fail_next_put:
                self.fail_next_put -= 1
                self._bump(cur)  # someone else wrote (e.g. an annotation)
                raise ApiError(409, "Conflict", "the object has been modified")
            if body["metadata"].get("resourceVersion") != cur["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", "the object has been modified")
            cur["status"] = copy.deepcopy(body["status"])
            json.dumps(cur)  # must be JSON
            self._bump(cur)
            if accept == METADATA_ONLY:  # as the API server answers it
                return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                        "metadata": copy.deepcopy(cur["metadata"])}
            return copy.deepcopy(cur)
        if method == "PUT":
            cur = self.objects.get(path)
            if cur is None:
                raise ApiError(404, "NotFound", path)
            if body["metadata"].get("resourceVersion") != cur["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", "modified")
            return self.put_object(
                path, {**body, "metadata": {**cur["metadata"], **body["metadata"]}}
            )
        if method == "POST":
            name = body["metadata"].get("name") or body["metadata"].get("generateName", "x") + str(
                next(self._uid)
            )
            p = f"{path}/{name}"
            if p in self.objects:
                raise ApiError(409, "AlreadyExists", p)
            return self.put_object(p, body)
        if method == "PATCH":  # server-side apply: replace (good enough for the tests)
            return self.put_object(path, body)
        if method == "DELETE":
            if path not in self.objects:
                raise ApiError(404, "NotFound", path)
            del self.objects[path]
            return {}
        raise AssertionError(method)

    async def get(self, path: str) -> Obj | None:
        try:
            return await self.request("GET", path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def apply(self, obj: Obj, field_manager: str) -> Obj:
        md = obj["metadata"]
        return await self.request(
            "PATCH",
            object_path(obj["apiVersion"], plural_of(obj["kind"]), md.get("namespace"), md["name"]),
            obj,
        )

    async def create(self, obj: Obj) -> Obj:
        md = obj["metadata"]
        return await self.request(
            "POST",
            object_path(obj["apiVersion"], plural_of(obj["kind"]), md.get("namespace"), None),
            obj,
        )

    async def delete(self, path: str, propagation: str = "Background") -> bool:
        try:
            await self.request("DELETE", path)
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise

    async def close(self) -> None:
        pass

    def of_kind(self, plural: str) -> list[Obj]:
        return [o for p, o in self.objects.items() if f"/{plural}/" in p]
