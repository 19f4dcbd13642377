"""``rlpacer bench-operator``: step-report round trip under load, against a real control plane.

What it measures: N jobs, each with a client that plays the trainer's driver, POST a step
report every ``1/rate`` seconds (the G the previous plan gave, lengths drawn so that SAGC
moves); the round trip is timed at the client. Every answer is sent by the operator only after
the new controller state is in etcd (the status PUT returned), and at the end the bench checks
that each job's persisted ``status.step`` equals the reports it got answers for.

Set-up: the local control plane (``rlpacer.testing.cluster``) with etcd on an ordinary data
directory on disk *with* fsync (the test fixture's ``--unsafe-no-fsync`` is turned off here;
the flags are printed), the CRDs from ``crds/``, and the operator as a separate process
(``rlpacer operator``) so the load generator does not share its event loop. ``--kubeconfig``
uses an existing cluster instead (then etcd's flags are that cluster's).

Rounds: ``--rounds`` alternations of a baseline (the same status writes made directly against
the API server, without the operator, in the operator's form: a PUT answered with the job's
metadata only), a short warm-up and the measured load; p50/p99 pool
every round's answers, and each round's p99 is printed beside its baseline's. On a small
shared machine the API server's own tail moves a lot from minute to minute, so a single short
run says little.

The floor, also measured in each round: a step-report endpoint that does nothing but what no
operator can skip (:func:`serve_floor`, its own process: the report received over the same
TLS, the job's status PUT, the answer; no validation, no controller, no metrics). Its
p50/p99 over the bare status write is the best ratio this machine allows the operator: on 2
shared cores the extra TLS hop alone took 1.22-1.30x at p50.

The status write's answer, also measured (sequential writes, before the rounds): a plain PUT
is answered with the whole job; the operator asks for its metadata only (the new
resourceVersion is all it needs), which spares the API server encoding and the operator
parsing the object on every report. Both forms' p50 and the API server's CPU per write are
printed (``status_write_answer``).

Where the time goes, also printed: the operator's own histograms over the measured windows (a
report's handling time and the status PUT inside it), the CPU each process used per answered
report (the local control plane's processes, the operator, and the floor's process per
floor answer; on 2 cores the API server's ~14 ms per status write is most of it), and with
``--trace FILE`` every timed request as CSV (start time, latency, phase, job) to line slow ones
up with the components' logs.
``RLPACER_CLUSTER_PROFILING=1`` turns on the local API server's /debug/pprof.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


#: The operator's histograms the bench reads: a step report's handling time (POST, 200) and
#: the status PUT inside it.
_HISTOGRAMS = {
    "report": ("rlpacer_step_report_duration_seconds", {"code": "200", "route": "steps"}),
    "status_write": ("rlpacer_status_write_duration_seconds", {"result": "ok"}),
}

Histo = dict[str, Any]  # {"buckets": {le: cumulative count}, "sum": seconds, "count": n}


def _scrape(metrics_port: int) -> dict[str, Histo]:
    """The operator's histograms now (cumulative since it started)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    families = {f.name: f for f in text_string_to_metric_families(text)}
    out: dict[str, Histo] = {}
    for key, (name, labels) in _HISTOGRAMS.items():
        h: Histo = {"buckets": {}, "sum": 0.0, "count": 0.0}
        fam = families.get(name)
        for sample in fam.samples if fam is not None else []:
            lab = dict(sample.labels)
            le = lab.pop("le", None)
            if lab != labels:
                continue
            if sample.name == name + "_bucket" and le is not None:
                h["buckets"][float(le)] = sample.value
            elif sample.name == name + "_sum":
                h["sum"] = sample.value
            elif sample.name == name + "_count":
                h["count"] = sample.value
        out[key] = h
    return out


def _add_window(acc: dict[str, Histo], before: dict[str, Histo], after: dict[str, Histo]) -> None:
    """Add the observations made between two scrapes to ``acc``."""
    for key, a in after.items():
        b = before.get(key) or {"buckets": {}, "sum": 0.0, "count": 0.0}
        t = acc.setdefault(key, {"buckets": {}, "sum": 0.0, "count": 0.0})
        for le, n in a["buckets"].items():
            t["buckets"][le] = t["buckets"].get(le, 0.0) + n - b["buckets"].get(le, 0.0)
        t["sum"] += a["sum"] - b["sum"]
        t["count"] += a["count"] - b["count"]


def _summarize(h: Histo) -> dict[str, float] | None:
    """count, mean and p50/p99 (interpolated within buckets) of a histogram."""
    if not h.get("count"):
        return None
    out = {"count": h["count"], "mean_ms": round(h["sum"] / h["count"] * 1000, 2)}
    for q in (50, 99):
        out[f"p{q}_ms"] = round(_bucket_quantile(h["buckets"], h["count"] * q / 100) * 1000, 1)
    return out


def _bucket_quantile(buckets: dict[float, float], rank: float) -> float:
    lo, below = 0.0, 0.0
    for le in sorted(buckets):
        n = buckets[le]
        if n >= rank:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * ((rank - below) / (n - below) if n > below else 1.0)
        lo, below = le, n
    return lo


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User+system CPU seconds used so far by each process (Linux /proc; {} elsewhere)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


@dataclass(frozen=True)
class Sample:
    """One timed request, for ``--trace``: when it started (Unix time), how long it took."""

    start: float
    seconds: float
    phase: str  # "operator" (a step report), "floor" (to serve_floor) or "baseline"
    job: str


def write_trace(path: str, samples: list[Sample]) -> None:
    with open(path, "w") as f:
        f.write("start_unix,latency_ms,phase,job\n")
        for x in sorted(samples, key=lambda x: x.start):
            f.write(f"{x.start:.4f},{x.seconds * 1000:.2f},{x.phase},{x.job}\n")


def bench_job(name: str, namespace: str, gpus: int = 0) -> dict[str, Any]:
    """A long-running job for the benches (``gpus`` per rollout and learner replica)."""
    return {
        "apiVersion": "rlpacer.io/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"source": "builtin://tiny-adder"},
            "data": {"source": "builtin://adder"},
            "steps": 1_000_000,
            "promptsPerStep": 16,
            "rollout": {"replicas": 1, "gpusPerReplica": gpus, "maxResponseTokens": 1024},
            "trainer": {"replicas": 1, "gpusPerReplica": gpus},
            "groupControl": {"stragglerRatio": "4"},
            "tailBatching": {"enabled": False},
        },
    }


async def _driver(
    session: Any, base: str, ns: str, name: str, token: str, rate: float, until: float,
    lat: list[float], errors: list[str], seed: int, trace: list[Sample] | None = None,
    phase: str = "operator",
) -> int:
    from rlpacer.api.protocol import plan_path, steps_path

    hdr = {"Authorization": f"Bearer {token}"}
    rng = random.Random(seed)
    async with session.get(base + plan_path(ns, name), headers=hdr) as r:
        plan = await r.json()
    step, g, ok = plan["step"], plan["groupSize"], 0
    period = 1.0 / rate
    next_t = time.monotonic() + rng.random() * period  # spread the jobs' phases
    while True:
        await asyncio.sleep(max(0.0, next_t - time.monotonic()))
        if time.monotonic() >= until:
            return ok
        next_t += period
        straggle = rng.random() < (0.1 if g <= 4 else 0.5)
        med = 100.0
        body = {
            "attempt": 0, "step": step, "groupSize": g, "roundKind": "Short",
            "lengths": {"max": int(med * (8 if straggle else 2)), "median": med, "p90": med * 1.5,
                        "count": 16 * g},
            "seconds": {"rollout": 60.0, "train": 20.0}, "longQueue": 0,
            "nextRoundKind": "Short",
        }
        t0 = time.perf_counter()
        try:
            async with session.post(base + steps_path(ns, name), json=body, headers=hdr) as r:
                out = await r.json()
                dt = time.perf_counter() - t0
                if r.status != 200:
                    errors.append(f"{name} step {step}: {r.status} {out}")
                    continue
        except Exception as e:  # count and go on
            errors.append(f"{name} step {step}: {e!r}")
            continue
        lat.append(dt)
        if trace is not None:
            trace.append(Sample(time.time() - dt, dt, phase, name))
        ok += 1
        step, g = out["step"], out["groupSize"]


async def _load(kubeconfig: str, base_url: str, ns: str, names: list[str], rate: float,
                seconds: float, warmup: float, settle: float, rounds: int,
                trace: list[Sample] | None = None,
                pids: dict[str, int] | None = None,
                metrics_port: int | None = None,
                ca_file: str | None = None,
                floor_url: str | None = None,
                floor_pid: dict[str, int] | None = None) -> dict[str, Any]:
    import ssl

    import aiohttp

    from rlpacer.operator import names as child_names
    from rlpacer.operator.kube import Credentials, KubeClient
    from rlpacer.operator.main import freeze_startup_heap
    from rlpacer.operator.runtime import job_path

    freeze_startup_heap()  # the load generator's own GC pauses would be timed as latency
    kube = KubeClient(Credentials.load(kubeconfig))
    tokens: dict[str, str] = {}
    deadline = time.monotonic() + 120
    for n in names:
        while True:
            sec = await kube.get(f"/api/v1/namespaces/{ns}/secrets/{child_names.secret(n)}")
            if sec is not None:
                tokens[n] = base64.b64decode(sec["data"]["token"]).decode()
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the operator did not create the token Secret of {n}")
            await asyncio.sleep(0.2)
    # Settle: every job admitted and its pods created, so the measurement sees a steady
    # control plane rather than the creation burst of 50 jobs' children.
    settle_deadline = time.monotonic() + 180
    while time.monotonic() < settle_deadline:
        pods = await kube.request("GET", f"/api/v1/namespaces/{ns}/pods")
        running = sum(1 for p in pods.get("items", [])
                      if (p.get("status") or {}).get("phase") == "Running")
        if running >= 4 * len(names):  # head, learner, rollout, driver
            break
        await asyncio.sleep(1.0)
    print(f"pods running; settling {settle:.0f}s", file=sys.stderr, flush=True)
    await asyncio.sleep(settle)  # let controllers and caches of a fresh cluster go quiet
    answers = await _answer_ab(kube, ns, names[0], pids or {})
    start_step = {}
    for n in names:  # jobs may be reused from an earlier run on the same cluster
        obj = await kube.get(job_path(ns, n))
        start_step[n] = int(((obj or {}).get("status") or {}).get("step") or 0)
    # Rounds of (baseline, warm-up, measured load): the baseline and the operator are measured
    # alternately, so both see the same state of a noisy machine.
    base_s = min(15.0, seconds / 2)
    lat: list[float] = []
    baseline: list[float] = []
    floor: list[float] = []
    floor_errors: list[str] = []
    floor_cpu = 0.0
    floor_pid = floor_pid or {}
    per_round: list[dict[str, float]] = []
    errors: list[str] = []
    answered = [0] * len(names)
    # Over TLS, as drivers report. Connections are kept alive: a driver makes one call per
    # step, so its handshake per call is noise next to a step; the bench times the operator.
    conn = aiohttp.TCPConnector(
        limit=0, ssl=ssl.create_default_context(cafile=ca_file) if ca_file else False)
    before: dict[str, float] = {}
    after: dict[str, float] = {}
    cpu: dict[str, float] = {}  # CPU seconds by process over the measured windows
    histos: dict[str, Histo] = {}  # the operator's histograms over the measured windows
    async with aiohttp.ClientSession(connector=conn) as session:
        for rnd in range(rounds):
            print(f"round {rnd + 1}/{rounds}: baseline (direct status writes) {base_s:.0f}s",
                  file=sys.stderr, flush=True)
            base = await _baseline(kube, ns, names, rate, base_s, trace)
            if floor_url is not None:
                print(f"round {rnd + 1}/{rounds}: the floor (TLS hop + the status PUT only)"
                      f" {base_s:.0f}s", file=sys.stderr, flush=True)
                fl: list[float] = []
                until = time.monotonic() + base_s
                f0 = _cpu_seconds(floor_pid)
                await asyncio.gather(*[
                    _driver(session, floor_url, ns, n, tokens[n], rate, until, fl,
                            floor_errors, i, trace, phase="floor")
                    for i, n in enumerate(names)
                ])
                floor += fl
                f1 = _cpu_seconds(floor_pid)
                if "floor" in f0 and "floor" in f1:
                    floor_cpu += f1["floor"] - f0["floor"]
            w = warmup if rnd == 0 else min(warmup, 3.0)
            print(f"round {rnd + 1}/{rounds}: warm-up {w:.0f}s, measuring {seconds:.0f}s",
                  file=sys.stderr, flush=True)
            until = time.monotonic() + w
            warm: list[float] = []
            oks = await asyncio.gather(*[
                _driver(session, base_url, ns, n, tokens[n], rate, until, warm, errors, i)
                for i, n in enumerate(names)
            ])
            until = time.monotonic() + seconds
            if rnd == 0:
                before = await _request_counts(kube)
            cpu0 = _cpu_seconds(pids or {})
            h0 = _scrape(metrics_port) if metrics_port else {}
            rl: list[float] = []
            oks2 = await asyncio.gather(*[
                _driver(session, base_url, ns, n, tokens[n], rate, until, rl, errors, i, trace)
                for i, n in enumerate(names)
            ])
            cpu1 = _cpu_seconds(pids or {})
            if metrics_port:
                _add_window(histos, h0, _scrape(metrics_port))
            for k in cpu1.keys() & cpu0.keys():
                cpu[k] = cpu.get(k, 0.0) + cpu1[k] - cpu0[k]
            if rnd == 0:
                after = await _request_counts(kube)
            answered = [a + o + o2 for a, o, o2 in zip(answered, oks, oks2, strict=True)]
            lat += rl
            baseline += base
            per_round.append({"p99_ms": round(_pct(rl, 99) * 1000, 2),
                              "baseline_p99_ms": round(_pct(base, 99) * 1000, 2)})
            print(f"round {rnd + 1}/{rounds}: p99 {per_round[-1]['p99_ms']} ms, baseline p99 "
                  f"{per_round[-1]['baseline_p99_ms']} ms", file=sys.stderr, flush=True)
    # every answered report is persisted: status.step == answered reports
    mismatched = []
    for n, ok in zip(names, answered, strict=True):
        obj = await kube.get(job_path(ns, n))
        st = (obj or {}).get("status") or {}
        if st.get("step") != start_step[n] + ok:
            mismatched.append(f"{n}: status.step={st.get('step')} answered={start_step[n]}"
                              f"+{ok}")
    await kube.close()
    return {"latencies": lat, "errors": errors, "answered": len(lat), "mismatched": mismatched,
            "baseline": baseline, "floor": floor, "floor_errors": floor_errors,
            "floor_cpu": floor_cpu, "answers": answers,
            "rounds": per_round, "cpu": cpu,
            "server": {k: _summarize(h) for k, h in histos.items()},
            "apiserver_requests_per_s": _rate_diff(before, after, seconds)}


async def _answer_ab(kube: Any, ns: str, name: str, pids: dict[str, int],
                     writes: int = 150, rounds: int = 3) -> dict[str, Any]:
    """The status write answered with the whole object (a plain PUT) against one answered
    with metadata only (:func:`put_status`, the operator's): ``writes`` sequential writes of
    each, alternated ``rounds`` times; p50 latency and the API server's CPU per write."""
    from rlpacer.operator.runtime import job_path

    lat: dict[str, list[float]] = {"object": [], "metadata": []}
    cpu = {"object": 0.0, "metadata": 0.0}
    obj = await kube.request("GET", job_path(ns, name))
    for _ in range(rounds):
        for kind in ("object", "metadata"):
            c0 = _cpu_seconds(pids).get("apiserver", 0.0)
            for _ in range(writes):
                body = status_write(obj)
                t0 = time.perf_counter()
                if kind == "object":
                    obj = await kube.request("PUT", job_path(ns, name) + "/status", body)
                else:
                    obj = await put_status(kube, body)
                lat[kind].append(time.perf_counter() - t0)
            cpu[kind] += _cpu_seconds(pids).get("apiserver", 0.0) - c0
    n = writes * rounds
    out: dict[str, Any] = {f"{k}_p50_ms": round(_pct(v, 50) * 1000, 2) for k, v in lat.items()}
    out["ratio_p50"] = _ratio(_pct(lat["metadata"], 50), _pct(lat["object"], 50))
    if "apiserver" in pids:
        out |= {f"apiserver_cpu_ms_{k}": round(v / n * 1000, 2) for k, v in cpu.items()}
    return out


async def _request_counts(kube: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        text = await kube.get_text("/metrics")
    except Exception:
        return out
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels, value = line.rsplit(" ", 1)
        lab = dict(kv.split("=", 1) for kv in labels[len("apiserver_request_total{"):-1]
                   .split(","))
        key = " ".join(x.strip('"') for x in (lab.get("verb", ""), lab.get("group", ""),
                                              lab.get("resource", ""),
                                              lab.get("subresource", "")) if x.strip('"'))
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _rate_diff(a: dict[str, float], b: dict[str, float], seconds: float) -> dict[str, float]:
    d = {k: (v - a.get(k, 0.0)) / seconds for k, v in b.items()}
    return dict(sorted(((k, round(v, 1)) for k, v in d.items() if v > 0.05),
                       key=lambda kv: -kv[1])[:8])


def status_write(obj: dict[str, Any]) -> dict[str, Any]:
    """The baseline's status write of the job ``obj`` as last read: its status with
    ``longQueue`` + 1 (a real change), under a resourceVersion precondition. Made as the
    operator makes its writes (:func:`put_status`)."""
    status = dict(obj.get("status") or {})
    status["longQueue"] = int(status.get("longQueue", 0)) + 1
    meta = obj["metadata"]
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"],
            "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                         "resourceVersion": meta["resourceVersion"]},
            "status": status}


async def put_status(kube: Any, body: dict[str, Any]) -> dict[str, Any]:
    """PUT the status write ``body`` answered with metadata only, as the operator writes a
    status (``Jobs.commit``); returns the job as stored (``body`` at the new
    resourceVersion)."""
    from rlpacer.operator.kube import METADATA_ONLY
    from rlpacer.operator.runtime import job_path

    meta = body["metadata"]
    got = await kube.request("PUT", job_path(meta["namespace"], meta["name"]) + "/status",
                             body, accept=METADATA_ONLY)
    return {**body, "metadata": {**meta,
                                 "resourceVersion": got["metadata"]["resourceVersion"]}}


async def _baseline(kube: Any, ns: str, names: list[str], rate: float,
                    seconds: float, trace: list[Sample] | None = None) -> list[float]:
    """The control plane alone: the same status writes (one per job per period, with a
    resourceVersion precondition) made directly, without the operator. The operator's own
    cost is the difference."""
    from rlpacer.operator.runtime import job_path

    lat: list[float] = []
    until = time.monotonic() + seconds

    async def one(n: str, seed: int) -> None:
        rng = random.Random(seed)
        obj = await kube.request("GET", job_path(ns, n))
        period = 1.0 / rate
        next_t = time.monotonic() + rng.random() * period
        while True:
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))
            if time.monotonic() >= until:
                return
            next_t += period
            body = status_write(obj)
            t0 = time.perf_counter()
            try:
                obj = await put_status(kube, body)
            except Exception:
                obj = await kube.request("GET", job_path(ns, n))
                continue
            dt = time.perf_counter() - t0
            lat.append(dt)
            if trace is not None:
                trace.append(Sample(time.time() - dt, dt, "baseline", n))

    await asyncio.gather(*[one(n, i) for i, n in enumerate(names)])
    return lat


def serve_floor(kubeconfig: str, cert_dir: str, port: int) -> None:
    """The floor of a step report: an endpoint (own process, over TLS with ``cert_dir``'s
    certificate) that answers ``GET plan`` with step 0 and each ``POST steps`` after one
    status PUT of the job, the baseline's write (``longQueue`` + 1 on the status as last
    read; the object is read again on each ``GET plan`` and after a conflict). No token,
    validation, controller or metrics: what is left is what no operator can skip."""
    import ssl

    from aiohttp import web

    from rlpacer.api.protocol import plan_path, steps_path
    from rlpacer.operator.kube import Credentials, KubeClient
    from rlpacer.operator.main import freeze_startup_heap
    from rlpacer.operator.runtime import job_path

    async def main() -> None:
        kube = KubeClient(Credentials.load(kubeconfig))
        objs: dict[str, Any] = {}

        async def plan(request: web.Request) -> web.Response:
            ns, n = request.match_info["namespace"], request.match_info["name"]
            objs[n] = await kube.request("GET", job_path(ns, n))
            return web.json_response({"step": 0, "groupSize": 8})

        async def steps(request: web.Request) -> web.Response:
            ns, n = request.match_info["namespace"], request.match_info["name"]
            report = json.loads(await request.read())
            for _ in range(3):
                obj = objs.get(n) or await kube.request("GET", job_path(ns, n))
                try:
                    objs[n] = await put_status(kube, status_write(obj))
                except Exception:  # a conflict: read it again, as an operator would
                    objs.pop(n, None)
                    continue
                return web.json_response({"step": int(report["step"]) + 1, "groupSize": 8})
            return web.json_response({"reason": "Conflict"}, status=503)

        app = web.Application()
        app.router.add_get(plan_path("{namespace}", "{name}"), plan)
        app.router.add_post(steps_path("{namespace}", "{name}"), steps)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(f"{cert_dir}/tls.crt", f"{cert_dir}/tls.key")
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, ssl_context=ctx).start()
        await asyncio.Event().wait()

    freeze_startup_heap()  # as the operator does
    asyncio.run(main())


def start_floor(kubeconfig: str, cert_dir: str) -> tuple[subprocess.Popen[bytes], str]:
    """:func:`serve_floor` as its own process; returns it and its base URL once it serves."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from rlpacer.bench.reports import serve_floor;"
         " serve_floor(sys.argv[1], sys.argv[2], int(sys.argv[3]))", kubeconfig, cert_dir,
         str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"https://127.0.0.1:{port}"
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the bench's floor endpoint did not start")
        time.sleep(0.2)


@dataclass
class OperatorProcess:
    """``rlpacer operator`` started by a bench: its process, endpoint and metrics port."""

    proc: subprocess.Popen[bytes]
    base_url: str
    metrics_port: int
    ca_file: str
    log: Path

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def start_cluster(etcd_fsync: bool, nodes: Any = None) -> tuple[Any, str]:
    """The local control plane (etcd on disk, fsync as asked) and the etcd flags, printed."""
    from rlpacer.testing.cluster import DEFAULT_NODES, LocalCluster

    data = Path(tempfile.mkdtemp(prefix="rlpacer-bench-", dir=os.environ.get("TMPDIR")))
    no_fsync = "false" if etcd_fsync else "true"
    cluster = LocalCluster(data, nodes=DEFAULT_NODES if nodes is None else nodes,
                           extra_args={"etcd": [f"--unsafe-no-fsync={no_fsync}"]})
    print(f"starting the local control plane in {data} ...", file=sys.stderr, flush=True)
    cluster.start()
    flags = (f"--data-dir={data / 'etcd'} (disk), --unsafe-no-fsync={no_fsync},"
             " --auto-compaction-mode=periodic --auto-compaction-retention=5m,"
             " --quota-backend-bytes=4294967296")
    return cluster, flags


def install(kubeconfig: str, namespace: str) -> None:
    """The CRDs from crds/ (Established), the bench namespace and the operator's."""
    kubectl = ["kubectl", "--kubeconfig", kubeconfig]
    subprocess.run([*kubectl, "apply", "--server-side", "-f", str(ROOT / "crds")],
                   check=True, capture_output=True)
    subprocess.run([*kubectl, "wait", "--for=condition=Established", "--timeout=60s",
                    "crd/rltrainingjobs.rlpacer.io"], check=True, capture_output=True)
    subprocess.run([*kubectl, "create", "namespace", namespace], capture_output=True)
    subprocess.run([*kubectl, "create", "namespace", "rlpacer-system"], capture_output=True)


def start_operator(kubeconfig: str, namespace: str,
                   extra: list[str] | None = None) -> OperatorProcess:
    """``rlpacer operator`` as its own process (the load generator does not share its event
    loop), serving reports over TLS; ``RLPACER_BENCH_PROFILE=FILE`` runs it under cProfile.
    ``extra``: more of its flags (e.g. ``--resync-seconds 3``)."""
    from rlpacer.operator import tls

    port = _free_port()
    metrics_port = _free_port()
    certs = tls.generate(Path(tempfile.mkdtemp(prefix="rlpacer-bench-tls-")),
                         ["127.0.0.1"], days=1)
    log = Path(tempfile.mkstemp(prefix="rlpacer-bench-operator-", suffix=".log")[1])
    proc = subprocess.Popen(
        [sys.executable,
         *(["-m", "cProfile", "-o", os.environ["RLPACER_BENCH_PROFILE"]]
           if os.environ.get("RLPACER_BENCH_PROFILE") else []),
         "-m", "rlpacer.cli", "operator", "--report-port", str(port),
         "--metrics-port", str(metrics_port), "--namespaces", namespace,
         "--report-cert-dir", str(certs),
         "--operator-namespace", "rlpacer-system", "--log-level", "WARNING", *(extra or [])],
        env={**os.environ, "KUBECONFIG": kubeconfig}, stdout=log.open("w"),
        stderr=subprocess.STDOUT)
    return OperatorProcess(proc, f"https://127.0.0.1:{port}", metrics_port,
                           str(certs / "ca.crt"), log)


def run_from_args(args: argparse.Namespace) -> int:
    cluster = None
    etcd_flags = "(external cluster: see its etcd)"
    if args.kubeconfig:
        kubeconfig = args.kubeconfig
    else:
        cluster, etcd_flags = start_cluster(args.etcd_fsync)
        kubeconfig = str(cluster.kubeconfig)
    op = None
    floor_proc = None
    try:
        install(kubeconfig, args.namespace)
        names = [f"bench-{i:03d}" for i in range(args.jobs)]
        docs = "\n---\n".join(json.dumps(bench_job(n, args.namespace)) for n in names)
        subprocess.run(["kubectl", "--kubeconfig", kubeconfig, "apply", "-f", "-"],
                       input=docs.encode(), check=True, capture_output=True)
        op = start_operator(kubeconfig, args.namespace)
        floor_proc, floor_url = start_floor(kubeconfig, str(Path(op.ca_file).parent))
        print(f"{args.jobs} jobs, {args.rate}/s each, {args.seconds:.0f}s; operator log"
              f" {op.log}", file=sys.stderr, flush=True)
        trace: list[Sample] | None = [] if args.trace else None
        pids = {"operator": op.proc.pid, **(cluster.pids() if cluster is not None else {})}
        res = asyncio.run(_load(kubeconfig, op.base_url, args.namespace, names, args.rate,
                                args.seconds, args.warmup, args.settle, args.rounds, trace,
                                pids, op.metrics_port, op.ca_file, floor_url,
                                {"floor": floor_proc.pid}))
        if args.trace and trace is not None:
            write_trace(args.trace, trace)
    finally:
        if floor_proc is not None:
            floor_proc.kill()
            floor_proc.wait()
        if op is not None:
            op.stop()
        if cluster is not None:
            cluster.stop()
    lat = res["latencies"]
    base_lat = res["baseline"]
    out = {
        "jobs": args.jobs, "rate_per_job": args.rate, "seconds": args.seconds,
        "rounds": args.rounds,
        "answered": res["answered"], "errors": len(res["errors"]),
        "throughput_per_s": round(res["answered"] / (args.seconds * args.rounds), 1),
        "p50_ms": round(_pct(lat, 50) * 1000, 2),
        "p90_ms": round(_pct(lat, 90) * 1000, 2),
        "p99_ms": round(_pct(lat, 99) * 1000, 2),
        "max_ms": round(max(lat) * 1000, 2) if lat else None,
        "mean_ms": round(statistics.fmean(lat) * 1000, 2) if lat else None,
        # The operator's own view (its histograms over the measured windows): a report's
        # handling time and the status PUT inside it; the difference is the operator's time.
        "operator_report_ms": res["server"].get("report"),
        "operator_status_write_ms": res["server"].get("status_write"),
        # CPU per answered report over the measured windows, by process (the API server's
        # share is the cost of the status write; the operator's is everything else it does).
        "cpu_ms_per_report": {k: round(v / max(1, res["answered"]) * 1000, 2)
                              for k, v in sorted(res["cpu"].items(), key=lambda kv: -kv[1])},
        "baseline_status_put_p50_ms": round(_pct(base_lat, 50) * 1000, 2),
        "baseline_status_put_p99_ms": round(_pct(base_lat, 99) * 1000, 2),
        "p99_ms_per_round": [r["p99_ms"] for r in res["rounds"]],
        "baseline_p99_ms_per_round": [r["baseline_p99_ms"] for r in res["rounds"]],
        # The operator's report over the bare status write of the same API server, in the
        # same run (the floor is 1.0: a report is answered after its status is persisted).
        "ratio_p50": _ratio(_pct(lat, 50), _pct(base_lat, 50)),
        "ratio_p99": _ratio(_pct(lat, 99), _pct(base_lat, 99)),
        "ratio_target": f"p50 <= {RATIO_TARGET_P50}x, p99 <= {RATIO_TARGET_P99}x",
        "ratio_met": _ratio_met(lat, base_lat),
        # The floor: an endpoint doing only the TLS hop and the status PUT (serve_floor),
        # over the same bare status write; the operator's ratio cannot go below it here.
        "floor_p50_ms": round(_pct(res["floor"], 50) * 1000, 2),
        "floor_p99_ms": round(_pct(res["floor"], 99) * 1000, 2),
        "floor_answered": len(res["floor"]),
        "floor_errors": len(res["floor_errors"]),
        "floor_ratio_p50": _ratio(_pct(res["floor"], 50), _pct(base_lat, 50)),
        "floor_ratio_p99": _ratio(_pct(res["floor"], 99), _pct(base_lat, 99)),
        # CPU of the floor's process per answer, beside the operator's in cpu_ms_per_report
        "floor_cpu_ms_per_report": round(res["floor_cpu"] / max(1, len(res["floor"])) * 1000,
                                         2),
        # The status write answered with the whole object (a plain PUT) vs with metadata
        # only (the operator's and the baseline's), sequential, before the rounds.
        "status_write_answer": res["answers"],
        "load_average": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "persisted_mismatches": len(res["mismatched"]),
        "apiserver_requests_per_s": res["apiserver_requests_per_s"],
        "etcd": etcd_flags,
        "target": "p99 < 100 ms",
        "met": bool(lat) and _pct(lat, 99) < 0.1 and not res["mismatched"],
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:>26}: {v}")
        for e in (res["errors"] + res["mismatched"])[:10]:
            print("  ", e)
    print(f"report / bare status write: p50 {out['p50_ms']} / {out['baseline_status_put_p50_ms']}"
          f" ms = {out['ratio_p50']}x (target <= {RATIO_TARGET_P50}x), p99 {out['p99_ms']} /"
          f" {out['baseline_status_put_p99_ms']} ms = {out['ratio_p99']}x (target <="
          f" {RATIO_TARGET_P99}x): {'met' if out['ratio_met'] else 'NOT met'}; the floor (TLS hop"
          f" + the status PUT only) p50 {out['floor_p50_ms']} ms = {out['floor_ratio_p50']}x,"
          f" p99 {out['floor_p99_ms']} ms = {out['floor_ratio_p99']}x; load average"
          f" {out['load_average']} on {out['cpus']} CPUs", file=sys.stderr, flush=True)
    return 0 if out["met"] else 1


#: Targets of the report round trip over the bare status write (issue 17).
RATIO_TARGET_P50 = 1.2
RATIO_TARGET_P99 = 1.3


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if a == a and b == b and b > 0 else None  # NaN: no samples


def _ratio_met(lat: list[float], base: list[float]) -> bool:
    r50, r99 = _ratio(_pct(lat, 50), _pct(base, 50)), _ratio(_pct(lat, 99), _pct(base, 99))
    return r50 is not None and r99 is not None and r50 <= RATIO_TARGET_P50 \
        and r99 <= RATIO_TARGET_P99
