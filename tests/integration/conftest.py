"""Integration tier: tests against the real local Kubernetes control plane.

Fixtures (from ``rlpacer.testing.pytest_plugin``, registered in tests/conftest.py):

* ``cluster`` (session): a started ``rlpacer.testing.LocalCluster``; ``.kubeconfig``,
  ``.server``, ``.api_client()``, ``.kubectl(...)``, ``.helm(...)``,
  ``.kubeconfig_for_service_account(ns, name)``, ``.mark_pod_exit(ns, pod, code)``.
* ``namespace``: a fresh namespace per test, deleted afterwards.

Set RLPACER_KUBECONFIG to run against a cluster started by hand
(``python -m rlpacer.testing.cluster up``).
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Everything under tests/integration belongs to the integration tier.
    for item in items:
        if (
            "/tests/integration/" in str(item.path)
            and item.get_closest_marker("integration") is None
        ):
            item.add_marker(pytest.mark.integration)
