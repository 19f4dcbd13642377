"""The `rlpacer` command line.

Each sub-command lives in its own module, which exposes ``register(subparsers)``: it adds its
parser and sets ``func`` (``args -> exit code``). Keep ``register`` light (no heavy imports:
import torch, Ray or Kubernetes clients inside ``func``) so ``rlpacer --help`` stays fast.
To add a sub-command, add its module to ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: tuple[str, ...] = (
    "rlpacer.sim.bench",  # rlpacer bench
    "rlpacer.sim.pool",  # rlpacer bench-pool (jobs sharing a burst pool)
    "rlpacer.sim.plan",  # rlpacer plan
    "rlpacer.sim.fit",  # rlpacer fit (the learner's memory per GPU)
    "rlpacer.operator.commands",  # rlpacer crds, operator
    "rlpacer.bench.commands",  # rlpacer bench-operator, bench-scale
    "rlpacer_trainer.cli",  # rlpacer run, bench-train (the data plane, trainer_image/)
    "rlpacer_trainer.bench_accuracy",  # rlpacer bench-accuracy (RL on a user's model and data)
    "rlpacer.devcluster",  # rlpacer dev-cluster (a local cluster that runs jobs)
    "rlpacer.bench.long_round",  # rlpacer bench-long-round (played hosts)
)


def version_text() -> str:
    """The version and where each package was imported from (which checkout or install)."""
    from pathlib import Path

    import rlpacer
    import rlpacer_trainer

    return (f"rlpacer {rlpacer.__version__} from {Path(rlpacer.__file__).parent}, "
            f"rlpacer_trainer from {Path(rlpacer_trainer.__file__).parent}")


class _Version(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlpacer", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print the version and where the code is imported from, then exit")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
