"""The `rlpacer` command line. Sub-commands register themselves here."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlpacer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from rlpacer.operator import commands as operator_commands

    operator_commands.register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
