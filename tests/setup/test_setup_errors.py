"""scripts/setup.sh stops with a message naming the fix when a prerequisite is missing: no Go,
too little disk, no network to the package index or the Go module proxy. Each case is made
real (a missing program, a 1 MB file system, a network namespace with no network), in a copy
of this checkout that reuses the shared dependency environment."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlpacer.testing.checkout import copy_checkout, shared_dir

pytestmark = pytest.mark.setup
ROOT = Path(__file__).resolve().parents[2]


def _shared_env() -> str:
    return (ROOT / ".venv" / ".shared-env").read_text().strip()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    dst = tmp_path / "clone"
    copy_checkout(ROOT, dst)
    return dst


def _setup(checkout: Path, *args: str, env: dict[str, str], prefix: tuple[str, ...] = ()
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, "bash", "scripts/setup.sh", *args], cwd=checkout,
                          env=os.environ | env, capture_output=True, text=True, timeout=300)


def test_no_go(checkout: Path, tmp_path: Path) -> None:
    proc = _setup(checkout, env={"RLPACER_CACHE": str(tmp_path / "cache"),
                                 "RLPACER_VENV": _shared_env(), "GO": "/nonexistent/go"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "error: Go is needed to build the control plane" in proc.stderr
    assert "set GO=/path/to/go" in proc.stderr
    # the Python environment was set up before: `rlpacer run` works without Go
    assert (checkout / ".venv" / "bin" / "rlpacer").exists()


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_too_little_disk(checkout: Path, tiny_fs: Path) -> None:
    proc = _setup(checkout, env={"RLPACER_CACHE": str(tiny_fs), "RLPACER_VENV": _shared_env()})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the control-plane binaries needs about 1 GB free in" in proc.stderr
    assert "set RLPACER_CACHE to a folder on a larger disk" in proc.stderr
    # a new dependency environment on that disk is refused before anything is downloaded
    proc = _setup(checkout, "--python", env={"RLPACER_CACHE": str(tiny_fs),
                                             "RLPACER_VENV": str(tiny_fs / "venv")})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the Python dependency environment needs about 6 GB free" in proc.stderr


NO_NETWORK = ("unshare", "--net")


def test_no_network_to_the_package_index(checkout: Path, tmp_path: Path) -> None:
    proc = _setup(checkout, "--python", prefix=NO_NETWORK, env={
        "RLPACER_CACHE": str(tmp_path / "cache"), "RLPACER_VENV": str(tmp_path / "venv"),
        "RLPACER_SHARED": str(shared_dir(ROOT)),
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "3", "PIP_NO_CACHE_DIR": "1", "PIP_FIND_LINKS": ""})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "pip could not install from the Python package index: check network" in proc.stderr


def test_no_network_to_the_go_module_proxy(checkout: Path, tmp_path: Path) -> None:
    proc = _setup(checkout, prefix=NO_NETWORK, env={
        "RLPACER_CACHE": str(tmp_path / "cache"), "RLPACER_VENV": _shared_env(),
        "GOMODCACHE": str(tmp_path / "gomod")})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "building the control plane failed" in proc.stderr
    assert "the Go module proxy (GOPROXY=" in proc.stderr
