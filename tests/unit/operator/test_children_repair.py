"""Deleted children come back on the next pass: every child kind is watched (a deletion
clears the applied cache), and the token Secret comes back with the same token; a token
that was lost (Secret deleted while no operator knew it) is replaced for new pods while the
running driver's stays valid, through the hashes kept in status."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from operator_fakekube import FakeKube
from test_reports import NS, add_job, open_env, report, run

from rlpacer.api import contract
from rlpacer.operator import names
from rlpacer.operator.handlers import JobLoops, OperatorContext, build_registry
from rlpacer.operator.kube import Credentials, object_path
from rlpacer.operator.runtime import token_hash
from rlpacer.operator.settings import OperatorSettings

pytestmark = pytest.mark.unit

SECRET = object_path("v1", "secrets", NS, names.secret("job"))
CHILDREN = {
    "configmaps": object_path("v1", "configmaps", NS, names.config_map("job")),
    "services": object_path("v1", "services", NS, names.head_service("job")),
    "secrets": SECRET,
}


def _secret_token(fk: FakeKube) -> str:
    return base64.b64decode(fk.objects[SECRET]["data"][contract.TOKEN_KEY]).decode()


def _child_handlers(jobs: Any) -> dict[str, Any]:
    ctx = OperatorContext(settings=OperatorSettings(leader_election=False),
                          creds=Credentials(server="http://127.0.0.1:1"), jobs=jobs,
                          loops=JobLoops(jobs))
    reg = build_registry(ctx)
    return {h.selector.any_name: h.fn for h in reg._watching.get_all_handlers()}


def test_deleted_configmap_service_and_secret_are_recreated_on_the_next_pass() -> None:
    async def body() -> None:
        fk = FakeKube()
        add_job(fk, "job")
        env, close = await open_env(fk)
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            tok = _secret_token(fk)
            handlers = _child_handlers(env.jobs)
            for plural, path in CHILDREN.items():
                assert path in fk.objects, path
                del fk.objects[path]
                labels = {contract.LABEL_JOB: "job"}
                await handlers[plural](type="DELETED", labels=labels, namespace=NS)
                assert rt.wake.is_set()
                rt.wake.clear()
                await env.jobs.reconcile(rt)
                assert path in fk.objects, f"{plural} not re-created"
            assert _secret_token(fk) == tok  # the same token, not a new one
            assert env.status("job")["tokenHashes"] == [token_hash(tok)]
        finally:
            await close()

    run(body)


def test_a_lost_token_is_replaced_and_the_running_driver_keeps_reporting() -> None:
    async def body() -> None:
        fk = FakeKube()
        add_job(fk, "job")
        env, close = await open_env(fk)
        rt = await env.jobs.get(NS, "job")
        assert rt is not None
        await env.jobs.reconcile(rt)
        t1 = _secret_token(fk)
        g = (await env.plan("job"))["groupSize"]
        code, plan = await env.post("job", report(0, g, 20), token=t1)
        assert code == 200
        await close()
        # The Secret is deleted while no operator runs; a new operator process starts.
        del fk.objects[SECRET]
        env, close = await open_env(fk)
        try:
            # before its first pass: the running driver's token is accepted (hash in status)
            code, plan = await env.post("job", report(1, plan["groupSize"], 20), token=t1)
            assert code == 200, plan
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            t2 = _secret_token(fk)  # new pods get a new token ...
            assert t2 != t1
            assert env.status("job")["tokenHashes"] == [token_hash(t1), token_hash(t2)]
            # ... and both are valid; anything else is not
            code, plan = await env.post("job", report(2, plan["groupSize"], 20), token=t1)
            assert code == 200, plan
            code, plan = await env.post("job", report(3, plan["groupSize"], 20), token=t2)
            assert code == 200, plan
            code, err = await env.post("job", report(4, plan["groupSize"], 20), token="x" * 43)
            assert code == 401, err
            # later passes write nothing more
            puts = sum(1 for m, _ in fk.calls if m == "PUT")
            rt.applied.clear()
            await env.jobs.reconcile(rt)
            assert env.status("job")["tokenHashes"] == [token_hash(t1), token_hash(t2)]
            assert sum(1 for m, _ in fk.calls if m == "PUT") <= puts + 1  # decide() at most
        finally:
            await close()

    run(body)


def test_an_older_crd_that_prunes_token_hashes_costs_no_write_per_pass() -> None:
    async def body() -> None:
        fk = FakeKube()
        real = fk.request

        async def pruning(method: str, path: str, body: Any = None, **kw: Any) -> Any:
            if method == "PUT" and path.endswith("/status"):
                body = {**body, "status": {k: v for k, v in body["status"].items()
                                           if k != "tokenHashes"}}
            return await real(method, path, body, **kw)

        fk.request = pruning  # type: ignore[method-assign]
        add_job(fk, "job")
        env, close = await open_env(fk)
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            tok = _secret_token(fk)
            assert "tokenHashes" not in env.status("job")
            puts = sum(1 for m, _ in fk.calls if m == "PUT")
            for _ in range(3):
                rt.applied.clear()
                await env.jobs.reconcile(rt)
            assert sum(1 for m, _ in fk.calls if m == "PUT") == puts
            g = (await env.plan("job"))["groupSize"]
            code, plan = await env.post("job", report(0, g, 20), token=tok)  # the Secret's
            assert code == 200, plan
        finally:
            await close()

    run(body)
