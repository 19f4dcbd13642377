"""Policy versions: a fingerprint of the weights, computed where the weights are.

The learner fingerprints the tensors it publishes after each update; each rollout engine's
worker fingerprints the tensors it received and loaded (inside the engine's own process, from
the deserialized tensors it hands to vLLM's in-place reload). Equal fingerprints mean the
engine generates with exactly the learner's weights; a stale, partial or corrupted transfer
gives another fingerprint. It is not a counter any process sets.

The fingerprint covers every tensor's name, dtype and shape and, per tensor, all elements up
to :data:`SAMPLE_ELEMENTS` (larger tensors: that many evenly strided elements), so it costs
milliseconds for a 7B model as for the tiny one. (vLLM repacks and fuses layers as it loads
them, so the engine's own parameters cannot be compared with the learner's state dict
directly; the tensors the worker loads can.)
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable, Mapping

import torch

#: Elements hashed per tensor at most (evenly strided beyond that).
SAMPLE_ELEMENTS = 65536


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The policy version of these named tensors (order-independent), e.g. ``w-1f3a...``."""
    h = hashlib.blake2b(digest_size=10)
    for name, t in sorted(named, key=lambda kv: kv[0]):
        t = t.detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        flat = t.reshape(-1)
        n = flat.numel()
        if n > SAMPLE_ELEMENTS:
            stride = -(-n // SAMPLE_ELEMENTS)
            flat = flat[::stride]
        h.update(flat.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return "w-" + h.hexdigest()


def cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as detached contiguous CPU tensors (what is published)."""
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}


def to_bytes(state: Mapping[str, torch.Tensor]) -> bytes:
    """``torch.save`` bytes of a state dict (Ray's RPC serialiser mangles raw tensors)."""
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return buf.getvalue()


def from_bytes(blob: bytes) -> dict[str, torch.Tensor]:
    sd = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    return dict(sd)
