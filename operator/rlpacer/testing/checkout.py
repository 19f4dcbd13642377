"""Copies of a checkout, as a second clone or worktree has them (the set-up tests use them)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def shared_dir(root: Path) -> Path:
    """The folder holding the torch wheel, traces and examples, found as ``scripts/setup.sh``
    finds it: ``$RLPACER_SHARED``, else ``../shared`` beside the checkout ``root``, else the
    folder set-up last built this checkout's environment from (``.venv/.shared-dir``)."""
    if os.environ.get("RLPACER_SHARED"):
        return Path(os.environ["RLPACER_SHARED"])
    beside = root.parent / "shared"
    recorded = root / ".venv" / ".shared-dir"
    if not beside.is_dir() and recorded.is_file():
        return Path(recorded.read_text().strip())
    return beside


def copy_checkout(root: Path, dst: Path) -> None:
    """Copies ``root``'s working tree (tracked and untracked files git does not ignore) to
    ``dst``: what a fresh clone of the working tree would hold, without its environment."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = root / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
