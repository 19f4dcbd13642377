"""The project's images as scripts/build-images.sh builds them, and podman as that script runs
it (the container test tier, tests/container, imports them into the real node)."""

from __future__ import annotations

import shutil
from pathlib import Path

from rlpacer.testing.base import repo_root

ROOT = repo_root()
CHART = ROOT / "charts" / "rlpacer"
BUILD = ["bash", str(ROOT / "scripts" / "build-images.sh")]


def chart_app_version() -> str:
    import yaml

    return str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


def project_images() -> dict[str, str]:
    """The images scripts/build-images.sh builds, by role (the chart's and the spec's
    default images)."""
    v = chart_app_version()
    return {"operator": f"ghcr.io/rlpacer/operator:{v}", "trainer": f"ghcr.io/rlpacer/trainer:{v}"}


class PodmanMissing(RuntimeError):
    pass


def podman_base() -> list[str]:
    """podman, with runc where crun refuses the host's cgroups (v1 or hybrid): the same choice
    scripts/build-images.sh makes."""
    if shutil.which("podman") is None:
        raise PodmanMissing(
            "podman is not installed: run bash scripts/setup.sh (it installs podman and builds"
            " the images), or apt-get install -y podman buildah debootstrap runc")
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    if not v2 and shutil.which("runc"):
        return ["podman", "--runtime", "runc"]
    return ["podman"]
