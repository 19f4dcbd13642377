"""``rlpacer bench-scale``: what the operator costs as the number of jobs grows.

For each N of ``--jobs`` (e.g. ``10,25,50,100``, cumulative: the jobs of the smaller N stay),
N RLTrainingJobs run on many KWOK GPU nodes (rollout and learner pods ask for one
``nvidia.com/gpu`` each; every pod is played by KWOK), against the local control plane and
``rlpacer operator`` as a separate process, and the bench measures:

* **create to children applied**: a job is created (POST returned) until every child the
  operator makes exists (the two Secrets, the ConfigMap, the two Services, the three
  StatefulSets and the driver pod: first seen on the bench's own watches), and until its four
  pods run; p50/p99 over the jobs added at this N (they are created together, a burst);
* **reconcile lag**: at steady state, while every job reports (after the measured reporting
  window), the spec of a few jobs is changed one at a time, a second apart (``spec.steps``),
  and the time until ``status.observedGeneration`` says the operator acted on it is measured
  (p50/p99); also create to first status write;
* **step reports**: every job POSTs a report every ``--interval`` seconds (the trainer
  driver's call, over TLS) for ``--seconds``; round trip p50/p99 at the client;
* **the operator's cost**: RSS (``/proc/PID/status``) and CPU seconds per minute, and the API
  requests its own client makes (its ``rlpacer_kube_requests_total``), per job per minute,
  while the jobs report and while they are **idle** (no reports, ``--idle-seconds``): idle jobs
  must cost near zero requests (the operator watches; it does not poll);
* **the control plane's CPU**: the API server's and etcd's (and KWOK's, the controller
  manager's) CPU seconds per minute, and the API server's requests per minute from all its
  clients (``apiserver_request_total``).

Then a linear fit over N gives the per-job slopes, extrapolated to 1,000 jobs reporting once a
minute, against the targets of issue 17: per-job operator memory that puts 1,000 jobs under
1 GiB; idle jobs near zero API requests per minute; reconcile lag p99 under 1 s at the largest
N measured.

Where this machine stops (2 shared cores; the whole cluster, the operator and this load
generator on them): with N=10..100 jobs reporting every 5 s (load average 0.8-3.7), reports
answered in 17-30 ms at p50 and 36-148 ms at p99, reconcile lag p99 40-58 ms, and this bench's
processes used 6-26% of the machine; a report costs ~20 ms of CPU in all (API server 13-15 ms,
operator ~5 ms, etcd 1.5-2.5 ms), so two dedicated cores would saturate near 90 reports/s.
Creating jobs is the heavier part: a burst of 50 jobs (200 KWOK pods) took 22 s, the API server
then using 0.6 of a core, and its children p99 was 8.7 s. At N=200 (measured while other
processes kept the load average at 8-12) reports took seconds and a lag probe timed out: the
cores were taken, by the bench's 29% and everything else. Each row prints its load average and
the bench's busy fraction; rows above a load average of the core count are marked overloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import shlex
import ssl
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlpacer.bench.reports import (
    _cpu_seconds,
    _pct,
    _request_counts,
    bench_job,
    start_cluster,
)

#: Children the operator makes for each job, as (plural, name) from the job's name.
GPU_NODE_GPUS = 8
#: The targets of issue 17.
TARGET_MEMORY_1000_JOBS_MIB = 1024.0
TARGET_IDLE_REQUESTS_PER_JOB_MIN = 0.5
TARGET_RECONCILE_LAG_P99_S = 1.0
#: Resources the operator reads per operator or per namespace, not per job: its Lease, the
#: namespace's policies (a TTL cache), cluster policies and namespaces' labels.
SHARED = frozenset({"leases", "rltrainingpolicies", "clusterrltrainingpolicies", "namespaces"})
#: Fraction of the machine's CPU past which the figures measure a saturated machine.
SATURATED = 0.8


def scale_job(name: str, namespace: str) -> dict[str, Any]:
    """A job whose rollout and learner pods each want one GPU (they land on the KWOK GPU
    nodes, tolerating their taint); head and driver on the CPU nodes."""
    return bench_job(name, namespace, gpus=1)


def children_of(job: str) -> list[tuple[str, str]]:
    from rlpacer.api import contract
    from rlpacer.operator import names

    return [
        ("secrets", names.secret(job)),
        ("secrets", names.ray_secret(job)),
        ("configmaps", names.config_map(job)),
        ("services", names.head_service(job)),
        ("services", names.workers_service(job)),
        ("statefulsets", names.statefulset(job, contract.Role.HEAD)),
        ("statefulsets", names.statefulset(job, contract.Role.LEARNER)),
        ("statefulsets", names.statefulset(job, contract.Role.ROLLOUT)),
        ("pods", names.driver_pod(job, 0)),
    ]


#: pods of a running job: head, learner, rollout (StatefulSets) and the driver
PODS_PER_JOB = 4
GPUS_PER_JOB = 2


def nodes_for(max_jobs: int) -> list[Any]:
    """KWOK nodes for ``max_jobs`` jobs with headroom: GPU nodes of 8 GPUs for the rollout
    and learner pods, CPU nodes (110 pods each) for the heads and drivers."""
    from rlpacer.testing.cluster import NodeSpec

    gpu = math.ceil(max_jobs * GPUS_PER_JOB / GPU_NODE_GPUS) + 1
    cpu = math.ceil(max_jobs * (PODS_PER_JOB - GPUS_PER_JOB) / 100) + 1
    return ([NodeSpec(f"kwok-cpu-{i}") for i in range(cpu)]
            + [NodeSpec(f"kwok-gpu-{i}", cpu="96", memory="1Ti", gpus=GPU_NODE_GPUS,
                        instance_type="p5.48xlarge") for i in range(gpu)])


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


@dataclass
class Tracker:
    """When each job's children were first seen, its pods ran, and its status was first
    written: the bench's own watches (one per kind, label-selected), not polling."""

    kube: Any
    namespace: str
    seen: dict[tuple[str, str], float] = field(default_factory=dict)  # (plural, name)
    running: dict[str, float] = field(default_factory=dict)  # pod name -> first Running
    job_events: dict[str, list[tuple[float, str, int]]] = field(default_factory=dict)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self) -> None:
        from rlpacer.api import contract

        sel = f"{contract.LABEL_MANAGED_BY}={contract.MANAGED_BY}"
        ns = self.namespace
        ready = []
        for plural, api in (("secrets", "/api/v1"), ("configmaps", "/api/v1"),
                            ("services", "/api/v1"), ("pods", "/api/v1"),
                            ("statefulsets", "/apis/apps/v1"),
                            ("rltrainingjobs", "/apis/rlpacer.io/v1alpha1")):
            ev = asyncio.Event()
            ready.append(ev)
            path = f"{api}/namespaces/{ns}/{plural}"
            self.tasks.append(asyncio.create_task(
                self._watch(plural, path, None if plural == "rltrainingjobs" else sel, ev)))
        await asyncio.wait_for(asyncio.gather(*[e.wait() for e in ready]), 60)

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _see(self, plural: str, obj: dict[str, Any], kind: str) -> None:
        now = time.monotonic()
        meta = obj.get("metadata") or {}
        name = meta.get("name", "")
        self.seen.setdefault((plural, name), now)
        if plural == "pods" and (obj.get("status") or {}).get("phase") == "Running":
            self.running.setdefault(name, now)
        if plural == "rltrainingjobs":
            st = obj.get("status") or {}
            self.job_events.setdefault(name, []).append(
                (now, kind, int(st.get("observedGeneration") or 0)))

    async def _watch(self, plural: str, path: str, selector: str | None,
                     ready: asyncio.Event) -> None:
        import aiohttp

        params = {"labelSelector": selector} if selector else None
        while True:
            try:
                listing = await self.kube.request("GET", path, params=params)
                for item in listing.get("items") or []:
                    self._see(plural, item, "LISTED")
                rv = listing["metadata"]["resourceVersion"]
                ready.set()
                q = {"watch": "1", "resourceVersion": rv, "allowWatchBookmarks": "true",
                     "timeoutSeconds": "600", **(params or {})}
                session = self.kube._get_session()
                async with session.get(
                    self.kube.creds.server + path, params=q, headers=self.kube._headers(),
                    timeout=aiohttp.ClientTimeout(total=None, sock_read=700),
                ) as resp:
                    async for line in resp.content:
                        if not line.strip():
                            continue
                        ev = json.loads(line)
                        if ev.get("type") in ("ADDED", "MODIFIED"):
                            self._see(plural, ev["object"], ev["type"])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # relist
                print(f"bench watch {plural} restarts: {e!r}", file=sys.stderr, flush=True)
                await asyncio.sleep(0.5)

    def children_applied(self, job: str) -> float | None:
        times = [self.seen.get(c) for c in children_of(job)]
        return None if any(t is None for t in times) else max(t for t in times if t)

    def pods_running(self, job: str) -> float | None:
        pods = [p for p in self.running if p.startswith(job + "-")]
        return max(self.running[p] for p in pods) if len(pods) >= PODS_PER_JOB else None

    def first_status_write(self, job: str) -> float | None:
        for t, kind, _ in self.job_events.get(job, []):
            if kind == "MODIFIED":
                return t
        return None

    def observed(self, job: str, generation: int) -> float | None:
        for t, _, og in self.job_events.get(job, []):
            if og >= generation:
                return t
        return None


async def _wait_leader(port: int, deadline: float) -> None:
    """Until the operator's /readyz says it leads (its endpoints and metrics are up)."""
    import urllib.request

    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the operator did not become the leader (see its log)")
        await asyncio.sleep(0.3)


def _scrape_counter(port: int, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


@dataclass
class Window:
    """CPU, the operator's API requests and the API server's requests over a time window."""

    pids: dict[str, int]
    metrics_port: int
    kube: Any
    t0: float = 0.0
    cpu0: dict[str, float] = field(default_factory=dict)
    ops0: dict[tuple[tuple[str, str], ...], float] = field(default_factory=dict)
    api0: dict[str, float] = field(default_factory=dict)

    async def begin(self) -> None:
        self.ops0 = _scrape_counter(self.metrics_port, "rlpacer_kube_requests_total")
        self.api0 = await _request_counts(self.kube)
        self.cpu0 = _cpu_seconds(self.pids)
        self.t0 = time.monotonic()

    async def end(self) -> dict[str, Any]:
        cpu1 = _cpu_seconds(self.pids)
        minutes = (time.monotonic() - self.t0) / 60
        ops1 = _scrape_counter(self.metrics_port, "rlpacer_kube_requests_total")
        api1 = await _request_counts(self.kube)
        cpu = {k: (cpu1[k] - self.cpu0[k]) / minutes for k in cpu1.keys() & self.cpu0.keys()}
        ops: dict[str, float] = {}
        for k, v in ops1.items():
            lab = dict(k)
            key = f"{lab.get('verb')} {lab.get('resource')}"
            ops[key] = ops.get(key, 0.0) + (v - self.ops0.get(k, 0.0)) / minutes
        api = sum(api1.values()) - sum(self.api0.values())
        shared = sum(v for k, v in ops.items() if k.split(" ", 1)[1].split("/")[0] in SHARED)
        return {
            "minutes": minutes,
            "cpu_s_per_min": cpu,
            # the jobs' own resources (the job, its status, children, Events): what grows
            # with N; the rest (the Lease, the namespace's policies) is per operator
            "operator_requests_per_min": sum(ops.values()) - shared,
            "operator_shared_requests_per_min": shared,
            "operator_requests_by_kind": {k: round(v, 1) for k, v in sorted(
                ops.items(), key=lambda kv: -kv[1]) if v > 0.01},
            "apiserver_requests_per_min": api / minutes,
            # CPU of every process measured, as a fraction of the whole machine
            "machine_busy": sum(cpu.values()) / 60 / (os.cpu_count() or 1),
        }


async def _tokens(kube: Any, ns: str, names: list[str], deadline: float) -> dict[str, str]:
    from rlpacer.operator import names as child_names

    out: dict[str, str] = {}
    for n in names:
        while True:
            sec = await kube.get(f"/api/v1/namespaces/{ns}/secrets/{child_names.secret(n)}")
            if sec is not None:
                out[n] = base64.b64decode(sec["data"]["token"]).decode()
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the operator did not create the token Secret of {n}")
            await asyncio.sleep(0.5)
    return out


async def _probe_lag(kube: Any, tracker: Tracker, ns: str, names: list[str], probes: int,
                     spacing: float) -> list[float]:
    """Change the spec of ``probes`` jobs one at a time; seconds until the operator wrote a
    status with that generation observed (seen on the bench's job watch)."""
    from rlpacer.operator.runtime import job_path

    lags = []
    for i in range(probes):
        name = names[(i * 7919) % len(names)]
        obj = await kube.get(job_path(ns, name))
        steps = int(obj["spec"]["steps"]) - 1  # a real change: a new generation
        t0 = time.monotonic()
        out = await kube.request("PATCH", job_path(ns, name), {"spec": {"steps": steps}},
                                 content_type="application/merge-patch+json")
        gen = int(out["metadata"]["generation"])
        deadline = t0 + 30
        while time.monotonic() < deadline:
            t = tracker.observed(name, gen)
            if t is not None:
                lags.append(t - t0)
                break
            await asyncio.sleep(0.01)
        else:
            lags.append(float("inf"))
        await asyncio.sleep(spacing)
    return lags


async def _create_all(kube: Any, ns: str, names: list[str], created: dict[str, float]) -> None:
    """Create the jobs (8 requests at a time); when each POST returned, in ``created``."""
    sem = asyncio.Semaphore(8)

    async def create(name: str) -> None:
        async with sem:
            await kube.create(scale_job(name, ns))
            created[name] = time.monotonic()

    await asyncio.gather(*[create(x) for x in names])


async def _measure(kubeconfig: str, op: Any, ns: str, steps: list[int], interval: float,
                   seconds: float, idle_seconds: float, pids: dict[str, int],
                   settle_timeout: float) -> list[dict[str, Any]]:
    import aiohttp

    from rlpacer.bench.reports import _driver
    from rlpacer.operator.kube import Credentials, KubeClient
    from rlpacer.operator.main import freeze_startup_heap

    freeze_startup_heap()
    await _wait_leader(op.metrics_port, time.monotonic() + 120)
    kube = KubeClient(Credentials.load(kubeconfig))
    tracker = Tracker(kube, ns)
    await tracker.start()
    results: list[dict[str, Any]] = []
    names: list[str] = []
    tokens: dict[str, str] = {}
    conn = aiohttp.TCPConnector(limit=0, ssl=ssl.create_default_context(cafile=op.ca_file))
    async with aiohttp.ClientSession(connector=conn) as session:
        for n in steps:
            new = [f"scale-{i:04d}" for i in range(len(names), n)]
            print(f"N={n}: creating {len(new)} jobs", file=sys.stderr, flush=True)
            created: dict[str, float] = {}
            create_window = Window(pids, op.metrics_port, kube)
            await create_window.begin()
            await _create_all(kube, ns, new, created)
            names += new
            deadline = time.monotonic() + settle_timeout
            while time.monotonic() < deadline:
                if all(tracker.pods_running(x) is not None
                       and tracker.children_applied(x) is not None for x in new):
                    break
                await asyncio.sleep(0.5)
            create_cost = await create_window.end()
            missing = [x for x in new if tracker.pods_running(x) is None]
            children = [t - created[x] for x in new
                        if (t := tracker.children_applied(x)) is not None]
            running = [t - created[x] for x in new if (t := tracker.pods_running(x)) is not None]
            first_write = [t - created[x] for x in new
                           if (t := tracker.first_status_write(x)) is not None]
            tokens.update(await _tokens(kube, ns, new, time.monotonic() + 60))
            await asyncio.sleep(5.0)  # the creation burst's tail (pods' status updates)
            # reporting: every job every `interval` s, with reconcile-lag probes meanwhile
            print(f"N={n}: reporting every {interval:g}s for {seconds:.0f}s",
                  file=sys.stderr, flush=True)
            lat: list[float] = []
            errors: list[str] = []
            win = Window(pids, op.metrics_port, kube)
            await win.begin()
            until = time.monotonic() + seconds
            drivers = asyncio.gather(*[
                _driver(session, op.base_url, ns, x, tokens[x], 1.0 / interval, until, lat,
                        errors, i) for i, x in enumerate(names)])
            await asyncio.sleep(seconds)
            reporting = await win.end()
            reporting["rss_mib"] = _rss_mib(pids["operator"])
            oks = await drivers
            # reconcile lag, while the jobs go on reporting (not in the window above: each
            # spec change makes a pass that reads and applies, which is no report's cost)
            probes = max(3, min(10, n))
            until = time.monotonic() + probes * 1.0 + 5
            more: list[float] = []
            drivers = asyncio.gather(*[
                _driver(session, op.base_url, ns, x, tokens[x], 1.0 / interval, until, more,
                        errors, i) for i, x in enumerate(names)])
            lags = await _probe_lag(kube, tracker, ns, names, probes, spacing=1.0)
            await drivers
            # idle: the same jobs, no reports
            print(f"N={n}: idle for {idle_seconds:.0f}s", file=sys.stderr, flush=True)
            await asyncio.sleep(2.0)
            win = Window(pids, op.metrics_port, kube)
            await win.begin()
            await asyncio.sleep(idle_seconds)
            idle = await win.end()
            idle["rss_mib"] = _rss_mib(pids["operator"])
            res = {
                "jobs": n, "created": len(new), "not_running": len(missing),
                "children_applied_p50_s": _pct(children, 50),
                "children_applied_p99_s": _pct(children, 99),
                "pods_running_p50_s": _pct(running, 50),
                "pods_running_p99_s": _pct(running, 99),
                "first_status_write_p99_s": _pct(first_write, 99),
                "reconcile_lag_p50_s": _pct(lags, 50),
                "reconcile_lag_p99_s": _pct(lags, 99),
                "reconcile_lag_probes": len(lags),
                "reports": sum(oks), "report_errors": len(errors),
                "report_p50_ms": _pct(lat, 50) * 1000, "report_p99_ms": _pct(lat, 99) * 1000,
                "create": create_cost, "reporting": reporting, "idle": idle,
                "load_average": os.getloadavg()[0],
            }
            results.append(res)
            _print_row(res, interval)
            for e in errors[:5]:
                print("   report error:", e, file=sys.stderr, flush=True)
    await tracker.stop()
    await kube.close()
    return results


def _print_row(r: dict[str, Any], interval: float) -> None:
    rep, idle = r["reporting"], r["idle"]
    n = r["jobs"]
    print(f"N={n}: children {r['children_applied_p50_s']:.2f}/{r['children_applied_p99_s']:.2f}"
          f" s, running {r['pods_running_p50_s']:.2f}/{r['pods_running_p99_s']:.2f} s,"
          f" lag {r['reconcile_lag_p50_s']:.2f}/{r['reconcile_lag_p99_s']:.2f} s, report"
          f" {r['report_p50_ms']:.1f}/{r['report_p99_ms']:.1f} ms, rss {idle['rss_mib']:.0f}"
          f" MiB, operator req/job/min {rep['operator_requests_per_min'] / n:.2f} reporting"
          f" {idle['operator_requests_per_min'] / n:.2f} idle {idle['operator_requests_by_kind']},"
          f" busy {rep['machine_busy']:.2f}, load {r['load_average']:.2f}",
          file=sys.stderr, flush=True)


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares (slope, intercept); slope 0 with one point."""
    pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y == y]
    if len(pts) < 2:
        return 0.0, (pts[0][1] if pts else float("nan"))
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0
    return slope, my - slope * mx


def summarize(results: list[dict[str, Any]], interval: float) -> dict[str, Any]:
    """Per-job slopes over N and the extrapolation to 1,000 jobs reporting once a minute."""
    ns = [float(r["jobs"]) for r in results]

    def col(f: Any) -> list[float]:
        return [float(f(r)) for r in results]

    rss_slope, rss_base = _fit(ns, col(lambda r: r["idle"]["rss_mib"]))
    idle_req, _ = _fit(ns, col(lambda r: r["idle"]["operator_requests_per_min"]))
    rep_req, _ = _fit(ns, col(lambda r: r["reporting"]["operator_requests_per_min"]))
    op_cpu_rep, _ = _fit(
        ns, col(lambda r: r["reporting"]["cpu_s_per_min"].get("operator", 0.0)))
    op_cpu_idle, op_idle_base = _fit(
        ns, col(lambda r: r["idle"]["cpu_s_per_min"].get("operator", 0.0)))
    api_cpu_rep, _ = _fit(
        ns, col(lambda r: r["reporting"]["cpu_s_per_min"].get("apiserver", 0.0)))
    etcd_cpu_rep, _ = _fit(
        ns, col(lambda r: r["reporting"]["cpu_s_per_min"].get("etcd", 0.0)))

    def per_answer(f: Any) -> float:
        """(reporting minus idle) over the reports answered in the window, mean over N (a
        job of a loaded machine reports less often than every interval)."""
        xs = [f(r["reporting"]) - f(r["idle"]) for r in results]
        return statistics.fmean(max(0.0, x) * r["reporting"]["minutes"] / max(1, r["reports"])
                                for x, r in zip(xs, results, strict=True))

    per_report = {
        "operator_requests": per_answer(lambda w: w["operator_requests_per_min"]),
        "operator_cpu_ms": 1000 * per_answer(lambda w: w["cpu_s_per_min"].get("operator", 0)),
        "apiserver_cpu_ms": 1000 * per_answer(lambda w: w["cpu_s_per_min"].get("apiserver", 0)),
        "etcd_cpu_ms": 1000 * per_answer(lambda w: w["cpu_s_per_min"].get("etcd", 0)),
    }
    k = 1000.0
    memory_1000 = rss_base + rss_slope * k
    largest = max(results, key=lambda r: r["jobs"])
    cpus = os.cpu_count() or 1
    saturated = [r["jobs"] for r in results if r["reporting"]["machine_busy"] >= SATURATED]
    # the load average counts every process of the machine, others' too (a shared machine)
    overloaded = [r["jobs"] for r in results if r["load_average"] > cpus]
    return {
        "slopes_per_job": {
            "operator_rss_mib": rss_slope,
            "operator_requests_per_min_idle": idle_req,
            "operator_requests_per_min_reporting": rep_req,
            "operator_cpu_s_per_min_reporting": op_cpu_rep,
            "operator_cpu_s_per_min_idle": op_cpu_idle,
            "apiserver_cpu_s_per_min_reporting": api_cpu_rep,
            "etcd_cpu_s_per_min_reporting": etcd_cpu_rep,
        },
        "per_report": per_report,
        "at_1000_jobs_1_report_per_min": {
            "operator_rss_mib": memory_1000,
            "operator_requests_per_min": k * (idle_req + per_report["operator_requests"]),
            "operator_cpu_cores": (op_idle_base + k * op_cpu_idle
                                   + k * per_report["operator_cpu_ms"] / 1000) / 60,
            "status_writes_per_s": k / 60,
            "apiserver_cpu_cores_from_reports": k / 60 * per_report["apiserver_cpu_ms"] / 1000,
            "etcd_cpu_cores_from_reports": k / 60 * per_report["etcd_cpu_ms"] / 1000,
        },
        "targets": {
            f"operator memory at 1,000 jobs < {TARGET_MEMORY_1000_JOBS_MIB:.0f} MiB":
                memory_1000 < TARGET_MEMORY_1000_JOBS_MIB,
            f"idle API requests per job-minute < {TARGET_IDLE_REQUESTS_PER_JOB_MIN}":
                all(r["idle"]["operator_requests_per_min"] / r["jobs"]
                    < TARGET_IDLE_REQUESTS_PER_JOB_MIN for r in results),
            f"reconcile lag p99 < {TARGET_RECONCILE_LAG_P99_S:g} s at N={largest['jobs']}":
                largest["reconcile_lag_p99_s"] < TARGET_RECONCILE_LAG_P99_S,
        },
        "saturated_at": saturated,
        "overloaded_at": overloaded,
    }


def _table(results: list[dict[str, Any]], summary: dict[str, Any], interval: float) -> str:
    head = ("N", "child p50", "child p99", "run p99", "lag p50", "lag p99", "rep p50",
            "rep p99", "RSS MiB", "op cpu s/m", "req/job/m rep", "req/job/m idle",
            "api cpu s/m", "etcd cpu s/m", "busy")
    rows = []

    def cpu(w: dict[str, Any], name: str, digits: int) -> str:
        return f"{w['cpu_s_per_min'].get(name, 0):.{digits}f}"

    for r in results:
        rep, idle, n = r["reporting"], r["idle"], r["jobs"]
        rows.append((
            str(n), f"{r['children_applied_p50_s']:.2f}s", f"{r['children_applied_p99_s']:.2f}s",
            f"{r['pods_running_p99_s']:.2f}s", f"{r['reconcile_lag_p50_s']:.3f}s",
            f"{r['reconcile_lag_p99_s']:.3f}s", f"{r['report_p50_ms']:.1f}ms",
            f"{r['report_p99_ms']:.1f}ms", f"{idle['rss_mib']:.1f}",
            f"{cpu(rep, 'operator', 2)}/{cpu(idle, 'operator', 2)}",
            f"{rep['operator_requests_per_min'] / n:.2f}",
            f"{idle['operator_requests_per_min'] / n:.2f}",
            f"{cpu(rep, 'apiserver', 1)}/{cpu(idle, 'apiserver', 1)}",
            f"{cpu(rep, 'etcd', 1)}/{cpu(idle, 'etcd', 1)}",
            f"{rep['machine_busy']:.2f}"))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.append(f"(child: create to children applied; run: to all {PODS_PER_JOB} pods Running;"
                 f" lag: spec change to status.observedGeneration; rep: step report every"
                 f" {interval:g}s per job; cpu columns: reporting/idle CPU seconds per minute)")
    s, x = summary["slopes_per_job"], summary["at_1000_jobs_1_report_per_min"]
    lines.append(
        f"per job: RSS {s['operator_rss_mib'] * 1024:.0f} KiB; operator API requests/min"
        f" {s['operator_requests_per_min_idle']:.3f} idle,"
        f" {s['operator_requests_per_min_reporting']:.2f} reporting; operator CPU"
        f" {s['operator_cpu_s_per_min_reporting']:.3f} s/min reporting,"
        f" {s['operator_cpu_s_per_min_idle']:.4f} idle; API server CPU"
        f" {s['apiserver_cpu_s_per_min_reporting']:.3f} s/min, etcd"
        f" {s['etcd_cpu_s_per_min_reporting']:.3f} s/min (reporting)")
    pr = summary["per_report"]
    lines.append(
        f"per report: {pr['operator_requests']:.2f} operator API requests; CPU: operator"
        f" {pr['operator_cpu_ms']:.2f} ms, API server {pr['apiserver_cpu_ms']:.2f} ms, etcd"
        f" {pr['etcd_cpu_ms']:.2f} ms")
    lines.append(
        f"1,000 jobs x 1 report/min: operator RSS {x['operator_rss_mib']:.0f} MiB,"
        f" {x['operator_requests_per_min']:.0f} API requests/min"
        f" ({x['status_writes_per_s']:.1f} status writes/s), operator"
        f" {x['operator_cpu_cores']:.2f} cores, API server"
        f" {x['apiserver_cpu_cores_from_reports']:.2f} and etcd"
        f" {x['etcd_cpu_cores_from_reports']:.2f} cores for the reports")
    for t, ok in summary["targets"].items():
        lines.append(f"target {t}: {'met' if ok else 'NOT met'}")
    sat, over = summary["saturated_at"], summary["overloaded_at"]
    lines.append(
        f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} now, per N"
        f" {[round(r['load_average'], 1) for r in results]}; busy (this cluster, operator and"
        f" load generator) per N {[round(r['reporting']['machine_busy'], 2) for r in results]}")
    if sat:
        lines.append(f"saturated by this bench (busy >= {SATURATED}) at N={sat}: figures there"
                     " measure the queue of a saturated machine")
    if over:
        lines.append(f"overloaded (load average above {os.cpu_count()}: other processes"
                     f" compete for the cores) at N={over}: latencies there are the machine's")
    if not sat and not over:
        lines.append(f"neither saturated nor overloaded up to N={max(r['jobs'] for r in results)}")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    from rlpacer.bench.reports import install, start_operator

    steps = sorted({int(x) for x in str(args.jobs).split(",") if x.strip()})
    if not steps or steps[0] < 1:
        raise SystemExit("--jobs: a comma-separated list of job counts, e.g. 10,25,50,100")
    cluster, etcd_flags = start_cluster(args.etcd_fsync, nodes_for(steps[-1]))
    op = None
    try:
        kubeconfig = str(cluster.kubeconfig)
        install(kubeconfig, args.namespace)
        op = start_operator(kubeconfig, args.namespace, shlex.split(args.operator_args))
        print(f"operator log {op.log}; {len(cluster.nodes)} KWOK nodes", file=sys.stderr,
              flush=True)
        # the load generator too: its drivers' TLS and JSON are CPU on the same cores
        pids = {"operator": op.proc.pid, **cluster.pids(), "bench": os.getpid()}
        results = asyncio.run(_measure(kubeconfig, op, args.namespace, steps, args.interval,
                                       args.seconds, args.idle_seconds, pids,
                                       args.settle_timeout))
    finally:
        if op is not None:
            op.stop()
        cluster.stop()
    summary = summarize(results, args.interval)
    out = {"interval_s": args.interval, "seconds": args.seconds,
           "operator_args": args.operator_args,
           "idle_seconds": args.idle_seconds, "nodes": len(cluster.nodes),
           "etcd": etcd_flags, "cpus": os.cpu_count(),
           "load_average": os.getloadavg()[0], "results": results, **summary}
    table = _table(results, summary, args.interval)
    if args.json:
        print(json.dumps(out, indent=2, default=_json_default))
        print(table, file=sys.stderr)
    else:
        print(table)
    return 0 if all(summary["targets"].values()) else 1


def _json_default(x: Any) -> Any:
    return None if isinstance(x, float) and not math.isfinite(x) else str(x)
