"""The pods' Ray nodes: what each role starts, and how the driver picks its own node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlpacer_trainer import contract as c
from rlpacer_trainer import topology

pytestmark = pytest.mark.unit

BASE = {c.ENV_POD_IP: "10.0.0.7", c.ENV_RAY_ADDRESS: "j-head.ns.svc:6379"}


def _opts(argv: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) if "=" in a else (a[2:], "") for a in argv[2:])


def test_head_binds_the_pod_ip() -> None:
    opts = _opts(topology.ray_start_command(c.Role.HEAD, {c.ENV_POD_IP: "10.0.0.2"}))
    assert opts["node-ip-address"] == "10.0.0.2" and "head" in opts and "block" in opts
    assert opts["port"] == str(c.RAY_GCS_PORT)
    assert opts["ray-client-server-port"] == str(c.RAY_CLIENT_PORT)


@pytest.mark.parametrize("role", [c.Role.ROLLOUT, c.Role.LEARNER])
def test_workers_advertise_role_and_index(role: c.Role) -> None:
    opts = _opts(topology.ray_start_command(role, {**BASE, c.ENV_RANK: "3"}))
    assert opts["address"] == "j-head.ns.svc:6379" and opts["node-ip-address"] == "10.0.0.7"
    assert json.loads(opts["resources"]) == {f"rlpacer.io/{role}": 1,
                                             f"rlpacer.io/{role}-3": 1}
    assert opts["labels"] == f"rlpacer.io/role={role},rlpacer.io/rank=3"
    assert topology.pod_resource(role, 3) == f"rlpacer.io/{role}-3"


def test_index_falls_back_to_the_statefulset_ordinal() -> None:
    assert topology.pod_index({"HOSTNAME": "job-rollout-12"}) == 12
    assert topology.pod_index({c.ENV_RANK: "2", "HOSTNAME": "job-rollout-12"}) == 2
    with pytest.raises(topology.TopologyError):
        topology.pod_index({"HOSTNAME": "driver"})


def test_driver_node_offers_nothing_and_is_picked_by_ip_and_temp_dir() -> None:
    env = {**BASE, c.ENV_RAY_TEMP_DIR: "/tmp/r/driver"}
    opts = _opts(topology.ray_start_command(c.Role.DRIVER, env))
    assert opts["num-cpus"] == "0" and opts["num-gpus"] == "0" and "resources" not in opts
    assert opts["temp-dir"] == "/tmp/r/driver"
    assert topology.init_kwargs(env) == {"_node_ip_address": "10.0.0.7",
                                         "_temp_dir": "/tmp/r/driver"}
    # loopback (the pod harness without namespaces): attach to the node already there
    assert topology.init_kwargs({**env, c.ENV_POD_IP: "127.0.0.1"}) == {}


def test_workers_need_the_head_address() -> None:
    with pytest.raises(topology.TopologyError):
        topology.ray_start_command(c.Role.ROLLOUT, {c.ENV_RANK: "0"})


def test_a_token_turns_token_auth_on() -> None:
    assert topology.ray_env({"RAY_AUTH_TOKEN": "t"})["RAY_AUTH_MODE"] == "token"
    assert topology.ray_env({"RAY_AUTH_TOKEN_PATH": "/x"})["RAY_AUTH_MODE"] == "token"
    assert topology.ray_env({"RAY_AUTH_TOKEN": "t", "RAY_AUTH_MODE": "disabled"})[
        "RAY_AUTH_MODE"] == "disabled"
    assert "RAY_AUTH_MODE" not in topology.ray_env({})


def test_the_operators_pod_env_reaches_every_ray_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the builders set on every pod (mode and token file, names from the contract) is
    what ``ray start`` gets and what the driver process itself runs with."""
    pod_env = {**BASE, c.ENV_RAY_AUTH_MODE: c.RAY_AUTH_MODE_TOKEN,
               c.ENV_RAY_AUTH_TOKEN_PATH: c.RAY_TOKEN_PATH}
    assert (topology.RAY_AUTH_MODE, topology.RAY_AUTH_TOKEN_PATH) == (
        c.ENV_RAY_AUTH_MODE, c.ENV_RAY_AUTH_TOKEN_PATH)
    out = topology.ray_env(pod_env)
    assert out[c.ENV_RAY_AUTH_MODE] == "token" and out[c.ENV_RAY_AUTH_TOKEN_PATH] == (
        c.RAY_TOKEN_PATH)
    # the token file alone (no mode) turns the mode on too
    only_path = {k: v for k, v in pod_env.items() if k != c.ENV_RAY_AUTH_MODE}
    assert topology.ray_env(only_path)[c.ENV_RAY_AUTH_MODE] == "token"
    monkeypatch.setenv(c.ENV_RAY_AUTH_MODE, "token")  # unchanged: no config re-read
    monkeypatch.setenv(c.ENV_RAY_AUTH_TOKEN_PATH, "/elsewhere")  # restored after the test
    topology._auth_in_this_process(pod_env)
    assert os.environ[c.ENV_RAY_AUTH_TOKEN_PATH] == c.RAY_TOKEN_PATH


@pytest.mark.parametrize("content", ["abc123", "abc123\n", "abc123\r\n\n"])
def test_ray_reads_the_mounted_token_with_or_without_a_trailing_newline(
    tmp_path: Path, content: str,
) -> None:
    """Ray's own token loader (C++, read once per process) trims whitespace: a Secret's value
    written with ``echo`` (trailing newline) and one without are the same token."""
    pytest.importorskip("ray")
    tok = tmp_path / "token"
    tok.write_text(content)
    code = ("from ray._raylet import AuthenticationTokenLoader as L;"
            "print(L.instance().get_raw_token())")
    env = {**os.environ, c.ENV_RAY_AUTH_MODE: "token", c.ENV_RAY_AUTH_TOKEN_PATH: str(tok)}
    env.pop("RAY_AUTH_TOKEN", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "abc123"


def test_the_driver_pod_attaches_through_its_own_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_driver: with RAY_ADDRESS, the loop runs inside topology.attached (never a bare
    ray.init on the cluster's address); without it, Ray starts locally."""
    from rlpacer_trainer import fit, pod, runtime
    from rlpacer_trainer.config import RunConfig

    calls: list[str] = []

    class Attached:
        def __init__(self, env: dict[str, str], runtime_env: object = None) -> None:
            calls.append(f"attach {env[c.ENV_RAY_ADDRESS]} {runtime_env is runtime.RUNTIME_ENV}")

        def __enter__(self) -> None:
            calls.append("enter")

        def __exit__(self, *exc: object) -> None:
            calls.append("exit")

    monkeypatch.setattr(RunConfig, "load", staticmethod(lambda *a, **k: "cfg"))
    monkeypatch.setattr(fit, "check_run", lambda *a, **k: None)  # tests/unit/trainer/test_fit
    monkeypatch.setattr(topology, "attached", Attached)
    monkeypatch.setattr(runtime, "init_ray", lambda *a, **k: calls.append("local"))
    monkeypatch.setattr(pod, "_run_loop", lambda *a: calls.append("loop") or 0)
    monkeypatch.setattr(runtime, "wait_for_pods", lambda cfg: calls.append(f"wait {cfg}"))
    assert pod.run_driver(BASE) == 0
    assert calls == ["attach j-head.ns.svc:6379 True", "enter", "wait cfg", "loop", "exit"]
    calls.clear()
    assert pod.run_driver({c.ENV_POD_IP: "10.0.0.7"}) == 0
    assert calls == ["local", "loop"]
