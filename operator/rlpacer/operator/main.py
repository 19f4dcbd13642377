"""``rlpacer operator``: Kopf, the step-report endpoint and /metrics in one process.

Start order: the HTTP servers first (``/healthz`` answers, ``/readyz`` says standby, reports
get 503), then the Lease; once leading, Kopf starts (its watches start the per-job reconcile
loops, which load each job's state from its status) and the report endpoint accepts reports.
If the Lease is lost the process stops acting and exits with status 1 (the Deployment restarts
it as a standby). SIGTERM/SIGINT stop cleanly and release the Lease so a standby takes over at
once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
from typing import Any

import kopf

from rlpacer.operator import tls
from rlpacer.operator.handlers import JobLoops, OperatorContext, build_registry, watch_jobs
from rlpacer.operator.kube import Credentials, KubeClient
from rlpacer.operator.lease import LeaderElector
from rlpacer.operator.metrics import Metrics
from rlpacer.operator.policies import PolicyCache, policy_admission
from rlpacer.operator.runtime import Jobs
from rlpacer.operator.server import LeaderState, metrics_app, report_app, start_site
from rlpacer.operator.settings import OperatorSettings, from_args
from rlpacer.operator.tls import ServingCert

log = logging.getLogger("rlpacer.operator")

EXIT_LOST_LEASE = 1


async def serve(settings: OperatorSettings, stop: asyncio.Event | None = None) -> int:
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)

    creds = Credentials.load(settings.kubeconfig)
    metrics = Metrics()
    kube = KubeClient(creds, counted=lambda verb, resource: metrics.kube_requests.labels(
        verb, resource).inc())
    leader = LeaderState(leader=False)
    policy_cache = PolicyCache(policy_admission(kube, settings).policies,
                               settings.policy_cache_seconds)
    jobs = Jobs(kube, settings, metrics, policies=policy_cache)
    loops = JobLoops(jobs)
    ctx = OperatorContext(settings=settings, creds=creds, jobs=jobs, loops=loops)
    registry = build_registry(ctx)
    m_runner, m_port = await start_site(
        metrics_app(metrics, leader), settings.metrics_host, settings.metrics_port,
        header_timeout=settings.http_header_timeout_seconds)
    cert = report_cert(settings)
    if cert is not None:
        jobs.report_ca = cert.ca_pem
    r_runner, r_port = await start_site(
        report_app(jobs, leader, metrics), settings.report_host, settings.report_port,
        ssl_context=cert.context if cert is not None else None,
        header_timeout=settings.http_header_timeout_seconds)
    log.info("serving step reports on :%d (%s), metrics on :%d (identity %s)", r_port,
             "TLS" if cert is not None else "plain HTTP: report_insecure_http", m_port,
             settings.identity)

    elector = None
    if settings.leader_election:
        elector = LeaderElector(
            kube, settings.operator_namespace, settings.lease_name, settings.identity,
            settings.lease_duration_seconds, settings.lease_renew_seconds,
            settings.lease_retry_seconds)
    kopf_stop = asyncio.Event()
    tasks: list[asyncio.Task[Any]] = []
    kopf_task: asyncio.Task[Any] | None = None
    code = 0
    try:
        stop_task = asyncio.create_task(stop.wait())
        tasks.append(stop_task)
        if elector is not None:
            acquire = asyncio.create_task(elector.acquire())
            await asyncio.wait({acquire, stop_task}, return_when=asyncio.FIRST_COMPLETED)
            if not acquire.done():
                acquire.cancel()
                return 0
        leader.leader = True
        metrics.leader.set(1)
        kopf_task = asyncio.create_task(kopf.operator(
            registry=registry,
            standalone=True,
            clusterwide=not settings.namespaces,
            namespaces=settings.namespaces,
            stop_flag=kopf_stop,
        ))
        tasks.append(kopf_task)
        tasks.append(asyncio.create_task(watch_jobs(jobs, loops, settings.namespaces)))
        if cert is not None:
            tasks.append(asyncio.create_task(follow_cert(cert)))
        waits: set[asyncio.Task[Any]] = {kopf_task, stop_task}
        hold = None
        if elector is not None:
            hold = asyncio.create_task(elector.hold())
            tasks.append(hold)
            waits.add(hold)
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if hold is not None and hold in done:
            log.error("leadership lost: stopping")
            code = EXIT_LOST_LEASE
        elif kopf_task in done and not stop.is_set():
            # Kopf handles SIGTERM/SIGINT itself once running: a clean return is a stop.
            exc = kopf_task.exception()
            if exc is not None:
                log.error("kopf failed: %r", exc)
                code = 2
    finally:
        leader.leader = False
        metrics.leader.set(0)
        kopf_stop.set()
        for t in tasks:
            if t is not kopf_task and not t.done():
                t.cancel()
        if kopf_task is not None and not kopf_task.done():
            try:
                async with asyncio.timeout(20):
                    await kopf_task
            except BaseException:
                kopf_task.cancel()
        await loops.stop_all()
        if elector is not None and code != EXIT_LOST_LEASE:
            await elector.release()
        await r_runner.cleanup()
        await m_runner.cleanup()
        await kube.close()
    return code


#: How often the report certificate's files are checked for a renewal, seconds.
CERT_CHECK_SECONDS = 30.0


def report_cert(settings: OperatorSettings) -> ServingCert | None:
    """The step-report endpoint's certificate (None: plain HTTP, ``report_insecure_http``);
    a generated one when ``report_cert_dir`` is unset. A bad folder fails the start, named."""
    if settings.report_insecure_http:
        log.warning("step reports are served over plain HTTP (report_insecure_http): job"
                    " tokens cross the network in clear text; use it for local runs only")
        return None
    cert_dir = settings.report_cert_dir or tls.generate_temporary(
        settings.report_hostnames(), "report-endpoint")
    try:
        return ServingCert(cert_dir, setting="report_cert_dir")
    except tls.CertError as e:
        raise SystemExit(f"invalid operator settings:\n  {e}") from None


async def follow_cert(cert: ServingCert, period: float = CERT_CHECK_SECONDS) -> None:
    """Re-read a renewed certificate (the jobs' ConfigMaps get its CA on their next pass)."""
    while True:
        await asyncio.sleep(period)
        await asyncio.to_thread(cert.reload)


def run_from_args(args: argparse.Namespace) -> int:
    settings = from_args(args)
    logging.basicConfig(
        level=getattr(logging, settings.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    freeze_startup_heap()
    return asyncio.run(serve(settings))


def freeze_startup_heap() -> None:
    """Move everything alive after start-up (modules, Kopf's and pydantic's machinery, ~80,000
    objects) out of the cyclic garbage collector's reach.

    Without it each full collection walks that heap, and the operator's event loop stalls with
    every step report in flight waiting behind it: full collections took 72-159 ms under
    ``rlpacer bench-operator`` on 2 cores, 13-19 ms with the start-up heap frozen. Objects
    frozen here live for the whole process anyway; the ones a job creates later are collected
    as usual.
    """
    gc.collect()
    gc.freeze()
