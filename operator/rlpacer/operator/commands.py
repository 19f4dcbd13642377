"""The operator's sub-commands of ``rlpacer``: ``crds`` and ``operator`` (the benchmarks'
``bench-operator`` and ``bench-scale`` are in ``rlpacer.bench.commands``).

Each registers itself through :func:`register` (called from ``rlpacer.cli``). Heavy imports
(Kopf, aiohttp, the Kubernetes client) happen inside the command functions so that
``rlpacer --help`` and ``rlpacer crds`` stay fast and light.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DEFAULT_CRD_DIR = "crds"


def _crds(args: argparse.Namespace) -> int:
    from rlpacer.api import crd

    outs = [Path(p) for p in (args.out or [DEFAULT_CRD_DIR])]
    if args.check:
        drift = crd.check(outs)
        if drift:
            print(
                "error: generated CRDs differ from the models; run `rlpacer crds --out"
                f" {' --out '.join(str(o) for o in outs)}`:\n  " + "\n  ".join(drift),
                file=sys.stderr,
            )
            return 1
        print(f"CRDs in sync: {', '.join(str(o) for o in outs)}")
        return 0
    for path in crd.write(outs):
        print(f"wrote {path}")
    return 0


def _operator(args: argparse.Namespace) -> int:
    from rlpacer.operator.main import run_from_args

    return int(run_from_args(args))


def register(subparsers: Any) -> None:
    """Add the operator's sub-commands to ``rlpacer``'s argparse sub-parsers."""
    p = subparsers.add_parser(
        "crds", help="generate the CRDs in crds/ from the API models (or --check for drift)"
    )
    p.add_argument(
        "--out", action="append", metavar="DIR",
        help=f"output folder (repeatable; default {DEFAULT_CRD_DIR}/)",
    )
    p.add_argument("--check", action="store_true", help="fail if the files differ; write nothing")
    p.set_defaults(func=_crds)

    p = subparsers.add_parser("operator", help="run the rlpacer operator (Kopf + step reports)")
    from rlpacer.operator.settings import add_arguments

    add_arguments(p)
    p.set_defaults(func=_operator)
