"""pytest plugin: the session-scoped ``cluster`` fixture (a real local control plane).

Registered for the whole test tree by ``tests/conftest.py`` (``pytest_plugins``), so
tests/integration and tests/e2e share one cluster per session. The cluster starts only when a
test asks for it. Set ``RLPACER_KUBECONFIG`` to reuse a running cluster
(``python -m rlpacer.testing.cluster up``) instead of starting one.

A binary that is not built makes the requesting tests fail with a message naming it and the
set-up command; it never turns them into skips.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest

from rlpacer.testing.cluster import ClusterError, LocalCluster, running_cluster


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    """The local Kubernetes control plane for this test session (admin access)."""
    try:
        cm = running_cluster()
        c = cm.__enter__()
    except ClusterError as e:
        pytest.fail(f"local Kubernetes control plane unavailable: {e}", pytrace=False)
    try:
        yield c
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture
def namespace(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (with its default ServiceAccount) for one test, deleted afterwards."""
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"t-{base}-{uuid.uuid4().hex[:6]}"
    cluster.create_namespace(name)
    try:
        yield name
    finally:
        cluster.delete_namespace(name)
