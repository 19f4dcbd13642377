"""Alias of :mod:`rlpacer_trainer.pod` (``python -m rlpacer_trainer.entrypoint``)."""

from __future__ import annotations

import sys

from rlpacer_trainer.pod import main

if __name__ == "__main__":
    sys.exit(main())
