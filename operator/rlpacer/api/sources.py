"""Where a job's model and data come from: the ``source`` URIs of ``spec.model`` and ``spec.data``.

One parser for both sides: the operator's builders mount every claim a source names, read-only,
at :func:`claim_mount` in the pods that read it, and the trainer resolves ``pvc://CLAIM/PATH``
to the same place (:func:`local_path`). Pure: no Kubernetes client, no filesystem access.

Schemes:

* ``builtin://NAME``  the project's own tiny models and synthetic tasks (shipped in the image).
* ``pvc://CLAIM/PATH`` ``PATH`` inside the PersistentVolumeClaim ``CLAIM`` of the job's
  namespace.
* ``file:///ABS/PATH`` or a plain path: a path on the machine (``rlpacer run``) or inside the
  image.
"""

from __future__ import annotations

import dataclasses
import os
import re

#: Root of the read-only claim mounts: claim ``C`` is mounted at ``CLAIMS_DIR/C``.
CLAIMS_DIR = "/mnt/rlpacer/claims"
#: Overrides :data:`CLAIMS_DIR` in the trainer (tests play pods with local folders).
ENV_CLAIMS_DIR = "RLPACER_CLAIMS_DIR"

_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


@dataclasses.dataclass(frozen=True)
class PVCSource:
    claim: str
    path: str  # relative to the claim's root, no leading slash


def parse_pvc(source: str, field: str) -> PVCSource | None:
    """``pvc://CLAIM/PATH`` -> (CLAIM, PATH); None for another scheme. ValueError naming
    ``field`` when the claim name or the path is malformed."""
    if not source.startswith("pvc://"):
        return None
    rest = source.removeprefix("pvc://")
    claim, _, path = rest.partition("/")
    if not _DNS1123.match(claim):
        raise ValueError(
            f"{field}: {source!r}: the claim name {claim!r} is not a valid PersistentVolumeClaim"
            " name; write pvc://<claim>/<path inside the claim>")
    parts = [p for p in path.split("/") if p]
    if not parts or any(p == ".." for p in parts):
        raise ValueError(
            f"{field}: {source!r}: give a path inside the claim without '..', e.g."
            f" pvc://{claim}/models/my-model")
    return PVCSource(claim, "/".join(parts))


def claim_mount(claim: str, root: str = CLAIMS_DIR) -> str:
    return f"{root.rstrip('/')}/{claim}"


def local_path(source: str, field: str, env: dict[str, str] | None = None) -> str | None:
    """The filesystem path a non-builtin source names in this process (a pod: the claim's
    mount; ``rlpacer run``: the path itself). None for ``builtin://``."""
    if source.startswith("builtin://"):
        return None
    pvc = parse_pvc(source, field)
    if pvc is not None:
        root = (env if env is not None else os.environ).get(ENV_CLAIMS_DIR) or CLAIMS_DIR
        return f"{claim_mount(pvc.claim, root)}/{pvc.path}"
    if source.startswith("file://"):
        path = source.removeprefix("file://")
        if not path.startswith("/"):
            raise ValueError(f"{field}: {source!r}: file:// takes an absolute path"
                             " (file:///abs/path)")
        return path
    if "://" in source:
        raise ValueError(
            f"{field}: {source!r}: unknown scheme; use builtin://, pvc://<claim>/<path>,"
            " file:///<path> or a plain path")
    return source
