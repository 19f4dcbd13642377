"""The Ray topology across played hosts: every pod its own network namespace.

A Ray head, a rollout node (index 1) and a learner node are started by the pod entrypoint
(``rlpacer_trainer.pod``), each in a host of its own (:class:`rlpacer.testing.netns.TestHosts`:
network, UTS and PID namespaces, so no process sees another host's addresses or processes),
with the job's Ray token as the operator gives it to every pod (``RAY_AUTH_MODE=token`` and
``RAY_AUTH_TOKEN_PATH``: each host its own copy of the file, as each pod mounts the job's
Ray-token Secret; with and without a trailing newline) and no shared home (so no host can
fall back on ``~/.ray/auth_token``).
A driver on a fourth host attaches the way a driver pod does (``topology.attached``: its own
``--num-cpus=0`` node) and places an actor with the rollout-1 resource; the actor must run on
the rollout host: its address and network namespace are the rollout host's, not the driver's.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlpacer.api import contract
from rlpacer.testing import netns
from rlpacer.testing.netns import TestHosts

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

JOB, NS = "topo", "team-a"
HEAD_SVC = f"{JOB}-head.{NS}.svc"

DRIVER = textwrap.dedent("""
    import json, os, socket, sys, time
    import ray
    from rlpacer_trainer import topology

    head_ip = sys.argv[1]

    def where():
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect((head_ip, 9))  # UDP: picks the outgoing address, sends nothing
        ip = s.getsockname()[0]
        s.close()
        return {"ip": ip, "netns": os.stat("/proc/self/ns/net").st_ino,
                "hostname": socket.gethostname(),
                "hostname_ip": socket.gethostbyname(socket.gethostname())}

    @ray.remote(num_cpus=0)
    class Probe:
        def where(self):
            return where()

    with topology.attached(dict(os.environ)):
        want = topology.pod_resource("rollout", 1)
        # every node registered (the learner may join after the rollout node)
        needed = {want, topology.pod_resource("learner", 0)}
        deadline = time.monotonic() + 60
        while not needed <= set(ray.cluster_resources()) and time.monotonic() < deadline:
            time.sleep(0.5)
        nodes = [{"ip": n["NodeManagerAddress"], "labels": n.get("Labels", {}),
                  "resources": n["Resources"]} for n in ray.nodes() if n["Alive"]]
        actor = Probe.options(resources={want: 0.01}).remote()
        out = {"actor": ray.get(actor.where.remote(), timeout=60), "driver": where(),
               "nodes": nodes}
    print("RESULT " + json.dumps(out), flush=True)
""")


def _leftovers(tag: str) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found = [line for line in (ns + links).splitlines() if tag in line]
    etc = Path("/etc/netns")
    if etc.is_dir():
        found += [p.name for p in etc.iterdir() if p.name.startswith(tag)]
    return found


def test_leftovers_of_dead_runs_are_removed() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid now names a run that is gone
    tag = netns.tag_for(dead.pid, 0)
    subprocess.run(["ip", "netns", "add", f"{tag}-head"], check=True)
    subprocess.run(["ip", "link", "add", f"{tag}b", "type", "bridge"], check=True)
    (Path("/etc/netns") / f"{tag}-head").mkdir(parents=True)
    try:
        with TestHosts() as hosts:
            hosts.add("a")
            assert _leftovers(tag) == []
            assert hosts.run("a", ["hostname"]).stdout.strip() == "a"
        assert _leftovers(hosts.tag) == []
    finally:
        subprocess.run(["ip", "netns", "del", f"{tag}-head"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{tag}b"], capture_output=True)
        shutil.rmtree(Path("/etc/netns") / f"{tag}-head", ignore_errors=True)


@pytest.mark.slow
def test_actor_lands_on_the_pod_it_asks_for(tmp_path: Path) -> None:
    token = secrets.token_hex(32)
    logs = tmp_path / "logs"
    logs.mkdir()
    hosts = TestHosts()
    # short: Ray's unix sockets live under the temp dir (108-character limit)
    temp_root = Path(f"/tmp/{hosts.tag}")
    started = time.monotonic()
    try:
        with hosts:
            for name in ("head", "rollout", "learner", "driver"):
                hosts.add(name)
            hosts.alias("head", HEAD_SVC, f"{HEAD_SVC}.cluster.local")
            python = sys.executable

            def env(host: str, role: str, **extra: str) -> dict[str, str]:
                home = tmp_path / "home" / host
                home.mkdir(parents=True, exist_ok=True)
                # the pod's mounted Ray-token Secret (a file of its own; some end in "\n")
                token_file = tmp_path / "ray-token" / host / "token"
                token_file.parent.mkdir(parents=True, exist_ok=True)
                token_file.write_text(token + ("\n" if host in ("head", "learner") else ""))
                out = {
                    "PATH": str(Path(python).parent) + ":/usr/sbin:/usr/bin:/sbin:/bin",
                    "HOME": str(home),
                    contract.ENV_RAY_AUTH_MODE: contract.RAY_AUTH_MODE_TOKEN,
                    contract.ENV_RAY_AUTH_TOKEN_PATH: str(token_file),
                    "RAY_USAGE_STATS_ENABLED": "0",
                    "OMP_NUM_THREADS": "1",
                    contract.ENV_JOB: JOB,
                    contract.ENV_NAMESPACE: NS,
                    contract.ENV_ROLE: role,
                    contract.ENV_POD_IP: hosts.address(host),
                    contract.ENV_RAY_TEMP_DIR: str(temp_root / host),
                }
                if role != contract.Role.HEAD:
                    out[contract.ENV_RAY_ADDRESS] = f"{HEAD_SVC}:{contract.RAY_GCS_PORT}"
                out.update(extra)
                return out

            def start(host: str, role: str, **extra: str) -> subprocess.Popen[bytes]:
                log = open(logs / f"{host}.log", "wb")  # noqa: SIM115
                return hosts.popen(host, [python, "-m", contract.POD_ENTRYPOINT_MODULE],
                                   env=env(host, role, **extra), stdout=log,
                                   stderr=subprocess.STDOUT)

            head = start("head", contract.Role.HEAD)
            netns.wait_port(hosts.address("head"), contract.RAY_GCS_PORT, head, 60)
            start("rollout", contract.Role.ROLLOUT, **{contract.ENV_RANK: "1"})
            start("learner", contract.Role.LEARNER, **{contract.ENV_RANK: "0"})
            script = tmp_path / "driver.py"
            script.write_text(DRIVER)
            drv = hosts.popen("driver", [python, str(script), hosts.address("head")],
                              env=env("driver", contract.Role.DRIVER),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            try:
                out, _ = drv.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                drv.kill()
                out, _ = drv.communicate()
            text = out.decode(errors="replace")
            lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
            assert drv.returncode == 0 and lines, (
                f"driver failed ({drv.returncode}):\n{text[-4000:]}\n"
                + "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                            for p in logs.iterdir()))
            res = json.loads(lines[-1][len("RESULT "):])
            print(json.dumps(res, indent=1))  # shown by pytest when an assertion below fails
            rollout, driver = hosts.hosts["rollout"], hosts.hosts["driver"]
            assert res["actor"]["ip"] == rollout.address
            assert res["actor"]["netns"] == rollout.netns_inode()
            assert res["driver"]["ip"] == driver.address
            assert res["driver"]["netns"] == driver.netns_inode()
            assert res["actor"]["ip"] != res["driver"]["ip"]
            # the host's own name resolves to its address inside it (/etc/netns hosts file)
            assert res["actor"]["hostname"] == "rollout"
            assert res["actor"]["hostname_ip"] == rollout.address
            assert res["actor"]["netns"] != res["driver"]["netns"]
            by_ip = {n["ip"]: n for n in res["nodes"]}
            assert set(by_ip) == {hosts.address(h)
                                  for h in ("head", "rollout", "learner", "driver")}
            assert by_ip[rollout.address]["labels"].get("rlpacer.io/role") == "rollout"
            assert by_ip[rollout.address]["labels"].get("rlpacer.io/rank") == "1"
            assert by_ip[hosts.address("learner")]["resources"].get("rlpacer.io/learner-0") == 1
            # the driver's node offers nothing to schedule on
            assert by_ip[driver.address]["resources"].get("CPU", 0) == 0
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)
    assert _leftovers(hosts.tag) == []
    assert time.monotonic() - started < 120
