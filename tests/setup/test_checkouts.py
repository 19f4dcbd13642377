"""Each checkout runs its own code: the shared dependency environment never re-points one
checkout's commands at another clone (scripts/setup.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rlpacer
import rlpacer_trainer
from rlpacer.testing.checkout import copy_checkout

ROOT = Path(__file__).resolve().parents[2]


def _inside(path: str | Path, root: Path) -> bool:
    return root.resolve() in Path(path).resolve().parents


def _where(python: Path | str, *, cwd: Path | None = None) -> list[str]:
    """Where `python` imports rlpacer and rlpacer_trainer from, as a fresh process sees it."""
    out = subprocess.run(
        [str(python), "-c",
         "import rlpacer, rlpacer_trainer as t; print(rlpacer.__file__); print(t.__file__)"],
        capture_output=True, text=True, check=True, cwd=cwd or "/",
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    return out.stdout.split()


@pytest.mark.unit
def test_this_process_imports_this_checkout() -> None:
    assert _inside(rlpacer.__file__ or "", ROOT), rlpacer.__file__
    assert _inside(rlpacer_trainer.__file__ or "", ROOT), rlpacer_trainer.__file__


@pytest.mark.unit
def test_checkout_commands_import_this_checkout() -> None:
    """`python -m ...`, the console scripts and sys.executable's children: all this checkout."""
    venv_bin = ROOT / ".venv" / "bin"
    assert all(_inside(p, ROOT) for p in _where(sys.executable))
    assert all(_inside(p, ROOT) for p in _where(venv_bin / "python"))
    for cmd in ([str(venv_bin / "rlpacer"), "--version"],
                [sys.executable, "-m", "rlpacer.cli", "--version"]):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd="/").stdout
        assert out.count(str(ROOT / "operator")) == 1, out
        assert out.count(str(ROOT / "trainer_image")) == 1, out
    # The shared environment's commands are re-issued with this checkout's interpreter.
    assert (venv_bin / "ruff").exists()   # native: linked, it imports nothing of ours
    for tool in ("pytest", "ray", "mypy", "lint-imports"):
        shebang = (venv_bin / tool).read_text(errors="replace").splitlines()[0]
        assert shebang == f"#!{venv_bin / 'python'}", (tool, shebang)


def _copy_checkout(dst: Path) -> None:
    copy_checkout(ROOT, dst)


def _setup(checkout: Path) -> str:
    proc = subprocess.run(["bash", "scripts/setup.sh", "--python"], cwd=checkout,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _assert_own_code(checkout: Path) -> None:
    venv_bin = checkout / ".venv" / "bin"
    for p in _where(venv_bin / "python", cwd=checkout):
        assert _inside(p, checkout), f"{checkout} imported {p}"
    out = subprocess.run([str(venv_bin / "rlpacer"), "--version"], capture_output=True,
                         text=True, check=True, cwd="/").stdout
    assert f"from {checkout / 'operator' / 'rlpacer'}," in out, out
    # A Ray worker or played pod is started with sys.executable: this checkout's interpreter.
    exe = subprocess.run([str(venv_bin / "python"), "-c", "import sys; print(sys.executable)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert Path(exe).parent == venv_bin, exe


@pytest.mark.setup
@pytest.mark.slow
def test_two_clones_each_import_their_own_code_in_either_order(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _copy_checkout(a)
    _copy_checkout(b)

    out_a = _setup(a)
    out_b = _setup(b)
    for out in (out_a, out_b):   # the heavy dependencies are shared, not installed again
        assert "shared Python dependencies: reusing" in out, out
    _assert_own_code(a)          # set up first, still its own code after b's set-up
    _assert_own_code(b)

    _setup(a)                    # the other order
    _assert_own_code(b)
    _assert_own_code(a)

    shutil.rmtree(b)             # a partner clone deleted: the other keeps working
    _assert_own_code(a)
    # And this checkout was never re-pointed by the clones' set-ups.
    _assert_own_code(ROOT)


@pytest.mark.e2e
def test_ray_workers_import_this_checkout() -> None:
    """Ray starts its workers with the driver's interpreter: they import this checkout too."""
    import ray

    from rlpacer_trainer import runtime

    def where() -> list[str]:
        import rlpacer as r
        import rlpacer_trainer as t

        return [r.__file__ or "", t.__file__ or ""]

    started = not ray.is_initialized()
    runtime.init_ray(num_cpus=1)
    try:
        paths = ray.get(ray.remote(num_cpus=0.1)(where).remote(), timeout=120)
    finally:
        if started:
            ray.shutdown()
    assert all(_inside(p, ROOT) for p in paths), paths


@pytest.mark.setup
def test_tests_refuse_to_run_against_another_checkouts_code(tmp_path: Path) -> None:
    """With the packages imported from elsewhere, the test session stops with a clear error."""
    for pkg in ("operator/rlpacer", "trainer_image/rlpacer_trainer"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'operator'}:{tmp_path / 'trainer_image'}")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/setup/test_checkouts.py::test_this_process_imports_this_checkout"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    where = tmp_path / "operator" / "rlpacer"
    assert f"rlpacer is imported from {where}" in proc.stdout, proc.stdout
    assert "outside the checkout under test" in proc.stdout
