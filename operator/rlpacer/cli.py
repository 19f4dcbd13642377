"""The `rlpacer` command line. Sub-commands register themselves here."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlpacer", description=__doc__)
    parser.add_subparsers(dest="command", required=True)
    args = parser.parse_args(argv)
    del args
    return 0


if __name__ == "__main__":
    sys.exit(main())
