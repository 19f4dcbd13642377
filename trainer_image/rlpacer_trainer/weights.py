"""Policy versions: a fingerprint of the weights, computed where the weights are.

The learner fingerprints the tensors it publishes after each update. Each rollout engine's
worker fingerprints the weights it HOLDS after loading them: once vLLM has reloaded a bucket in
place, the worker reads every received tensor's values back out of the engine's own
parameters (the slice of a fused layer, the tied embedding, or, where the CPU backend keeps a
linear layer's weight packed inside its GEMM kernel, by multiplying that layer with an
identity) and fingerprints those under the received name
(:class:`rlpacer_trainer.engine.WorkerExtension`). Equal fingerprints mean the engine generates
with exactly the learner's weights; a stale, partial, corrupted or silently skipped load gives
another fingerprint. It is not a counter any process sets.

The fingerprint covers every tensor's name, dtype and shape and, per tensor, all elements up
to :data:`SAMPLE_ELEMENTS` (larger tensors: that many evenly strided elements), so it costs
milliseconds for a 7B model as for the tiny one. It is incremental and order-independent
(:class:`Fingerprint`: one digest per tensor, combined sorted by name), so weights sent in
buckets (:func:`buckets`, e.g. layer by layer from a sharded learner) are fingerprinted bucket
by bucket without ever holding all tensors at once.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable, Iterator, Mapping

import torch

#: Elements hashed per tensor at most (evenly strided beyond that).
SAMPLE_ELEMENTS = 65536


def tensor_digest(name: str, t: torch.Tensor) -> bytes:
    """One named tensor's digest: its name, dtype, shape and (sampled) elements."""
    h = hashlib.blake2b(digest_size=16)
    t = t.detach()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    flat = t.reshape(-1)
    n = flat.numel()
    if n > SAMPLE_ELEMENTS:
        stride = -(-n // SAMPLE_ELEMENTS)
        flat = flat[::stride]
    h.update(flat.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


class Fingerprint:
    """An incremental, order-independent fingerprint: :meth:`add` tensors one at a time (in
    any order, bucket by bucket), then :meth:`version`. Equal to :func:`fingerprint` over the
    same named tensors. A name may be added once."""

    def __init__(self) -> None:
        self._digests: dict[str, bytes] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.add_digest(name, tensor_digest(name, tensor))

    def add_digest(self, name: str, digest: bytes) -> None:
        """Adds a tensor by its :func:`tensor_digest` (taken earlier, e.g. of the tensor as
        received, once the engine was found to hold it)."""
        if name in self._digests:
            raise ValueError(f"fingerprint: tensor {name!r} added twice")
        self._digests[name] = digest

    def update(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            self.add(name, t)

    def __len__(self) -> int:
        return len(self._digests)

    def names(self) -> set[str]:
        return set(self._digests)

    def version(self) -> str:
        """The policy version of the tensors added so far, e.g. ``w-1f3a...``."""
        h = hashlib.blake2b(digest_size=10)
        for name in sorted(self._digests):
            h.update(f"{len(name)}:{name}".encode())
            h.update(self._digests[name])
        return "w-" + h.hexdigest()


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The policy version of these named tensors (order-independent), e.g. ``w-1f3a...``."""
    fp = Fingerprint()
    fp.update(named)
    return fp.version()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def buckets(named: Iterable[tuple[str, torch.Tensor]],
            max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Groups consecutive named tensors into dicts of at most ``max_bytes`` (tensor data); a
    tensor larger than that forms a bucket of its own. Lazy: a sharded learner can gather
    and send one bucket at a time. Order is kept (vLLM reloads a fused layer only once all
    of its parts have arrived, so the engine holds a part back until its siblings come)."""
    if max_bytes <= 0:
        raise ValueError(f"buckets: max_bytes must be positive, got {max_bytes}")
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in named:
        n = nbytes(t)
        if bucket and size + n > max_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += n
    if bucket:
        yield bucket


def cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as detached contiguous CPU tensors (what is published)."""
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}


def to_bytes(state: Mapping[str, torch.Tensor]) -> bytes:
    """``torch.save`` bytes of a state dict (Ray's RPC serialiser mangles raw tensors); also
    one bucket's bytes (:func:`buckets`)."""
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return buf.getvalue()


def from_bytes(blob: bytes) -> dict[str, torch.Tensor]:
    sd = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    return dict(sd)
