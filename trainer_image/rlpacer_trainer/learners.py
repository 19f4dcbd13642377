"""The learner replicas: where the policy, its optimizer and the reference model live.

A :class:`LearnerWorker` is one replica (rank): it loads the model, trains on its shard of
each batch, and (rank 0) publishes the weights and writes the learner part of checkpoints.
The driver talks to the replicas through a group with one interface:

* :class:`RayLearners`: one Ray actor per replica (``spec.trainer.replicas``), each placed on
  its learner pod when the Ray cluster advertises the pod's resource
  (``rlpacer.io/learner-<i>``, see :mod:`rlpacer_trainer.pod`), else anywhere (the local
  ``rlpacer run``). Two or more replicas train data-parallel with ``torch.distributed``
  (gloo on CPU, NCCL on GPU): rank 0 opens the rendezvous on its own address, every rank
  trains on its own shard and gradients are summed before each optimizer step
  (:class:`rlpacer_trainer.learner.Shard`), so the update equals one learner's on the whole
  batch. The driver holds no weights: rank 0's published weights go straight into Ray's
  object store and the engines fetch them from there, one object per update.
* :class:`InProcessLearners`: one replica in the driver's process (unit tests, scripted
  engines).

The device is CUDA when the replica's process sees a GPU (forward passes in bfloat16 under
autocast, float32 master weights and optimizer state), else the CPU (float32).
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from rlpacer_trainer import models, tiny, topology, weights
from rlpacer_trainer.learner import Learner, LearnerConfig, Sample, Shard


class LearnerWorker:
    """One learner rank; a Ray actor on its pod, or a plain object in-process.

    Sharded (``cfg.sharding == "FSDP"`` with two or more ranks, or on a GPU): the model is
    built when the rank joins the process group (:meth:`join`, :mod:`rlpacer_trainer.sharding`)
    and every rank takes part in :meth:`publish`, :meth:`save` and :meth:`fingerprint` (each
    gathers the shards together). Otherwise each rank holds the whole model from the start."""

    def __init__(self, model_path: str, cfg: LearnerConfig, *, rank: int = 0, world: int = 1,
                 threads: int = 1, ranks_per_host: int = 1) -> None:
        from rlpacer_trainer import fit

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.sharded = is_sharded(cfg, world, gpu=self.device == "cuda")
        # fit before start: this rank's memory against the learner's estimate, before the
        # model loads (LearnerDoesNotFit with the numbers; the driver fails the job with it)
        fit.check_learner(model_path, world=world, sharded=self.sharded,
                          micro_batch_tokens=cfg.micro_batch_tokens,
                          activation_checkpointing=cfg.activation_checkpointing,
                          kl=cfg.kl_coef > 0, device=self.device,
                          ranks_per_host=ranks_per_host)
        tiny.set_threads(threads)
        self.rank, self.world = rank, world
        self.model_path = model_path
        if self.device == "cuda" and cfg.autocast is None:
            cfg = dataclasses.replace(cfg, autocast="bfloat16")  # float32 master weights
        self.cfg = cfg
        self._learner: Learner | None = None
        if not self.sharded:
            model = models.load_causal_lm(Path(model_path)).to(self.device)
            if cfg.activation_checkpointing:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
            self._learner = Learner(model, cfg)
        self._group = False
        self._updates = 0  # train steps taken, for the pod's log

    @property
    def learner(self) -> Learner:
        if self._learner is None:
            raise RuntimeError("a sharded learner rank has no model before it joins its group")
        return self._learner

    # --- the process group ------------------------------------------------------------------
    def rendezvous(self) -> str:
        """Rank 0: the address the others join (this host's address, a free port)."""
        from rlpacer_trainer.engine import host_address

        addr = host_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{addr}:{port}"

    def join(self, init_method: str) -> str:
        """Joins the learners' process group; a sharded rank then loads its shards."""
        import torch.distributed as dist

        backend = "nccl" if self.device == "cuda" else "gloo"
        if self.device == "cuda":
            torch.cuda.set_device(0)  # Ray shows each rank its own GPU
        dist.init_process_group(backend, init_method=init_method, rank=self.rank,
                                world_size=self.world)
        self._group = self.world > 1
        if self.sharded:
            from rlpacer_trainer import sharding

            cfg = self.cfg
            param_dtype = (getattr(torch, cfg.autocast)
                           if self.device == "cuda" and cfg.autocast not in (None, "float32")
                           else None)
            model, ref = sharding.load_sharded(
                Path(self.model_path), rank=self.rank,
                device=torch.device(self.device, 0) if self.device == "cuda"
                else torch.device("cpu"),
                param_dtype=param_dtype, activation_checkpointing=cfg.activation_checkpointing,
                reference=cfg.kl_coef > 0)
            # FSDP casts the gathered parameters itself: no autocast on top
            self._learner = Learner(model, dataclasses.replace(cfg, autocast="float32"),
                                    fsdp=True, ref=ref)
        return backend

    def leave(self) -> None:
        """Leaves the process group, if this rank joined one. The model, optimizer and
        reference go first (FSDP's device mesh holds the group), so the group's threads end
        here and not in the interpreter's teardown, where gloo's can abort the process."""
        import gc

        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if self.world > 1:
            dist.barrier()  # no rank leaves while another still sends to it
        self._learner = None
        gc.collect()
        dist.destroy_process_group()
        self._group = False

    # --- training ---------------------------------------------------------------------------
    def train_step(self, samples: Sequence[Sample], positions: Sequence[int] | None = None,
                   total: int | None = None, mini_batches: int | None = None
                   ) -> dict[str, float]:
        return self._step(self.learner.train_step, samples, positions, total, mini_batches)

    # --- a step streamed in as its groups finish (Learner.stream_add) ------------------------
    def stream_begin(self, mini_batches: int | None = None) -> bool:
        return self.learner.stream_begin(mini_batches)

    def stream_add(self, samples: Sequence[Sample], positions: Sequence[int]) -> None:
        self.learner.stream_add(samples, positions)

    def stream_finish(self, samples: Sequence[Sample], positions: Sequence[int] | None = None,
                      total: int | None = None, mini_batches: int | None = None
                      ) -> dict[str, float]:
        return self._step(self.learner.stream_finish, samples, positions, total, mini_batches)

    def _step(self, take: Any, samples: Sequence[Sample], positions: Sequence[int] | None,
              total: int | None, mini_batches: int | None) -> dict[str, float]:
        """One update (``take``: the learner's whole or streamed step) on this rank's part."""
        from rlpacer_trainer.podlog import pod_log

        shard = None
        if self._group:
            assert positions is not None and total is not None
            shard = Shard(list(positions), total)
        stats: dict[str, float] = take(samples, shard, mini_batches)
        self._updates += 1
        streamed = (f", {int(stats['streamed'])} streamed in {stats.get('stream_s', 0.0):.2f} s"
                    if "streamed" in stats else "")
        pod_log(f"learner rank {self.rank}: update {self._updates} on"
                f" {len(shard.positions) if shard else len(samples)} samples"
                f" ({int(stats.get('micro_batches', 0))} micro-batches{streamed}),"
                f" loss {stats.get('loss', float('nan')):.4f}")
        return stats

    def publish(self) -> tuple[Any, str | None]:
        """The weights as the engines load them, and their fingerprint (policy version).

        Unsharded: one ``torch.save`` blob of the whole state dict. Sharded (every rank calls
        it): the tensors are gathered one at a time, cast to the engines' dtype and packed
        into buckets of at most ``cfg.publish_bucket_bytes``, each put in Ray's object store
        by rank 0 as it fills; rank 0 returns the list of bucket references (the engines
        fetch and load them one by one), the other ranks ``(None, None)``."""
        if not self.sharded:
            return self.learner.publish()
        from rlpacer_trainer import sharding

        dt = getattr(torch, self.cfg.publish_dtype) if self.cfg.publish_dtype else None
        named = sharding.gathered(self.learner.model, dt)
        if self.rank != 0:
            for _ in named:  # this rank's part of each gather
                pass
            return None, None
        import ray

        fp = weights.Fingerprint()
        refs: list[Any] = []  # object refs; bytes in a process without Ray (in-process)
        put = ray.put if ray.is_initialized() else (lambda blob: blob)

        def counted() -> Any:
            for name, t in named:
                fp.add(name, t)
                yield name, t

        for bucket in weights.buckets(counted(), self.cfg.publish_bucket_bytes):
            refs.append(put(weights.to_bytes(bucket)))
        return refs, fp.version()

    def nccl_open(self, host: str, port: int, world_size: int) -> None:
        """Rank 0: open the NCCL weight group at ``host:port`` (from :meth:`rendezvous`) with
        the engines' workers, who join at the same time (GPU; unverified, see
        :mod:`rlpacer_trainer.nccl_weights`)."""
        from rlpacer_trainer import nccl_weights

        self._sender = nccl_weights.Sender(host, port, world_size)

    def nccl_meta(self) -> Any:
        """What the engines allocate before each receive (fixed for a model): the driver sends
        it with every receive call, started together with :meth:`nccl_send`."""
        from rlpacer_trainer import nccl_weights

        return nccl_weights.tensor_meta(self.learner.model.state_dict())

    def nccl_send(self) -> tuple[Any, str]:
        """Rank 0: broadcast this update; returns (the tensors' metadata, the version)."""
        from rlpacer_trainer import nccl_weights

        state = self.learner.model.state_dict()
        self._sender.send(state)
        return nccl_weights.tensor_meta(state), weights.fingerprint(state.items())

    def fingerprint(self) -> str:
        """The fingerprint of the weights this rank's model holds (sharded: of the gathered
        weights, every rank calling), in the engines' dtype: equal to the engines' version."""
        if self.sharded:
            from rlpacer_trainer import sharding

            dt = getattr(torch, self.cfg.publish_dtype) if self.cfg.publish_dtype else None
            fp = weights.Fingerprint()
            for name, t in sharding.gathered(self.learner.model, dt):
                fp.add(name, t)
            return fp.version()
        return weights.fingerprint(self.learner.published_state().items())

    # --- checkpoints ------------------------------------------------------------------------
    def save(self, path: str) -> dict[str, bytes] | None:
        """Writes the learner's part of a checkpoint to ``path`` (``learner.pt``) and the
        policy in Hugging Face format beside it (:func:`models.save_hf`: ``model/``).
        Unsharded: rank 0 writes the whole model, optimizer and RNG to ``learner.pt``.
        Sharded (every rank calls it): each rank writes its shards to ``learner-dcp/`` (a
        ``torch.distributed.checkpoint`` folder) and rank 0 a small ``learner.pt`` that
        points to it, and the gathered policy in ``model/``.

        ``path``'s folder is the driver's. When it is not on this host (a job without a
        shared checkpoint claim: each pod's checkpoint folder is its own emptyDir), the files
        are written to a folder of this host and returned, by path relative to that folder,
        for the driver to write."""
        target = Path(path)
        if target.parent.is_dir():
            self._write(target)
            return None
        import tempfile

        with tempfile.TemporaryDirectory(prefix="rlpacer-ckpt-") as d:
            local = Path(d) / target.name
            self._write(local)
            return {str(f.relative_to(d)): f.read_bytes()
                    for f in sorted(Path(d).rglob("*")) if f.is_file()}

    def _write(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        if not self.sharded:
            torch.save({"learner": self.learner.state_dict(),
                        "torch_rng": torch.get_rng_state()}, tmp)
            tmp.replace(path)
            models.save_hf(self.learner.model, Path(self.model_path), path.parent / "model")
            return
        from rlpacer_trainer import sharding

        sharding.save_dcp(self.learner.model, self.learner.opt, path.parent / sharding.DCP_DIR)
        dt = getattr(torch, self.cfg.publish_dtype) if self.cfg.publish_dtype else None
        full = sharding.full_state(self.learner.model, dt)
        if self.rank == 0:
            assert full is not None
            torch.save({"format": "dcp", "folder": sharding.DCP_DIR, "world": self.world,
                        "updates": self.learner.updates, "torch_rng": torch.get_rng_state()},
                       tmp)
            tmp.replace(path)
            models.save_hf_state(full, Path(self.model_path), path.parent / "model")

    def load(self, path: str) -> None:
        """Loads a checkpoint's learner part, whichever kind wrote it: sharded or not, on any
        number of ranks (every rank calls it)."""
        blob = torch.load(path, map_location="cpu", weights_only=False)
        if blob.get("format") == "dcp":
            from rlpacer_trainer import sharding

            sharding.load_dcp(self.learner.model, self.learner.opt,
                              Path(path).parent / str(blob["folder"]))
            self.learner.updates = int(blob.get("updates", 0))
        elif self.sharded:
            from rlpacer_trainer import sharding

            sharding.load_full(self.learner.model, self.learner.opt, blob["learner"])
            self.learner.updates = int(blob["learner"].get("updates", 0))
        else:
            self.learner.load_state_dict(blob["learner"])
        if "torch_rng" in blob:
            torch.set_rng_state(blob["torch_rng"].cpu())

    def info(self) -> dict[str, Any]:
        from rlpacer_trainer.engine import host_address, netns_inode

        out = {"rank": self.rank, "world": self.world, "sharded": self.sharded,
               "address": host_address(), "hostname": socket.gethostname(),
               "netns": netns_inode(), "pid": os.getpid(), "device": self.device,
               "threads": torch.get_num_threads()}
        if self._learner is not None:
            from rlpacer_trainer import sharding

            out["bytes"] = sharding.local_bytes(self._learner.model, self._learner.opt)
        return out


def is_sharded(cfg: LearnerConfig, world: int, *, gpu: bool) -> bool:
    """Whether the learner is FSDP-sharded: asked for (``cfg.sharding``) and something to
    shard over (two or more ranks) or a GPU (FSDP's mixed precision, even on one)."""
    return cfg.sharding == "FSDP" and (world > 1 or gpu)


def host_cores() -> int:
    """The cores this process may run on (its affinity: a pod's cpuset, else the machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def pick_threads(requested: int, *, pinned: bool, replicas: int) -> int:
    """A learner replica's torch threads: ``requested`` when set (>= 1); 0 (auto): 1 on a
    learner pod (``pinned``, as before), else this host's cores shared by the replicas."""
    if requested >= 1:
        return requested
    return 1 if pinned else max(1, host_cores() // max(1, replicas))


def shard_positions(n: int, world: int) -> list[list[int]]:
    """Positions of a batch of ``n`` per rank: interleaved, so shards differ by one at most."""
    return [list(range(r, n, world)) for r in range(world)]


class InProcessLearners:
    """One learner rank in this process (sharded on a GPU: a group of one, for FSDP's mixed
    precision; its published buckets are bytes, not object refs, without Ray)."""

    def __init__(self, worker: LearnerWorker) -> None:
        self.worker = worker
        self.replicas = 1
        self._streamer: Any = None
        self._streamed: list[Any] = []
        if worker.sharded and worker._learner is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            worker.join(f"tcp://127.0.0.1:{port}")

    @property
    def model(self) -> Any:
        return self.worker.learner.model

    def train_step(self, samples: Sequence[Sample], mini_batches: int | None = None
                   ) -> dict[str, float]:
        return self.worker.train_step(samples, mini_batches=mini_batches)

    def stream_begin(self, mini_batches: int | None = None) -> bool:
        """A streamed step (:meth:`Learner.stream_add`): its parts are trained on one
        background thread, in the order given, while the driver's rollout goes on."""
        from concurrent.futures import ThreadPoolExecutor

        if self._streamer is None:
            self._streamer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")
        self._streamed = []
        return self.worker.stream_begin(mini_batches)

    def stream_add(self, samples: Sequence[Sample], positions: Sequence[int]) -> None:
        assert self._streamer is not None, "stream_begin first"
        self._streamed.append(self._streamer.submit(self.worker.stream_add, list(samples),
                                                    list(positions)))

    def stream_finish(self, samples: Sequence[Sample], mini_batches: int | None = None
                      ) -> dict[str, float]:
        for fut in self._streamed:
            fut.result()  # in order; an error in a streamed part is raised here
        self._streamed = []
        return self.worker.stream_finish(samples, mini_batches=mini_batches)

    def publish(self) -> tuple[Any, str | None]:
        return self.worker.publish()

    def save(self, path: Path) -> None:
        self.worker.save(str(path))

    def load(self, path: Path) -> None:
        self.worker.load(str(path))

    def infos(self) -> list[dict[str, Any]]:
        return [self.worker.info()]

    def shutdown(self) -> None:
        if self._streamer is not None:
            self._streamer.shutdown(wait=True)
        self.worker.leave()


class RayLearners:
    """The learner's ranks as Ray actors (see the module docstring): ``replicas`` learner pods
    with ``ranks_per_pod`` ranks each (one per GPU: ``gpus`` = 1 per rank; or CPU ranks),
    rank r on pod r // ranks_per_pod. ``threads``: torch's intra-op threads per rank; 0
    picks them: 1 on learner pods (``pinned``), else this host's cores divided among the
    ranks (``rlpacer run``: the learner trains while the engines wait, so it gets the cores
    they generate on; docs/runtime.md has the measurements)."""

    def __init__(self, model_path: str, cfg: LearnerConfig, replicas: int, *,
                 ranks_per_pod: int = 1, num_cpus: float = 0.5, gpus: int = 0,
                 threads: int = 1, pinned: bool | None = None, wait: bool = True) -> None:
        import ray

        self._ray = ray
        self.pods = replicas
        self.replicas = world = replicas * ranks_per_pod  # ranks
        self.sharded = is_sharded(cfg, world, gpu=gpus > 0)
        if pinned is None:  # pin to learner pods when the cluster has them
            have = ray.cluster_resources()  # type: ignore[no-untyped-call]
            pinned = all(topology.pod_resource("learner", i) in have for i in range(replicas))
        self.threads = threads = pick_threads(threads, pinned=pinned, replicas=world)
        actor_cls = ray.remote(LearnerWorker)
        self.actors: list[Any] = []
        for rank in range(world):
            opts: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": 1 if gpus > 0 else 0}
            if pinned:
                pod = rank // ranks_per_pod
                opts["resources"] = {topology.pod_resource("learner", pod): 0.01}
            self.actors.append(actor_cls.options(**opts).remote(
                model_path, cfg, rank=rank, world=world, threads=threads,
                ranks_per_host=ranks_per_pod if pinned else world))
        self._joined = world == 1 and not self.sharded
        if wait:
            self.ready()

    def ready_refs(self) -> list[Any]:
        """Ray references that resolve once every learner is up; from two ranks on (or one
        sharded GPU rank) they join one process group first (the rendezvous waits for the
        first actor's start), and sharded ranks load their shards then."""
        if not self._joined:
            url = self._ray.get(self.actors[0].rendezvous.remote())
            self._joined = True
            return [a.join.remote(url) for a in self.actors]  # all at once: each blocks
        return [a.info.remote() for a in self.actors]

    def ready(self) -> None:
        """Wait until every learner is up (its model loaded, the process group joined)."""
        self._ray.get(self.ready_refs())

    def train_step(self, samples: Sequence[Sample], mini_batches: int | None = None
                   ) -> dict[str, float]:
        return self._update("train_step", samples, mini_batches)

    def _update(self, method: str, samples: Sequence[Sample], mini_batches: int | None
                ) -> dict[str, float]:
        """``method`` (the ranks' whole or streamed step) on each rank's shard of the batch."""
        n = len(samples)
        refs = []
        for actor, pos in zip(self.actors, shard_positions(n, self.replicas), strict=True):
            if self.replicas == 1:
                refs.append(getattr(actor, method).remote(list(samples),
                                                          mini_batches=mini_batches))
            else:
                refs.append(getattr(actor, method).remote([samples[i] for i in pos], pos, n,
                                                          mini_batches=mini_batches))
        return self._combine(cast("list[dict[str, float]]", self._ray.get(refs)))

    def stream_begin(self, mini_batches: int | None = None) -> bool:
        """A streamed step (:meth:`Learner.stream_add`) on every rank."""
        self._stream_refs: list[Any] = []
        return all(self._all("stream_begin", mini_batches))

    def stream_add(self, samples: Sequence[Sample], positions: Sequence[int]) -> None:
        """Samples at their batch positions, each to the rank :func:`shard_positions` gives
        it (position mod ranks); sharded ranks each get every part (their share may be
        empty: they make their passes together). Returns at once: each rank trains its parts
        in the order sent while the rollout goes on."""
        world = self.replicas
        for rank, actor in enumerate(self.actors):
            mine = [k for k, pos in enumerate(positions) if pos % world == rank]
            if not mine and not self.sharded:
                continue
            self._stream_refs.append(actor.stream_add.remote(
                [samples[k] for k in mine], [positions[k] for k in mine]))

    def stream_finish(self, samples: Sequence[Sample], mini_batches: int | None = None
                      ) -> dict[str, float]:
        """The streamed step completed on the whole batch (as :meth:`train_step`)."""
        self._ray.get(getattr(self, "_stream_refs", []))  # an error in a part is raised here
        self._stream_refs = []
        return self._update("stream_finish", samples, mini_batches)

    @staticmethod
    def _combine(stats: list[dict[str, float]]) -> dict[str, float]:
        out = dict(stats[0])
        # each rank's loss and KL are its samples' share of the batch's (normalized by the
        # whole batch's count): the batch's are their sums
        for key in ("loss", "kl"):
            out[key] = sum(s.get(key, 0.0) for s in stats)
        out["clipfrac"] = sum(s.get("clipfrac", 0.0) for s in stats) / len(stats)
        if "streamed" in out:
            out["streamed"] = sum(s.get("streamed", 0.0) for s in stats)
            out["stream_s"] = max(s.get("stream_s", 0.0) for s in stats)
        return out

    def _all(self, method: str, *args: Any) -> list[Any]:
        """``method`` on every rank (sharded: each gathers with the others)."""
        return list(self._ray.get([getattr(a, method).remote(*args) for a in self.actors]))

    def publish(self) -> tuple[Any, str]:
        """(an object ref to rank 0's weights, their version): the bytes stay in the object
        store, and each engine's node fetches them from there. Sharded: every rank gathers,
        and the ref is to rank 0's list of bucket references."""
        if self.sharded:
            refs = [a.publish.options(num_returns=2).remote() for a in self.actors]
            blob_ref, version_ref = refs[0]
            self._ray.get([v for _, v in refs])  # every rank's part of the gathers done
            return blob_ref, str(self._ray.get(version_ref))
        blob_ref, version_ref = self.actors[0].publish.options(num_returns=2).remote()
        return blob_ref, str(self._ray.get(version_ref))

    def save(self, path: Path) -> None:
        actors = self.actors if self.sharded else self.actors[:1]
        for files in self._ray.get([a.save.remote(str(path)) for a in actors]):
            for rel, blob in (files or {}).items():  # the rank has no access to this folder
                out = path.parent / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(blob)

    def load(self, path: Path) -> None:
        self._all("load", str(path))

    def infos(self) -> list[dict[str, Any]]:
        return self._all("info")

    def nccl_sync(self, engines: Sequence[Any]) -> str:
        """The GPU weight path (UNVERIFIED, :mod:`rlpacer_trainer.nccl_weights`): rank 0
        broadcasts this update to every engine's workers over NCCL; the group is made on first
        use and anew when the engines change. Returns the learner's version."""
        ray = self._ray
        if self.sharded:
            raise RuntimeError("RLPACER_WEIGHT_TRANSPORT=nccl sends rank 0's whole model: it"
                               " needs spec.trainer.sharding: Replicated")
        rank0 = self.actors[0]
        key = tuple(id(e) for e in engines)
        if getattr(self, "_nccl_key", None) != key:
            url = ray.get(rank0.rendezvous.remote())
            host, port = url.removeprefix("tcp://").rsplit(":", 1)
            tp = [int(e.tensor_parallel_size) for e in engines]
            world = 1 + sum(tp)
            offsets = [1 + sum(tp[:i]) for i in range(len(tp))]
            ray.get([rank0.nccl_open.remote(host, int(port), world)]
                    + [e.actor.nccl_join.remote(host, int(port), off, world)
                       for e, off in zip(engines, offsets, strict=True)])
            self._nccl_meta = ray.get(rank0.nccl_meta.remote())
            self._nccl_key = key
        send = rank0.nccl_send.remote()
        got = ray.get([e.actor.nccl_receive.remote(self._nccl_meta) for e in engines])
        _, version = ray.get(send)
        stale = [v for v in got if v != version]
        if stale:
            raise RuntimeError(f"NCCL weight sync: engines hold {stale}, learner {version}")
        return str(version)

    def fingerprints(self) -> list[str]:
        """Each rank's fingerprint of the weights it holds (sharded: of the gathered model,
        so all equal) in the engines' dtype."""
        return [str(v) for v in self._all("fingerprint")]

    def shutdown(self) -> None:
        for a in self.actors:
            self._ray.kill(a)


def driver_rng_state() -> dict[str, Any]:
    return {"torch_rng": torch.get_rng_state(), "py_rng": random.getstate()}


def set_driver_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["py_rng"])
