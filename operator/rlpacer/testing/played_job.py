"""A job's pods on played hosts with a played operator: one long round, elastic or not.

Each pod of the job (a Ray head, a learner, rollout-0, rollout-1 when the long round scales
up, the driver) runs ``python3 -m rlpacer_trainer.pod`` on a host of its own
(:class:`rlpacer.testing.netns.TestHosts`: its own network namespace, address, hostname and
PID namespace), and a played operator (:mod:`rlpacer.testing.plan_server`) answers the
step-report protocol with the real plan logic and a rollout capacity of 1 replica, scaled to
2 for each long round (``elastic``) or kept at 1 (``single``). As a kubelet would, rollout-1's
pod is started when the operator scales up and deleted (its whole host) when it scales down.

:func:`run_long_round` is what ``tests/e2e/test_elastic_long_round_hosts.py`` checks and what
``rlpacer bench-long-round`` times. Needs root (network namespaces) and vLLM.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlpacer.api import contract
from rlpacer.testing import netns
from rlpacer.testing.cluster import repo_root
from rlpacer.testing.netns import TestHosts

JOB, NS = "elastic", "team-a"
HEAD_SVC = f"{JOB}-head.{NS}.svc"
PORT = 8080
EXAMPLE = "examples/tiny-local.yaml"

#: What the command line of an engine's process contains (its Ray actor's name).
ENGINE_PROCESS = "VLLMEngine"

#: The pods of the job and their roles (rollout-1 only plays while a long round is scaled up).
PODS: dict[str, contract.Role] = {
    "head": contract.Role.HEAD, "learner-0": contract.Role.LEARNER,
    "rollout-0": contract.Role.ROLLOUT, "rollout-1": contract.Role.ROLLOUT,
    "rollout-2": contract.Role.ROLLOUT, "driver": contract.Role.DRIVER,
}


def write_manifest(path: Path, *, replicas: int = 1, steps: int = 3, prompts: int = 4,
                   max_tokens: int | None = None, lead_s: int = 0,
                   one_deferred: bool | None = None, wide: bool = False,
                   mid_round: bool = False, release: bool = False,
                   fill: int | None = None) -> None:
    """The tiny example job: ``prompts`` per step and twice as many raced for their places
    (the slowest half deferred), so step 1 is a long round on ``longRound.rolloutReplicas``
    = 2. ``lead_s`` > 0 (early scale-up, ``scaleUpLeadSeconds``) or ``one_deferred``: one
    prompt more than ``prompts`` raced, so each short round defers one and the long round is
    step ``prompts``; with the lead, the report after step 0 forecasts it and asks for its
    replica then. ``wide``: the long round's replica is a wide engine of its own
    (``longRound.tensorParallelSize`` 1, as on a CPU), which runs the long round alone.
    ``mid_round``: ``longRound.joinMidRound`` (the long round starts at once; rollout-1's
    engine joins during it and takes a share of its unfinished requests). ``release``:
    ``longRound.releaseWhenFits``. ``fill``: ``longRound.fillPrompts`` (with ``wide``, the
    fill runs on rollout-0 beside the wide engine)."""
    if one_deferred is None:
        one_deferred = lead_s > 0
    doc = yaml.safe_load((repo_root() / EXAMPLE).read_text())
    spec = doc["spec"]
    spec["rollout"]["replicas"] = replicas
    if max_tokens is not None:
        spec["rollout"]["maxResponseTokens"] = max_tokens
    spec["tailBatching"]["longRound"]["rolloutReplicas"] = 2
    spec["tailBatching"]["promptOverprovision"] = (str((prompts + 1) / prompts) if one_deferred
                                                   else "2")
    spec["tailBatching"]["longRound"]["scaleUpLeadSeconds"] = lead_s
    if wide:
        spec["tailBatching"]["longRound"]["tensorParallelSize"] = 1
    if mid_round:
        spec["tailBatching"]["longRound"]["joinMidRound"] = True
    if release:
        spec["tailBatching"]["longRound"]["releaseWhenFits"] = True
    if fill is not None:
        spec["tailBatching"]["longRound"]["fillPrompts"] = fill
    spec["tailBatching"]["activation"] = "Always"  # race every short round (step 1 long)
    spec["algorithm"]["dynamicSampling"] = False
    spec["steps"] = steps
    spec["promptsPerStep"] = prompts
    spec["checkpoint"]["everySteps"] = 10
    path.write_text(yaml.safe_dump(doc))


@dataclass
class PlayedJob:
    """The hosts, the played operator and the pods of one job under ``tmp``."""

    tmp: Path
    hosts: TestHosts = field(default_factory=TestHosts)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.logs = self.tmp / "logs"
        self.state = self.tmp / "state"
        self.ckpt = self.tmp / "checkpoints"
        for d in (self.logs, self.state):
            d.mkdir(parents=True, exist_ok=True)
        (self.tmp / "report-token").write_text("job-token\n")
        self.temp_root = Path(f"/tmp/{self.hosts.tag}")
        python = sys.executable
        self.python = python
        self.base_env = {
            "PATH": f"{Path(python).parent}:/usr/sbin:/usr/bin:/sbin:/bin",
            "RAY_AUTH_TOKEN": secrets.token_hex(32), "PYTHONUNBUFFERED": "1",
            "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }

    def __enter__(self) -> PlayedJob:
        self.hosts.start()
        try:
            for name in [*PODS, "operator"]:
                self.hosts.add(name)
            self.hosts.alias("head", HEAD_SVC, f"{HEAD_SVC}.cluster.local")
        except BaseException:
            self.hosts.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.hosts.close()
        finally:
            shutil.rmtree(self.temp_root, ignore_errors=True)

    def start_operator(self, mode: str) -> None:
        out = open(self.logs / "operator.log", "wb")  # noqa: SIM115
        self.hosts.popen(
            "operator",
            [self.python, "-m", "rlpacer.testing.plan_server", str(self.tmp / "job.yaml"),
             self.hosts.address("operator"), str(PORT), str(self.state), mode],
            env={**self.base_env, "HOME": str(self.tmp)}, stdout=out, stderr=subprocess.STDOUT)

    def start(self, name: str, temp: str | None = None) -> subprocess.Popen[bytes]:
        """Starts pod ``name`` (``python3 -m rlpacer_trainer.pod``) on its played host."""
        role = PODS[name]
        ray_temp = self.temp_root / (temp or name)
        home = self.tmp / "home" / ray_temp.name
        home.mkdir(parents=True)
        env = {
            **self.base_env, "HOME": str(home),
            contract.ENV_JOB: JOB, contract.ENV_NAMESPACE: NS,
            contract.ENV_ROLE: role.value, contract.ENV_POD_IP: self.hosts.address(name),
            contract.ENV_RAY_TEMP_DIR: str(ray_temp),
            contract.ENV_RANK: name.rsplit("-", 1)[-1] if "-" in name else "0",
        }
        if role is not contract.Role.HEAD:
            env[contract.ENV_RAY_ADDRESS] = f"{HEAD_SVC}:{contract.RAY_GCS_PORT}"
        if role is contract.Role.DRIVER:
            env |= {contract.ENV_CONFIG: str(self.tmp / "job.yaml"),
                    contract.ENV_CHECKPOINT_DIR: str(self.ckpt),
                    contract.ENV_ATTEMPT: "0",
                    contract.ENV_REPORT_URL: f"http://{self.hosts.address('operator')}:{PORT}",
                    contract.ENV_TOKEN_FILE: str(self.tmp / "report-token")}
        out = open(self.logs / f"{ray_temp.name}.log", "wb")  # noqa: SIM115
        proc = self.hosts.popen(name, [self.python, "-m", contract.POD_ENTRYPOINT_MODULE],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start_head(self) -> None:
        head = self.start("head")
        netns.wait_port(self.hosts.address("head"), contract.RAY_GCS_PORT, head, 90)

    def delete(self, name: str) -> None:
        """The pod deleted: every process on its host killed."""
        proc = self.procs.pop(name)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def wait_file(self, name: str, procs: Mapping[str, subprocess.Popen[bytes]] | None = None,
                  timeout: float = 600) -> bool:
        """Waits for ``state/name``; False when a watched pod exits first or on timeout."""
        watched = self.procs if procs is None else procs
        path = self.state / name
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return True
            if any(p.poll() is not None for p in watched.values()):
                return False
            time.sleep(0.3)
        return False

    def wait_driver(self, timeout: float = 600) -> int:
        try:
            return self.procs["driver"].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.procs["driver"].kill()
            return -1

    def host_cpu(self, name: str, match: str | None = None) -> dict[int, float]:
        """CPU seconds (user + system) used so far by each process alive on host ``name``
        (in its network namespace), by pid; with ``match``, only processes whose command line
        contains it (Ray names an actor's process after its class: ``ray::VLLMEngine...``)."""
        inode = self.hosts.hosts[name].netns_inode()
        tick = os.sysconf("SC_CLK_TCK")
        out: dict[int, float] = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if os.stat(d / "ns" / "net").st_ino != inode:
                    continue
                if match is not None and match not in (d / "cmdline").read_bytes().decode(
                        errors="replace"):
                    continue
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            out[int(d.name)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        return out

    def host_cpu_seconds(self, name: str, match: str | None = None) -> float:
        return sum(self.host_cpu(name, match).values())

    def wait_log(self, pod: str, text: str, timeout: float = 300) -> bool:
        """Waits until ``text`` is in pod ``pod``'s log; False if it exits first or on timeout."""
        path = self.logs / f"{pod}.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and text in path.read_text(errors="replace"):
                return True
            if self.procs[pod].poll() is not None:
                return False
            time.sleep(0.2)
        return False

    def logs_text(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in sorted(self.logs.iterdir()))

    def records(self) -> list[dict[str, Any]]:
        path = self.ckpt / "metrics-attempt0.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()]


class PlayedJobFailed(AssertionError):
    """The played job did not finish; the message carries every pod's log tail."""


@dataclass
class LongRoundRun:
    """What :func:`run_long_round` saw."""

    records: list[dict[str, Any]]
    driver_log: str
    #: Played host name -> (address, network-namespace inode).
    hosts: dict[str, tuple[str, int]]
    #: Seconds from the operator's scale-up (rollout-1's pod created) to the long round's end.
    scaled_seconds: float | None = None
    #: CPU seconds the engine process on rollout-1's host (seen from outside it, sampled until
    #: the driver ended it) had used over its life: its start, its weights, its share of the
    #: long round.
    added_cpu_seconds: float | None = None


def run_long_round(tmp: Path, mode: str = "elastic", *, steps: int = 3, prompts: int = 4,
                   max_tokens: int | None = None, lead_s: int | None = None,
                   step_sleep_s: float = 0.0, fill: int | None = None,
                   release_when_fits: bool = False) -> LongRoundRun:
    """Runs the tiny job (:func:`write_manifest`) on played hosts to its end. ``elastic``:
    rollout-1's pod is created when the operator scales up for the long round and deleted
    when it scales down; ``early``: as ``elastic`` with an early scale-up (a 60 s lead: the
    report after step 0 asks for rollout-1, the long round is step 4); ``single``: the long
    round runs on rollout-0 alone; ``timeout-gap``: the scale-up to 3 brings up only
    rollout-2 and times out (usable [0, 2]); ``wide``: as ``elastic``, rollout-1 a wide
    long-round engine (``longRound.tensorParallelSize``), the long round routed to it alone;
    ``midround``: as ``elastic`` with ``longRound.joinMidRound`` (the long round does not wait
    for rollout-1: its engine joins during the round); ``release``: as ``elastic`` with
    ``longRound.releaseWhenFits`` (rollout-1 given back before the step's report).
    ``lead_s`` (``elastic`` or ``early``): that
    lead on the early mode's schedule (one prompt deferred a round), e.g. 0 for the same
    schedule without the early scale-up. ``step_sleep_s``: every engine step made that much
    longer (the testing setting ``RLPACER_TEST_ENGINE_STEP_SLEEP_S``: rounds as long against
    an engine's start as on GPUs). ``fill``: ``longRound.fillPrompts``;
    ``release_when_fits``: ``longRound.releaseWhenFits`` in any mode."""
    if mode not in ("elastic", "early", "single", "timeout-gap", "wide", "midround", "release"):
        raise ValueError(f"mode {mode!r}: expected elastic, early, single, timeout-gap, wide,"
                         " midround or release")
    tmp.mkdir(parents=True, exist_ok=True)
    lead = lead_s if lead_s is not None else (60 if mode == "early" else 0)
    write_manifest(tmp / "job.yaml", steps=steps, prompts=prompts, max_tokens=max_tokens,
                   lead_s=lead, one_deferred=mode == "early" or lead_s is not None,
                   wide=mode == "wide", mid_round=mode == "midround",
                   release=mode == "release" or release_when_fits, fill=fill)
    if mode in ("wide", "midround", "release"):
        mode = "elastic"  # the same pods and operator; the job routes its rounds
    with PlayedJob(tmp) as job:
        if step_sleep_s:
            job.base_env["RLPACER_TEST_ENGINE_STEP_SLEEP_S"] = str(step_sleep_s)
        job.start_operator("elastic" if mode == "early" else mode)
        job.start_head()
        for name in ("learner-0", "rollout-0", "driver"):
            job.start(name)
        scaled_at: float | None = None
        if mode in ("elastic", "early"):
            # the operator scales up for the long round: rollout-1's pod starts only now
            if not job.wait_file("scale-up"):
                raise PlayedJobFailed("no long round:\n" + job.logs_text())
            job.start("rollout-1")
            scaled_at = time.monotonic()
            (job.state / "rollout-1-ready").write_text("1")
        elif mode == "timeout-gap":
            # a scale-up to 3 where only ordinal 2 comes up: once its Ray node has joined,
            # the operator times out and keeps it (1 stays pending, never used)
            if not job.wait_file("scale-up"):
                raise PlayedJobFailed("no long round:\n" + job.logs_text())
            job.start("rollout-2")
            if not job.wait_log("rollout-2", "Ray runtime started"):
                raise PlayedJobFailed("rollout-2 never joined Ray:\n" + job.logs_text())
            (job.state / "rollout-2-ready").write_text("1")
        # the long round done: the operator scales back down and the pod goes. Meanwhile the
        # engine process on rollout-1's host is watched from outside (the driver ends it
        # before the report that scales down): its CPU seconds as last seen.
        seen: dict[int, float] = {}
        deadline = time.monotonic() + 600
        while not (job.state / "scale-down").exists():
            if job.procs["driver"].poll() is not None or time.monotonic() > deadline:
                raise PlayedJobFailed("the long round never ended:\n" + job.logs_text())
            if mode in ("elastic", "early"):
                seen.update(job.host_cpu("rollout-1", ENGINE_PROCESS))
            time.sleep(0.2)
        scaled = None if scaled_at is None else time.monotonic() - scaled_at
        added_cpu = None
        if mode in ("elastic", "early"):
            added_cpu = float(sum(seen.values()))
            job.delete("rollout-1")
        elif mode == "timeout-gap":
            job.delete("rollout-2")
        rc = job.wait_driver()
        if rc != 0:
            raise PlayedJobFailed(f"driver exited {rc}:\n" + job.logs_text())
        return LongRoundRun(
            records=job.records(),
            driver_log=(job.logs / "driver.log").read_text(errors="replace"),
            hosts={n: (job.hosts.address(n), job.hosts.hosts[n].netns_inode()) for n in PODS},
            scaled_seconds=scaled, added_cpu_seconds=added_cpu)
