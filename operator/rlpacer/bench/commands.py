"""The benchmarks' sub-commands of ``rlpacer``: ``bench-operator`` and ``bench-scale``.

Registered through :func:`register` (called from ``rlpacer.cli``). The benches themselves
(aiohttp, the local control plane) are imported inside the command functions so that
``rlpacer --help`` stays fast and light.
"""

from __future__ import annotations

import argparse
from typing import Any


def _bench(args: argparse.Namespace) -> int:
    from rlpacer.bench.reports import run_from_args

    return run_from_args(args)


def _bench_scale(args: argparse.Namespace) -> int:
    from rlpacer.bench.scale import run_from_args

    return run_from_args(args)


def register(subparsers: Any) -> None:
    """Add the benchmarks' sub-commands to ``rlpacer``'s argparse sub-parsers."""
    p = subparsers.add_parser(
        "bench-operator",
        help="step-report round trip (p50/p99) against a control plane, many jobs at once",
    )
    p.add_argument("--jobs", type=int, default=50, help="concurrent jobs (default 50)")
    p.add_argument("--rate", type=float, default=1.0, help="reports per second per job")
    p.add_argument("--seconds", type=float, default=30.0,
                   help="duration of each round's measured load")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of (baseline, warm-up, load); p50/p99 pool all rounds")
    p.add_argument("--warmup", type=float, default=10.0, help="unmeasured load before it")
    p.add_argument("--settle", type=float, default=20.0,
                   help="idle seconds after the jobs' pods run, before measuring")
    p.add_argument("--namespace", default="rlpacer-bench", help="namespace for the bench jobs")
    p.add_argument(
        "--kubeconfig", default=None,
        help="cluster to use (default: start the local test control plane)",
    )
    p.add_argument("--etcd-fsync", action=argparse.BooleanOptionalAction, default=True,
                   help="etcd fsyncs its WAL (default; --no-etcd-fsync as the test fixture)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--trace", default=None, metavar="CSV",
                   help="write every measured request (start time, latency, phase, job) to CSV,"
                        " to line up slow requests with the control plane's logs")
    p.set_defaults(func=_bench)

    p = subparsers.add_parser(
        "bench-scale",
        help="the operator's cost as jobs grow: create-to-children latency, reconcile lag,"
             " step-report latency, RSS, CPU and API requests per job, extrapolated to 1,000",
        description="For each N of --jobs (cumulative), N RLTrainingJobs on KWOK GPU nodes"
                    " of the local control plane: create-to-children-applied and reconcile"
                    " lag p50/p99, step-report latency p50/p99 with each job reporting every"
                    " --interval seconds, the operator's RSS, CPU and API requests per job"
                    " per minute while reporting and while idle, the API server's and etcd's"
                    " CPU; then per-job slopes and the extrapolation to 1,000 jobs reporting"
                    " once a minute, against issue 17's targets (exit 1 if one is not met).",
    )
    p.add_argument("--jobs", default="10,25,50,100",
                   help="comma-separated job counts, measured in increasing order (default"
                        " 10,25,50,100: about 10 minutes on 2 cores)")
    p.add_argument("--interval", type=float, default=5.0,
                   help="seconds between one job's step reports (default 5)")
    p.add_argument("--seconds", type=float, default=30.0,
                   help="measured reporting window per N (default 30)")
    p.add_argument("--idle-seconds", type=float, default=40.0,
                   help="measured idle window per N, no reports (default 40: longer than the"
                        " operator's 30 s resync, so polling per job would show)")
    p.add_argument("--settle-timeout", type=float, default=240.0,
                   help="longest wait for a batch's children and pods (default 240)")
    p.add_argument("--namespace", default="rlpacer-scale", help="namespace for the jobs")
    p.add_argument("--operator-args", default="", metavar="FLAGS",
                   help="more flags for `rlpacer operator`, e.g. '--resync-seconds 3' (a short"
                        " run: polling per job would show within a short idle window)")
    p.add_argument("--etcd-fsync", action=argparse.BooleanOptionalAction, default=True,
                   help="etcd fsyncs its WAL (default; --no-etcd-fsync as the test fixture)")
    p.add_argument("--json", action="store_true",
                   help="print the figures as JSON on stdout (the table goes to stderr)")
    p.set_defaults(func=_bench_scale)
