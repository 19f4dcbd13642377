"""Test support: a real local Kubernetes control plane (see ``rlpacer.testing.cluster``).

Not imported by the operator at run time; tests and developers use it.
"""

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
