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


# --- the Ray token ------------------------------------------------------------------------

RAY_SECRET = object_path("v1", "secrets", NS, names.ray_secret("job"))


def _ray_token(fk: FakeKube) -> str:
    return base64.b64decode(fk.objects[RAY_SECRET]["data"][contract.RAY_TOKEN_KEY]).decode()


def _driver(fk: FakeKube, attempt: int) -> str:
    return object_path("v1", "pods", NS, names.driver_pod("job", attempt))


def _pod_hashes(fk: FakeKube) -> dict[str, str | None]:
    """name -> the Ray-token hash annotated on each pod (template) of the job."""
    out: dict[str, str | None] = {}
    for sts in fk.of_kind("statefulsets"):
        meta = sts["spec"]["template"]["metadata"]
        out[sts["metadata"]["name"]] = (meta.get("annotations") or {}).get(
            contract.ANNOTATION_RAY_TOKEN_HASH)
    for pod in fk.of_kind("pods"):
        out[pod["metadata"]["name"]] = (pod["metadata"].get("annotations") or {}).get(
            contract.ANNOTATION_RAY_TOKEN_HASH)
    return out


def _events(fk: FakeKube, reason: str) -> list[dict[str, Any]]:
    return [o for o in fk.of_kind("events") if o.get("reason") == reason]


def test_the_ray_token_is_minted_once_and_kept_across_secret_deletion_and_restarts() -> None:
    async def body() -> None:
        fk = FakeKube()
        add_job(fk, "job")
        env, close = await open_env(fk)
        rt = await env.jobs.get(NS, "job")
        assert rt is not None
        await env.jobs.reconcile(rt)
        tok = _ray_token(fk)
        assert len(tok) == 64 and tok != _secret_token(fk)  # its own token, its own Secret
        sec = fk.objects[RAY_SECRET]
        assert sec["immutable"] is True
        assert sec["metadata"]["ownerReferences"][0]["uid"] == rt.uid
        # every pod of the job is built with its hash (head, learner, rollout, driver)
        assert _pod_hashes(fk) == {n: token_hash(tok) for n in (
            "job-head", "job-learner", "job-rollout", "job-driver-0")}
        fk.objects[_driver(fk, 0)]["status"] = {"phase": "Running"}
        # deleted while this process runs: re-created with the same token, nothing restarts
        del fk.objects[RAY_SECRET]
        await _child_handlers(env.jobs)["secrets"](
            type="DELETED", labels={contract.LABEL_JOB: "job"}, namespace=NS)
        await env.jobs.reconcile(rt)
        assert _ray_token(fk) == tok and rt.status.attempt == 0
        await close()
        # a new operator process: reads the token back, restarts nothing
        env, close = await open_env(fk)
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            assert _ray_token(fk) == tok
            assert env.status("job")["attempt"] == 0 and _driver(fk, 0) in fk.objects
            assert not _events(fk, "Restarting")
        finally:
            await close()

    run(body)


@pytest.mark.parametrize("case", ["lost", "older-operator"])
def test_a_new_ray_token_restarts_the_attempt_without_counting_a_failure(case: str) -> None:
    """The Ray token is lost (its Secret deleted while no operator knew it), or the job was
    made by an operator without Ray tokens: the job gets a (new) token, the StatefulSets'
    templates carry its hash (they roll), and the running driver, whose Ray node has another
    token, is replaced by the next attempt, not counted against backoffLimit."""

    async def body() -> None:
        fk = FakeKube()
        add_job(fk, "job")
        env, close = await open_env(fk)
        rt = await env.jobs.get(NS, "job")
        assert rt is not None
        await env.jobs.reconcile(rt)
        t1 = _ray_token(fk)
        await close()
        del fk.objects[RAY_SECRET]
        if case == "older-operator":  # its pods: no Ray token, no hash
            for obj in [*fk.of_kind("statefulsets"), *fk.of_kind("pods")]:
                meta = (obj["spec"]["template"]["metadata"] if obj["kind"] == "StatefulSet"
                        else obj["metadata"])
                meta.pop("annotations", None)
        fk.objects[_driver(fk, 0)]["status"] = {"phase": "Running"}
        env, close = await open_env(fk)
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            t2 = _ray_token(fk)
            assert t2 != t1
            st = env.status("job")
            assert st["attempt"] == 1 and st.get("failures", 0) == 0
            assert _driver(fk, 0) not in fk.objects  # the old attempt's driver is gone
            assert _pod_hashes(fk) == {n: token_hash(t2) for n in (
                "job-head", "job-learner", "job-rollout", "job-driver-1")}
            (ev,) = _events(fk, "Restarting")
            assert "Ray token" in ev["message"] and "attempt 1" in ev["message"]
            # settled: later passes restart nothing
            fk.objects[_driver(fk, 1)]["status"] = {"phase": "Running"}
            for _ in range(2):
                rt.applied.clear()
                await env.jobs.reconcile(rt)
            assert env.status("job")["attempt"] == 1 and _ray_token(fk) == t2
            assert len(_events(fk, "Restarting")) == 1
        finally:
            await close()

    run(body)


def test_a_finished_driver_is_not_restarted_for_a_new_ray_token() -> None:
    async def body() -> None:
        fk = FakeKube()
        add_job(fk, "job")
        env, close = await open_env(fk)
        rt = await env.jobs.get(NS, "job")
        assert rt is not None
        await env.jobs.reconcile(rt)
        await close()
        del fk.objects[RAY_SECRET]
        fk.objects[_driver(fk, 0)]["status"] = {"phase": "Succeeded"}
        env, close = await open_env(fk)
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            st = env.status("job")
            assert st["attempt"] == 0 and st["summary"] == "Succeeded"
            assert RAY_SECRET in fk.objects and not _events(fk, "Restarting")
        finally:
            await close()

    run(body)


def test_an_older_crd_that_prunes_ready_ordinals_costs_no_write_per_pass() -> None:
    async def body() -> None:
        fk = FakeKube()
        real = fk.request

        async def pruning(method: str, path: str, body: Any = None, **kw: Any) -> Any:
            if method == "PUT" and path.endswith("/status"):
                ro = {k: v for k, v in (body["status"].get("rollout") or {}).items()
                      if k != "readyOrdinals"}
                body = {**body, "status": {**body["status"], "rollout": ro}}
            return await real(method, path, body, **kw)

        fk.request = pruning  # type: ignore[method-assign]
        add_job(fk, "job")
        env, close = await open_env(fk)
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            await env.jobs.reconcile(rt)
            assert rt.ordinals_pruned
            assert "readyOrdinals" not in env.status("job")["rollout"]
            puts = sum(1 for m, _ in fk.calls if m == "PUT")
            for _ in range(3):
                rt.applied.clear()
                await env.jobs.reconcile(rt)
            assert sum(1 for m, _ in fk.calls if m == "PUT") == puts
            plan = await env.plan("job", fields="usableReplicas")
            assert "usableReplicas" not in plan["rollout"]  # the trainer's fallback applies
        finally:
            await close()

    run(body)
