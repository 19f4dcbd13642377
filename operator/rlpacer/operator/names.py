"""Names and labels of a job's children, valid for any valid job name.

Kubernetes limits: Service names are DNS-1035 labels (63 characters, must start with a
letter); a Pod's name is its hostname (63); a StatefulSet's name plus ``-`` plus a 10-character
revision hash must fit the 63-character ``controller-revision-hash`` label, so StatefulSets
get at most 52. Job names are DNS labels of up to 63 characters (a CRD CEL rule), so
``<job>-<suffix>`` may not fit: then the job part is cut and a short hash of the full name keeps
children of different jobs apart. Names are deterministic (the same job always gets the same
children, across operator restarts).
"""

from __future__ import annotations

import hashlib

from rlpacer.api import contract

DNS_LABEL = 63
STATEFULSET_NAME = 52  # 63 - len("-") - 10 (controller-revision-hash)
HASH_LEN = 5


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_LEN]


def child_name(job: str, suffix: str, limit: int = DNS_LABEL, *, dns1035: bool = False) -> str:
    """``<job>-<suffix>`` cut to ``limit`` with a hash when needed; letter-first if dns1035."""
    base = job
    if dns1035 and not base[:1].isalpha():
        base = "r" + base  # a Service name must start with a letter
    name = f"{base}-{suffix}"
    if len(name) <= limit:
        return name
    keep = limit - len(suffix) - HASH_LEN - 2
    head = base[:keep].rstrip("-")
    return f"{head}-{_hash(job)}-{suffix}"


def secret(job: str) -> str:
    """The step-report token's Secret (mounted by the driver only)."""
    return child_name(job, "token")


def ray_secret(job: str) -> str:
    """The Ray token's Secret (mounted by every pod of the job)."""
    return child_name(job, "ray-token")


def config_map(job: str) -> str:
    return child_name(job, "config")


def head_service(job: str) -> str:
    return child_name(job, "head", dns1035=True)


def workers_service(job: str) -> str:
    return child_name(job, "workers", dns1035=True)


def statefulset(job: str, role: contract.Role) -> str:
    return child_name(job, role.value, STATEFULSET_NAME)


def wide_statefulset(job: str) -> str:
    """The wide long-round engines' StatefulSet (``tailBatching.longRound.tensorParallelSize``);
    its pods are rollout pods whose ordinals follow the rollout StatefulSet's."""
    return child_name(job, f"{contract.Role.ROLLOUT.value}-{contract.POOL_WIDE}",
                      STATEFULSET_NAME)


def rollout_statefulsets(job: str) -> tuple[str, str]:
    """The StatefulSets whose pods are rollout replicas: the rollout's and the wide one's."""
    return statefulset(job, contract.Role.ROLLOUT), wide_statefulset(job)


def driver_pod(job: str, attempt: int) -> str:
    return child_name(job, f"driver-{attempt}")


def network_policy(job: str, role: contract.Role | None = None) -> str:
    """``<job>-pods`` (every pod of the job) or ``<job>-<role>`` (that role's additions)."""
    return child_name(job, role.value if role else "pods")


def selector(job: str, role: contract.Role | None = None) -> dict[str, str]:
    """Labels that select the job's pods (of one role)."""
    out = {contract.LABEL_JOB: job, contract.LABEL_MANAGED_BY: contract.MANAGED_BY}
    if role is not None:
        out[contract.LABEL_ROLE] = role.value
    return out


def labels(job: str, role: contract.Role | None = None) -> dict[str, str]:
    """Labels of every child (all values are valid label values for any valid job name)."""
    out = {
        contract.LABEL_NAME: "rlpacer-trainer",
        contract.LABEL_INSTANCE: job,
        **selector(job, role),
    }
    if role is not None:
        out[contract.LABEL_COMPONENT] = role.value
    return out
