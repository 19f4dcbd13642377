"""The sharded learner: FSDP (PyTorch's ``fully_shard``, FSDP2) over every learner rank.

One rank per trainer GPU (``spec.trainer.gpusPerReplica`` ranks on each trainer pod; without
GPUs ``spec.trainer.cpuRanksPerReplica``), one process group across all of them. Each decoder
layer is its own FSDP unit, the embeddings and head the root's: parameters, gradients and the
AdamW state are sharded, so a rank holds about 1/world of each. On a GPU the forward and
backward run in bfloat16 (gathered parameters in bfloat16, gradients reduced in float32 into
float32 master shards: ``MixedPrecisionPolicy``); on the CPU everything is float32.

Loading: only rank 0 reads the model's files (one full copy in host memory, briefly); every
rank builds the model on the ``meta`` device, shards it, allocates its own shards and
receives them from rank 0 (``set_model_state_dict(broadcast_from_rank0=True)``), so a node's
host memory holds one copy, not one per GPU.

The weights leave the shards for the engines one tensor at a time (:func:`gathered`): all
ranks gather a tensor together, rank 0 casts it to the engines' dtype and packs it into a
bucket, so no rank ever holds the whole model in the learner's float32.

Checkpoints are ``torch.distributed.checkpoint`` folders (each rank writes its shards, rank 0
the metadata) and load on any number of ranks: DCP re-slices the saved shards for the
loading world (4 -> 2 and 2 -> 4 are tested), and an unsharded learner loads them too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

#: A DCP checkpoint's folder, beside ``learner.pt`` in a checkpoint.
DCP_DIR = "learner-dcp"


def decoder_layers(model: Any) -> list[Any]:
    """The model's transformer blocks (each becomes an FSDP unit): the ModuleList a Hugging
    Face causal LM keeps at ``model.model.layers`` (Qwen2, Llama, Mistral, ...), else every
    module whose class name ends in ``DecoderLayer``."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        return list(layers)
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def shard(model: Any, *, param_dtype: torch.dtype | None,
          activation_checkpointing: bool) -> Any:
    """Applies activation checkpointing (when asked) and FSDP to ``model`` in place.

    ``param_dtype``: the dtype of the gathered parameters in forward and backward (bfloat16
    on a GPU), gradients reduced in float32; None: the parameters' own (float32). Gradients
    are summed over the ranks (not averaged): each rank's loss is already normalized by the
    whole batch's count (:class:`rlpacer_trainer.learner.Shard`)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if activation_checkpointing:
        # recompute each layer's activations in backward (non-reentrant: works under FSDP)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
          if param_dtype is not None else MixedPrecisionPolicy())
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return model


def load_sharded(model_path: Path, *, rank: int, device: torch.device,
                 param_dtype: torch.dtype | None, activation_checkpointing: bool,
                 reference: bool = False) -> tuple[Any, Any]:
    """The policy, sharded over the default process group, with the weights of
    ``model_path`` (read on rank 0 only, broadcast shard by shard); with ``reference`` also a
    frozen sharded copy (the KL reference model), else None. Every rank calls this."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlpacer_trainer import models

    config = AutoConfig.from_pretrained(str(model_path), local_files_only=True)
    full = models.load_causal_lm(model_path) if rank == 0 else None
    full_sd = full.state_dict() if full is not None else {}
    # non-persistent buffers (rotary frequencies) are not in a state dict: sent as well
    buffers = ({k: v.detach().clone() for k, v in full.named_buffers()}
               if full is not None else None)

    def build(ac: bool) -> Any:
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        m.tie_weights()
        shard(m, param_dtype=param_dtype, activation_checkpointing=ac)
        m.to_empty(device=device)
        set_model_state_dict(m, dict(full_sd), options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        for name, buf in m.named_buffers():
            src = (buffers[name].to(device) if buffers is not None
                   else torch.empty_like(buf))
            dist.broadcast(src, src=0)
            buf.copy_(src)
        return m

    model = build(activation_checkpointing)
    ref = None
    if reference:
        ref = build(False).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
    return model, ref


def local_bytes(model: Any, opt: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters and optimizer state this rank holds (its shards)."""

    def nbytes(t: torch.Tensor) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return int(local.numel() * local.element_size())

    out = {"parameters": sum(nbytes(p) for p in model.parameters())}
    if opt is not None:
        out["optimizer"] = sum(nbytes(v) for st in opt.state.values() for v in st.values()
                               if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out


def gathered(model: Any, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` of the model's state dict, one tensor at a time, on CPU in
    ``dtype`` (None: as held); every rank must iterate it to the end together (each sharded
    tensor is an all-gather)."""
    for name, t in model.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        full = full.detach()
        if dtype is not None and full.is_floating_point():
            full = full.to(dtype)
        yield name, full.cpu().contiguous()


# --- checkpoints --------------------------------------------------------------------------------
def save_dcp(model: Any, opt: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank writes its shards of the model and optimizer to ``folder``."""
    from torch.distributed.checkpoint import state_dict_saver
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    state_dict_saver.save({"model": msd, "optim": osd}, checkpoint_id=str(folder))


def load_dcp(model: Any, opt: torch.optim.Optimizer, folder: Path) -> None:
    """Loads a :func:`save_dcp` folder written by any number of ranks into this learner
    (sharded on any number of ranks, or not sharded)."""
    from torch.distributed.checkpoint import state_dict_loader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)  # the templates: this world's shards
    state_dict_loader.load({"model": msd, "optim": osd}, checkpoint_id=str(folder))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


def load_full(model: Any, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """Loads an unsharded learner's state (``Learner.state_dict()``: the model's state dict
    and ``torch.optim`` state keyed by parameter number) into a sharded learner."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, sd["model"], options=full)
    names = [n for n, _ in model.named_parameters()]
    osd = sd["opt"]
    by_name = {"state": {names[int(i)]: st for i, st in osd["state"].items()},
               "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                                for g in osd["param_groups"]]}
    set_optimizer_state_dict(model, opt, by_name, options=full)  # type: ignore[arg-type]


def full_state(model: Any, dtype: torch.dtype | None) -> dict[str, torch.Tensor] | None:
    """Rank 0: the whole state dict on CPU in ``dtype``; other ranks: None (all call it)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    out: dict[str, torch.Tensor] = {}
    for name, t in gathered(model, dtype):
        if rank == 0:
            out[name] = t
    return out if rank == 0 else None


def spawned_rank(fn: Callable[..., None], *args: Any) -> None:
    """The body of a learner rank in a spawned process (the GPU check, the memory bench, the
    tests): ``fn(*args)``, then the process ends at once, skipping the interpreter's teardown
    (a rank's results are written by then; gloo's threads torn down there can abort an
    otherwise finished rank). A rank that raises exits as multiprocessing makes it (1)."""
    fn(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
