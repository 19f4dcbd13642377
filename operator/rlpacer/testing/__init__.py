"""Test support: a real local Kubernetes control plane (see ``rlpacer.testing.cluster``).

Not imported by the operator at run time; tests and developers use it. Names are loaded lazily
so that ``python -m rlpacer.testing.cluster`` runs its module only once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlpacer.testing.cluster import (
        GPU_RESOURCE,
        GPU_TAINT,
        GPU_TOLERATION,
        ClusterError,
        ClusterStartError,
        LocalCluster,
        MissingBinaryError,
        NodeSpec,
        PortInUseError,
        running_cluster,
    )
    from rlpacer.testing.kwok_stages import EXIT_ANNOTATION

_FROM = {
    "EXIT_ANNOTATION": "rlpacer.testing.kwok_stages",
    "GPU_RESOURCE": "rlpacer.testing.cluster",
    "GPU_TAINT": "rlpacer.testing.cluster",
    "GPU_TOLERATION": "rlpacer.testing.cluster",
    "ClusterError": "rlpacer.testing.cluster",
    "ClusterStartError": "rlpacer.testing.cluster",
    "LocalCluster": "rlpacer.testing.cluster",
    "MissingBinaryError": "rlpacer.testing.cluster",
    "NodeSpec": "rlpacer.testing.cluster",
    "PortInUseError": "rlpacer.testing.cluster",
    "running_cluster": "rlpacer.testing.cluster",
}

__all__ = [
    "EXIT_ANNOTATION",
    "GPU_RESOURCE",
    "GPU_TAINT",
    "GPU_TOLERATION",
    "ClusterError",
    "ClusterStartError",
    "LocalCluster",
    "MissingBinaryError",
    "NodeSpec",
    "PortInUseError",
    "running_cluster",
]


def __getattr__(name: str) -> Any:
    if name in _FROM:
        return getattr(importlib.import_module(_FROM[name]), name)
    raise AttributeError(f"module 'rlpacer.testing' has no attribute {name!r}")
