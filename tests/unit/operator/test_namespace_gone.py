"""A job whose namespace is deleted: its reconcile loop ends and its metric series go, whether
the job's DELETED watch event comes together with its children's (the loop is stopped as it
wakes) or not at all (a restarting watch missed it: the loop finds the job gone itself)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from operator_fakekube import FakeKube
from test_reports import NS, add_job, open_env, run

from rlpacer.operator import handlers
from rlpacer.operator.handlers import JobLoops
from rlpacer.operator.kube import ApiError

pytestmark = pytest.mark.unit


class DeletedNamespaceKube(FakeKube):
    """After :meth:`delete_namespace`, the namespace's objects are gone and a write there is
    answered as kube-apiserver answers it (404, ``namespaces "<ns>" not found``)."""

    def __init__(self) -> None:
        super().__init__()
        self.gone: set[str] = set()
        self.refused = 0

    def delete_namespace(self, namespace: str) -> None:
        self.gone.add(namespace)
        for path in [p for p in self.objects if f"/namespaces/{namespace}/" in p]:
            del self.objects[path]

    async def request(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        if method in ("POST", "PATCH", "PUT") and any(
                f"/namespaces/{ns}/" in path for ns in self.gone):
            self.refused += 1
            ns = next(ns for ns in self.gone if f"/namespaces/{ns}/" in path)
            raise ApiError(404, "NotFound", f'namespaces "{ns}" not found')
        return await super().request(method, path, body, **kw)


@contextlib.asynccontextmanager
async def _running_job(fk: FakeKube) -> AsyncIterator[tuple[Any, JobLoops]]:
    """A job "job" with its loop started and idle after its first pass; everything stopped
    after."""
    add_job(fk, "job")
    env, close = await open_env(fk)
    loops = JobLoops(env.jobs)
    try:
        loops.ensure(NS, "job")
        await _idle(loops, env, "job")
        assert _series(env, "job") > 0
        yield env, loops
    finally:
        await loops.stop_all()
        await close()


async def _idle(loops: JobLoops, env: Any, name: str) -> None:
    """Wait until the job's loop has made its first pass (children applied) and waits."""
    for _ in range(300):
        await asyncio.sleep(0.01)
        rt = env.jobs.peek(NS, name)
        if rt is not None and rt.applied and not rt.wake.is_set():
            return
    raise AssertionError("the loop made no pass")


def _series(env: Any, name: str) -> int:
    return int(env.metrics.series_for(NS, name))


def test_a_job_deleted_as_its_children_wake_its_loop_stops_and_its_series_go() -> None:
    """The namespace controller deletes the job and its children together: a child's DELETED
    event wakes the loop in the same moment as the job's DELETED event stops it. The stop
    must end the loop (Python 3.11's ``asyncio.wait_for`` swallowed a cancellation that came
    as its awaitable finished: the loop ran on, re-creating children in a namespace that was
    gone, and ``stop`` waited for it forever, holding the job watch)."""

    async def body() -> None:
        async with _running_job(FakeKube()) as (env, loops):
            for _ in range(20):  # the race each time, not a lucky miss once
                env.jobs.child_event(NS, "job", "StatefulSet", "job-rollout", "DELETED", {})
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                async with asyncio.timeout(5):
                    await loops.stop(NS, "job")
                assert not loops.running(NS, "job")
                assert env.jobs.peek(NS, "job") is None
                assert _series(env, "job") == 0
                loops.ensure(NS, "job")  # the job again, for the next round
                await _idle(loops, env, "job")
            passes = env.metrics.reconciles.labels(NS, "job")._value.get()
            await loops.stop(NS, "job")
            await asyncio.sleep(0.3)  # no pass after the stop (a loop that ran on would)
            assert env.jobs.peek(NS, "job") is None
            assert passes >= 1 and _series(env, "job") == 0

    run(body)


def test_a_namespace_deleted_with_no_delete_event_ends_the_loop_and_its_series(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The job's DELETED event never comes (the watch restarted across it) and the watch has
    seen the job's last write, so a pass would not read the job again. The namespace's
    refusal of the children's re-creation (404 for a namespace already gone) is no error: the
    next pass reads the job, finds it gone, and the loop ends with its series."""
    monkeypatch.setattr(handlers, "ERROR_BACKOFF", (0.05,))

    async def body() -> None:
        fk = DeletedNamespaceKube()
        async with _running_job(fk) as (env, loops):
            rt = env.jobs.peek(NS, "job")
            env.jobs.saw(NS, "job", rt.rv)  # the watch is up to date with the job
            fk.delete_namespace(NS)
            env.jobs.child_event(NS, "job", "StatefulSet", "job-rollout", "DELETED", {})
            for _ in range(300):
                await asyncio.sleep(0.01)
                if not loops.running(NS, "job"):
                    break
            assert fk.refused >= 1  # the pass did try to re-create a child
            assert not loops.running(NS, "job")
            assert env.jobs.peek(NS, "job") is None and _series(env, "job") == 0

    with caplog.at_level(logging.INFO, logger="rlpacer.operator"):
        run(body)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert "namespace is being deleted" in caplog.text
