"""``rlpacer fit``: does a model's learner fit on the trainer's GPUs? (per-rank memory estimate)

For each model (a Qwen2.5 size by name, or a ``config.json`` path), each learner size (GPUs,
one rank each) and each GPU memory, the estimate of :mod:`rlpacer.control.memory` (the same
the trainer checks before it starts: weights, gradients, AdamW state, activations at
``microBatchTokens``, overhead) per rank. Without ``--table`` it prints each estimate's
breakdown; with ``--table`` a Markdown table (the one in docs/learner-fit.md is this
command's output) of the GiB per GPU and whether it fits, with and without activation
checkpointing unless ``--activation-checkpointing`` says which.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rlpacer.control.errors import ConfigError
from rlpacer.control.memory import (
    GIB,
    QWEN25,
    LearnerLayout,
    MemoryEstimate,
    ModelShape,
    Precision,
    estimate,
)


def shape_of(model: str) -> ModelShape:
    """A known name (``qwen2.5-7b``, ...), a ``config.json`` or a model folder holding one."""
    if model.lower() in QWEN25:
        return QWEN25[model.lower()]
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {model}: neither a known model ({', '.join(QWEN25)}) nor"
                         " a config.json or a folder with one")
    return ModelShape.from_config(json.loads(path.read_text()))


def estimates(args: argparse.Namespace, model: str, gpus: int,
              checkpointing: bool) -> MemoryEstimate:
    layout = LearnerLayout(
        world=gpus, precision=Precision(args.precision), sharded=args.sharding == "FSDP",
        micro_batch_tokens=args.micro_batch_tokens, activation_checkpointing=checkpointing,
        kl=args.kl)
    return estimate(shape_of(model), layout)


def _gib_label(g: float) -> str:
    return f"{g:g} GiB"


def table(args: argparse.Namespace) -> str:
    ckpts = _checkpointing(args)
    cols = [(n, g) for g in args.gpu_memory_gib for n in args.gpus]
    head = ["model", "activationCheckpointing",
            *[f"{n} GPUs x {_gib_label(g)}" for n, g in cols]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for model in args.model:
        for ck in ckpts:
            cells = [model, "true" if ck else "false"]
            for n, g in cols:
                est = estimates(args, model, n, ck)
                verdict = "fits" if est.total <= g * GIB else "no"
                cells.append(f"{verdict} ({est.total / GIB:.1f} GiB)")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _checkpointing(args: argparse.Namespace) -> list[bool]:
    return {"both": [False, True], "on": [True], "off": [False]}[args.activation_checkpointing]


def main(args: argparse.Namespace) -> int:
    try:
        if args.table:
            print(table(args))
            return 0
        for model in args.model:
            for n in args.gpus:
                for ck in _checkpointing(args):
                    est = estimates(args, model, n, ck)
                    fits = [f"{'fits' if est.total <= g * GIB else 'does not fit'} in"
                            f" {_gib_label(g)}" for g in args.gpu_memory_gib]
                    print(f"{model}: {est.describe()}: {', '.join(fits)}")
    except (ValueError, ConfigError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "fit", help="the learner's memory per GPU for a model and a number of trainer GPUs",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", required=True,
                   help=f"known names ({', '.join(QWEN25)}) or config.json paths")
    p.add_argument("--gpus", type=int, nargs="+", required=True,
                   help="learner ranks (trainer.replicas x gpusPerReplica)")
    p.add_argument("--gpu-memory-gib", type=float, nargs="+", default=[79.6],
                   help="memory per GPU in GiB (default: H100 80 GB, 79.6)")
    p.add_argument("--precision", choices=[p.value for p in Precision],
                   default=Precision.BF16_MIXED.value, help="bf16-mixed (GPU) or fp32 (CPU)")
    p.add_argument("--sharding", choices=["FSDP", "Replicated"], default="FSDP",
                   help="trainer.sharding (default FSDP)")
    p.add_argument("--micro-batch-tokens", type=int, default=16384,
                   help="trainer.microBatchTokens (default 16384)")
    p.add_argument("--activation-checkpointing", choices=["off", "on", "both"], default="both",
                   help="trainer.activationCheckpointing: off, on or both (default)")
    p.add_argument("--kl", action="store_true", help="KL on: a frozen reference model too")
    p.add_argument("--table", action="store_true", help="print a Markdown table")
    p.set_defaults(func=main)
