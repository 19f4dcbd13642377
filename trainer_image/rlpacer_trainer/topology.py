"""The Ray topology of a job: which pod runs which Ray node, and how the driver attaches.

In a cluster every pod is its own host. The pods of a job make one Ray cluster:

* **head** (``<job>-head-0``) runs the GCS: ``ray start --head`` with ``--node-ip-address``
  set to the pod's own IP (:data:`~rlpacer.api.contract.ENV_POD_IP`, the downward API's
  ``status.podIP``), so the address it registers is the one other pods reach, never an
  address guessed from a default route the pod may not have.
* **rollout** / **learner** (``<job>-<role>-<i>``) join at ``RAY_ADDRESS`` as worker nodes
  that advertise *who they are*, so an actor can be placed on exactly the pod meant for it:

  - a custom resource ``rlpacer.io/<role>-<i>: 1`` (:func:`pod_resource`): request it
    (``options(resources={pod_resource("rollout", 1): 0.01})``) and the actor can only run
    on that pod; plus ``rlpacer.io/<role>: 1`` to mean "any pod of the role". Resources are
    the placement Ray has supported longest (actors, tasks, placement-group bundles), and
    Ray's scheduler treats them as hard constraints.
  - node labels ``rlpacer.io/role=<role>`` and ``rlpacer.io/rank=<i>`` (:func:`node_labels`),
    for ``label_selector`` placement and for reading the topology (``ray.nodes()``) with
    names instead of resource conventions. Labels are newer in Ray; resources are what the
    placement code relies on.

  The index ``<i>`` is ``RLPACER_RANK`` (the builders set it from the StatefulSet's
  ``apps.kubernetes.io/pod-index`` label), else the ordinal at the end of the pod's hostname.
* **driver** (``<job>-driver-<attempt>``) attaches through a Ray node of its own: it starts
  ``ray start --address=$RAY_ADDRESS --num-cpus=0 --block`` in its pod (no CPUs, GPUs or
  role resources, so nothing is scheduled there but the driver itself) and then
  ``ray.init(address=$RAY_ADDRESS, _node_ip_address=<pod IP>, _temp_dir=<its temp dir>)``,
  which connects to that local node.

Why a local node and not Ray Client (``ray://<head>:10001``), after trying all three on
played hosts (``tests/e2e/test_ray_topology.py``: network, UTS and PID namespaces per pod):

* ``ray.init(address=<head>:6379)`` with no node in the pod fails after 60 s ("Failed to
  connect to Ray cluster": Ray finds no raylet on the driver's host to attach to, "No node
  info found matching attributes"): a Ray driver is not a remote client.
* Ray Client works (head started with ``--ray-client-server-port``) and attaches fastest
  (2.4 s to the first actor call vs 18 s with a local node, on a loaded 2-core machine). But
  it runs the real driver as a proxy process on the head pod: every ``ray.put`` and
  ``ray.get`` crosses driver -> head as 5 MiB gRPC chunks and the objects live in the head's
  object store, owned by the proxy. This driver ships the learner's weights to every engine
  each step: through Ray Client that is one more copy and the head pod's memory, CPU and
  network on the hot path, and some Ray APIs behave differently under the client.
* A local node (chosen): the driver's objects live in its own pod's object store and engines
  pull them directly from it; every Ray API works as in a local run. The cost is one raylet
  (no CPUs offered) in the driver pod and ~15 s of start-up, once per attempt.

**Token auth.** Ray 2.60 turns token authentication on, with ``RAY_AUTH_MODE`` unset, for a
head (``ray start --head``) that finds a token (``RAY_AUTH_TOKEN``, the file at
``RAY_AUTH_TOKEN_PATH``, or ``~/.ray/auth_token``), and for a local ``ray.init()``, which
also generates ``~/.ray/auth_token`` when there is none; a node or driver that joins an
explicit address never turns it on by itself, and is then refused ("InvalidAuthToken").
So every pod of a job needs the same token and ``RAY_AUTH_MODE=token``: :func:`ray_env` sets
the mode whenever a token is given, for the ``ray start`` of every role and (re-reading Ray's
config, see :func:`attached`) for the driver process itself. A pod must never rely on
``~/.ray/auth_token``: each pod's home is its own. On a cluster the operator mints one token
per job, in the Secret ``<job>-ray-token`` that every pod mounts read-only
(:data:`~rlpacer.api.contract.RAY_TOKEN_PATH`), and sets ``RAY_AUTH_MODE=token`` and
``RAY_AUTH_TOKEN_PATH`` on every pod; Ray trims whitespace around the file's token, so a
trailing newline is harmless.

**Several nodes on one host** (tests, laptops): each node gets its own ``--temp-dir``
(:data:`~rlpacer.api.contract.ENV_RAY_TEMP_DIR`; Ray's default ``/tmp/ray`` would be shared
and sockets would collide) and must not share an IP with another node's fixed ports: a driver
whose pod IP is loopback (the pod harness without network namespaces) therefore connects to
the head's node on the same address instead of starting its own.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rlpacer_trainer import contract as c

#: Prefix of the custom resources and node labels the pods advertise.
PREFIX = "rlpacer.io"
LABEL_ROLE = f"{PREFIX}/role"
LABEL_RANK = f"{PREFIX}/rank"
#: Ray's own env for the token mode / token / token file (read by every Ray process). The
#: operator sets the mode and the file on every pod (names from :mod:`rlpacer.api.contract`).
RAY_AUTH_MODE = c.ENV_RAY_AUTH_MODE
RAY_AUTH_TOKEN = "RAY_AUTH_TOKEN"
RAY_AUTH_TOKEN_PATH = c.ENV_RAY_AUTH_TOKEN_PATH
_ORDINAL = re.compile(r"-(\d+)$")


class TopologyError(RuntimeError):
    pass


def role_resource(role: str) -> str:
    """Custom resource every pod of ``role`` offers once (``rlpacer.io/rollout``)."""
    return f"{PREFIX}/{role}"


def pod_resource(role: str, index: int) -> str:
    """Custom resource only pod ``index`` of ``role`` offers (``rlpacer.io/rollout-1``)."""
    return f"{PREFIX}/{role}-{index}"


def pod_index(env: Mapping[str, str]) -> int:
    """The pod's index in its StatefulSet: ``RLPACER_RANK``, else the hostname's ordinal."""
    rank = env.get(c.ENV_RANK)
    if rank:
        return int(rank)
    m = _ORDINAL.search(env.get("HOSTNAME", ""))
    if m is None:
        raise TopologyError(f"{c.ENV_RANK} is unset and the hostname has no ordinal")
    return int(m.group(1))


def node_resources(role: str, index: int) -> dict[str, float]:
    return {role_resource(role): 1.0, pod_resource(role, index): 1.0}


def node_labels(role: str, index: int) -> dict[str, str]:
    return {LABEL_ROLE: role, LABEL_RANK: str(index)}


def pod_ip(env: Mapping[str, str]) -> str | None:
    return env.get(c.ENV_POD_IP) or None


def is_loopback(ip: str | None) -> bool:
    if not ip:
        return False
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def ray_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``RAY_AUTH_MODE=token`` when a token is given and the mode is not."""
    out = dict(env)
    if (out.get(RAY_AUTH_TOKEN) or out.get(RAY_AUTH_TOKEN_PATH)) and not out.get(RAY_AUTH_MODE):
        out[RAY_AUTH_MODE] = c.RAY_AUTH_MODE_TOKEN
    return out


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _common_args(env: Mapping[str, str]) -> list[str]:
    args = ["--block", "--disable-usage-stats"]
    ip = pod_ip(env)
    if ip:
        args.append(f"--node-ip-address={ip}")
    temp = env.get(c.ENV_RAY_TEMP_DIR)
    if temp:
        args.append(f"--temp-dir={temp}")
    return args


def _labels_arg(labels: Mapping[str, str]) -> str:
    return "--labels=" + ",".join(f"{k}={v}" for k, v in labels.items())


def ray_start_command(role: str, env: Mapping[str, str]) -> list[str]:
    """``ray start`` for a pod of ``role`` (head, rollout, learner, driver)."""
    argv = [_ray_bin(), "start", *_common_args(env)]
    if role == c.Role.HEAD:
        port = env.get("RLPACER_RAY_PORT", str(c.RAY_GCS_PORT))
        return [*argv, "--head", f"--port={port}", "--include-dashboard=false",
                f"--ray-client-server-port={c.RAY_CLIENT_PORT}",
                _labels_arg({LABEL_ROLE: role})]
    address = env.get(c.ENV_RAY_ADDRESS)
    if not address:
        raise TopologyError(f"environment variable {c.ENV_RAY_ADDRESS} is required for role "
                            f"{role}")
    argv.append(f"--address={address}")
    if role == c.Role.DRIVER:
        # nothing but the driver itself runs on the driver's node
        return [*argv, "--num-cpus=0", "--num-gpus=0", _labels_arg({LABEL_ROLE: role})]
    if role in (c.Role.ROLLOUT, c.Role.LEARNER):
        i = pod_index(env)
        return [*argv, f"--resources={json.dumps(node_resources(role, i))}",
                _labels_arg(node_labels(role, i))]
    raise TopologyError(f"role {role!r} runs no Ray node")


def driver_temp_dir(env: Mapping[str, str]) -> str:
    return env.get(c.ENV_RAY_TEMP_DIR) or "/tmp/ray"


@contextlib.contextmanager
def driver_node(env: Mapping[str, str], log: Path | None = None) -> Iterator[None]:
    """Run the driver pod's own Ray node while the context lasts (see the module docstring);
    nothing when the pod IP is loopback or unset (the driver then attaches to a node already
    on its host)."""
    ip = pod_ip(env)
    if ip is None or is_loopback(ip):
        yield
        return
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(ray_start_command(c.Role.DRIVER, env), env=ray_env(env),
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        time.sleep(0.5)
        if proc.poll() is not None:
            raise TopologyError(f"the driver's Ray node exited at once ({proc.returncode})")
        yield
    finally:
        # SIGTERM: `ray start --block` stops the raylet and the processes it started
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        if log:
            out.close()  # type: ignore[union-attr]


@contextlib.contextmanager
def attached(
    env: Mapping[str, str], runtime_env: Mapping[str, Any] | None = None,
    log: Path | None = None,
) -> Iterator[None]:
    """This process as the job's Ray driver at ``RAY_ADDRESS`` while the context lasts: token
    mode in its own environment, the pod's Ray node started (:func:`driver_node`), then
    ``ray.init`` on that node; ``ray.shutdown`` and the node stopped on exit."""
    import ray

    address = env.get(c.ENV_RAY_ADDRESS)
    if not address:
        raise TopologyError(f"environment variable {c.ENV_RAY_ADDRESS} is required to attach")
    _auth_in_this_process(env)
    with driver_node(env, log=log):
        kwargs: dict[str, Any] = dict(init_kwargs(env))
        if runtime_env is not None:
            kwargs["runtime_env"] = dict(runtime_env)
        ray.init(address=address, log_to_driver=False, **kwargs)
        try:
            yield
        finally:
            ray.shutdown()


def _auth_in_this_process(env: Mapping[str, str]) -> None:
    """The driver process itself talks to the GCS: give it the token mode too. Ray reads
    ``RAY_AUTH_MODE`` into its config when ``ray`` is imported, so a mode set later needs the
    config re-read (what Ray's own ``_enable_token_auth`` does after setting the env)."""
    auth = {k: v for k, v in ray_env(env).items() if k.startswith("RAY_AUTH_")}
    changed = auth.get(RAY_AUTH_MODE) != os.environ.get(RAY_AUTH_MODE)
    os.environ.update(auth)
    if changed and "ray._raylet" in sys.modules:
        from ray._raylet import Config  # type: ignore[attr-defined]

        Config.initialize("")


def init_kwargs(env: Mapping[str, str]) -> dict[str, str]:
    """Extra ``ray.init`` arguments that pick the driver's own node (by IP and temp dir)."""
    ip = pod_ip(env)
    if ip is None or is_loopback(ip):
        return {}
    return {"_node_ip_address": ip, "_temp_dir": driver_temp_dir(env)}
