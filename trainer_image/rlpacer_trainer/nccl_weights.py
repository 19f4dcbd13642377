"""The GPU weight path: learner rank 0 broadcasts each tensor to every engine worker over NCCL.

The pattern vLLM documents for RL weight transfer (its ``examples/offline_inference/rlhf.py``
and ``rlhf_utils.py``): the trainer and the engines' workers form a process group of their own
with ``vllm.distributed.utils.StatelessProcessGroup`` (not torch.distributed's global group,
which the learners use for data parallelism) and a ``PyNcclCommunicator`` on it. Rank 0 is
learner rank 0; the engines' workers follow (an engine with tensor parallelism N brings N
workers). Per update, rank 0 sends the tensors in a fixed order (names, dtypes and shapes are
sent ahead through Ray) and each worker receives into fresh device buffers, reloads them in
place (``model_runner.reload_weights``) and fingerprints them (:mod:`rlpacer_trainer.weights`),
so the policy version check is the same as on the object-store path.

UNVERIFIED: written against vLLM's documented API; no GPU with vLLM was available to run it.
It is opt-in, behind the driver's one weight-sync interface
(:meth:`rlpacer_trainer.driver.Driver.sync_weights`): ``RLPACER_WEIGHT_TRANSPORT=nccl`` in the
driver pod, for GPU engines and learner actors (:meth:`rlpacer_trainer.learners.RayLearners.
nccl_sync` sets the group up and runs each update). The object-store path is the default and
what the tests run. A group is fixed in size: when the set of engines changes (a long round's
replicas join or leave) the group is made anew.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

#: (name, dtype name, shape) of each tensor, in the order rank 0 sends them.
Meta = list[tuple[str, str, tuple[int, ...]]]


def tensor_meta(state: Mapping[str, torch.Tensor]) -> Meta:
    return [(k, str(v.dtype).removeprefix("torch."), tuple(v.shape))
            for k, v in sorted(state.items())]


def communicator(host: str, port: int, rank: int, world_size: int, device: Any) -> Any:
    """A NCCL communicator over a stateless group (vLLM's documented recipe)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    pg = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
    return PyNcclCommunicator(pg, device=device)


class Sender:
    """Learner rank 0's end: opens the group (rank 0) and broadcasts a state dict."""

    def __init__(self, host: str, port: int, world_size: int) -> None:
        self.comm = communicator(host, port, 0, world_size, torch.device("cuda"))

    def send(self, state: Mapping[str, torch.Tensor]) -> None:
        stream = torch.cuda.current_stream()
        for name, _, _ in tensor_meta(state):
            t = state[name].detach().to("cuda").contiguous()
            self.comm.broadcast(t, src=0, stream=stream)
        stream.synchronize()


class ReceiverExtension:
    """Mixed into vLLM's worker next to :class:`rlpacer_trainer.engine.WorkerExtension`
    (called with ``collective_rpc``): joins the group and receives each update."""

    model_runner: Any
    device: Any
    rank: int

    def rlpacer_nccl_join(self, host: str, port: int, rank_offset: int, world_size: int) -> None:
        self.rlpacer_comm = communicator(host, port, rank_offset + self.rank, world_size,
                                         self.device)

    def rlpacer_nccl_receive(self, meta: Sequence[tuple[str, str, tuple[int, ...]]]) -> str:
        """Receives one update and loads it; the version is read back from the weights the
        engine holds after the reload (the WorkerExtension's load path)."""
        stream = torch.cuda.current_stream()
        received: list[tuple[str, torch.Tensor]] = []
        for name, dtype, shape in meta:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
            self.rlpacer_comm.broadcast(t, src=0, stream=stream)
            received.append((name, t))
        stream.synchronize()
        self.rlpacer_load_tensors(received)  # type: ignore[attr-defined]  # WorkerExtension's
        return str(self.rlpacer_finish_load())  # type: ignore[attr-defined]


def world_size(engine_workers: Iterable[int]) -> int:
    """Rank 0 (the learner) plus every engine's workers (its tensor-parallel size)."""
    return 1 + sum(engine_workers)
