"""The container tier: the built images run on a real node (kubelet, containerd, runc) exactly as
the chart's Deployment and the operator's pod builders give them (test_real_node.py). The images
come from ``bash scripts/build-images.sh`` (the set-up runs it); a missing or out-of-date image
fails the tier with that command, it never skips."""

from __future__ import annotations

import subprocess

import pytest

from rlpacer.testing.containers import (
    BUILD,
    PodmanMissing,
    podman_base,
    project_images,
)


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    """The images' tags, checked to exist and to be built from this checkout's inputs."""
    try:
        podman_base()
    except PodmanMissing as err:
        pytest.fail(str(err), pytrace=False)
    check = subprocess.run([*BUILD, "--check"], capture_output=True, text=True, timeout=300)
    if check.returncode != 0:
        pytest.fail(
            "the container images are missing or older than this checkout's sources: run"
            f" `bash scripts/build-images.sh` (the set-up runs it)\n{check.stdout[-2000:]}"
            f"{check.stderr[-2000:]}", pytrace=False)
    return project_images()
