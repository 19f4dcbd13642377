"""The job list+watch (handlers.watch_jobs) against API answers the real server gives."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from rlpacer.operator.handlers import JobLoops, watch_jobs

pytestmark = pytest.mark.unit


class _Kube:
    """A metadata-only list of an empty namespace, as kube-apiserver v1.33 answers it
    (``"items": null``), then a watch that delivers one ADDED job."""

    def __init__(self) -> None:
        self.lists = 0

    async def request(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        self.lists += 1
        return {"kind": "PartialObjectMetadataList", "apiVersion": "meta.k8s.io/v1",
                "metadata": {"resourceVersion": "7"}, "items": None}

    async def watch(self, path: str, rv: str, **_: Any) -> AsyncIterator[dict[str, Any]]:
        assert rv == "7"
        yield {"type": "ADDED", "object": {"metadata": {
            "namespace": "team", "name": "job", "generation": 1, "resourceVersion": "8"}}}
        await asyncio.sleep(3600)


class _Jobs:
    def __init__(self) -> None:
        self.kube = _Kube()

    def peek(self, namespace: str, name: str) -> None:
        return None

    def saw(self, namespace: str, name: str, resource_version: str) -> None:
        self.seen = (namespace, name, resource_version)


class _Loops(JobLoops):
    def __init__(self) -> None:
        self.started: list[tuple[str, str]] = []
        self._tasks = {}

    def ensure(self, namespace: str, name: str) -> None:
        self.started.append((namespace, name))


def test_empty_namespace_null_items_does_not_restart_the_watch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body() -> None:
        jobs, loops = _Jobs(), _Loops()
        task = asyncio.create_task(watch_jobs(jobs, loops, ["team"]))  # type: ignore[arg-type]
        try:
            for _ in range(100):
                if loops.started:
                    break
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert loops.started == [("team", "job")]  # picked up from the watch at once
        assert jobs.kube.lists == 1  # no relist

    with caplog.at_level(logging.INFO, logger="rlpacer.operator"):
        asyncio.run(body())
    assert "restarts" not in caplog.text
