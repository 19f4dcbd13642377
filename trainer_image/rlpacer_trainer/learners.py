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
    """One learner replica; a Ray actor on its pod, or a plain object in-process."""

    def __init__(self, model_path: str, cfg: LearnerConfig, *, rank: int = 0, world: int = 1,
                 threads: int = 1) -> None:
        tiny.set_threads(threads)
        self.rank, self.world = rank, world
        self.model_path = model_path
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        model = models.load_causal_lm(Path(model_path)).to(self.device)
        if self.device == "cuda" and cfg.autocast is None:
            cfg = dataclasses.replace(cfg, autocast="bfloat16")  # float32 master weights
        self.learner = Learner(model, cfg)
        self._group = False
        self._updates = 0  # train steps taken, for the pod's log

    # --- data parallel ----------------------------------------------------------------------
    def rendezvous(self) -> str:
        """Rank 0: the address the others join (this host's address, a free port)."""
        from rlpacer_trainer.engine import host_address

        addr = host_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{addr}:{port}"

    def join(self, init_method: str) -> str:
        import torch.distributed as dist

        backend = "nccl" if self.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=self.rank,
                                world_size=self.world)
        self._group = True
        return backend

    # --- training ---------------------------------------------------------------------------
    def train_step(self, samples: Sequence[Sample], positions: Sequence[int] | None = None,
                   total: int | None = None) -> dict[str, float]:
        from rlpacer_trainer.podlog import pod_log

        shard = None
        if self._group:
            assert positions is not None and total is not None
            shard = Shard(list(positions), total)
        stats = self.learner.train_step(samples, shard)
        self._updates += 1
        pod_log(f"learner rank {self.rank}: update {self._updates} on"
                f" {len(shard.positions) if shard else len(samples)} samples,"
                f" loss {stats.get('loss', float('nan')):.4f}")
        return stats

    def publish(self) -> tuple[bytes, str]:
        """The weights as the engines load them, and their fingerprint (policy version)."""
        return self.learner.publish()

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
        return weights.fingerprint(self.learner.model.state_dict().items())

    # --- checkpoints ------------------------------------------------------------------------
    def save(self, path: str) -> dict[str, bytes] | None:
        """Writes the learner's part of a checkpoint (model, optimizer, RNG) to ``path``, and
        the policy in Hugging Face format beside it (:func:`models.save_hf`: ``model/``).

        ``path``'s folder is the driver's. When it is not on this host (a job without a
        shared checkpoint claim: each pod's checkpoint folder is its own emptyDir), the files
        are returned instead, by path relative to that folder, for the driver to write."""
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
        torch.save({"learner": self.learner.state_dict(), "torch_rng": torch.get_rng_state()},
                   tmp)
        tmp.replace(path)
        models.save_hf(self.learner.model, Path(self.model_path), path.parent / "model")

    def load(self, path: str) -> None:
        blob = torch.load(path, map_location=self.device, weights_only=False)
        self.learner.load_state_dict(blob["learner"])
        if "torch_rng" in blob:
            torch.set_rng_state(blob["torch_rng"].cpu())

    def info(self) -> dict[str, Any]:
        from rlpacer_trainer.engine import host_address, netns_inode

        return {"rank": self.rank, "address": host_address(), "hostname": socket.gethostname(),
                "netns": netns_inode(), "pid": os.getpid(), "device": self.device,
                "threads": torch.get_num_threads()}


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
    """One learner replica in this process."""

    def __init__(self, worker: LearnerWorker) -> None:
        self.worker = worker
        self.replicas = 1

    @property
    def model(self) -> Any:
        return self.worker.learner.model

    def train_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        return self.worker.train_step(samples)

    def publish(self) -> tuple[bytes, str]:
        return self.worker.publish()

    def save(self, path: Path) -> None:
        self.worker.save(str(path))

    def load(self, path: Path) -> None:
        self.worker.load(str(path))

    def infos(self) -> list[dict[str, Any]]:
        return [self.worker.info()]

    def shutdown(self) -> None:
        pass


class RayLearners:
    """``replicas`` learner actors (see the module docstring). ``threads``: torch's intra-op
    threads per replica; 0 picks them: 1 on learner pods (``pinned``), else this host's
    cores divided among the replicas (``rlpacer run``: the learner trains while the engines
    wait, so it gets the cores they generate on; docs/runtime.md has the measurements)."""

    def __init__(self, model_path: str, cfg: LearnerConfig, replicas: int, *,
                 num_cpus: float = 0.5, gpus: int = 0, threads: int = 1,
                 pinned: bool | None = None, wait: bool = True) -> None:
        import ray

        self._ray = ray
        self.replicas = replicas
        if pinned is None:  # pin to learner pods when the cluster has them
            have = ray.cluster_resources()  # type: ignore[no-untyped-call]
            pinned = all(topology.pod_resource("learner", i) in have for i in range(replicas))
        self.threads = threads = pick_threads(threads, pinned=pinned, replicas=replicas)
        actor_cls = ray.remote(LearnerWorker)
        self.actors: list[Any] = []
        for rank in range(replicas):
            opts: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": gpus}
            if pinned:
                opts["resources"] = {topology.pod_resource("learner", rank): 0.01}
            self.actors.append(actor_cls.options(**opts).remote(
                model_path, cfg, rank=rank, world=replicas, threads=threads))
        self._joined = replicas == 1
        if wait:
            self.ready()

    def ready_refs(self) -> list[Any]:
        """Ray references that resolve once every learner is up; from two replicas on they
        join one process group first (the rendezvous waits for the first actor's start)."""
        if not self._joined:
            url = self._ray.get(self.actors[0].rendezvous.remote())
            self._joined = True
            return [a.join.remote(url) for a in self.actors]  # all at once: each blocks
        return [a.info.remote() for a in self.actors]

    def ready(self) -> None:
        """Wait until every learner is up (its model loaded, the process group joined)."""
        self._ray.get(self.ready_refs())

    def train_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        n = len(samples)
        refs = []
        for actor, pos in zip(self.actors, shard_positions(n, self.replicas), strict=True):
            if self.replicas == 1:
                refs.append(actor.train_step.remote(list(samples)))
            else:
                refs.append(actor.train_step.remote([samples[i] for i in pos], pos, n))
        stats = self._ray.get(refs)
        return cast("dict[str, float]", stats[0])

    def publish(self) -> tuple[Any, str]:
        """(an object ref to rank 0's weights, their version): the bytes stay in the object
        store, and each engine's node fetches them from there."""
        blob_ref, version_ref = self.actors[0].publish.options(num_returns=2).remote()
        return blob_ref, str(self._ray.get(version_ref))

    def save(self, path: Path) -> None:
        files = self._ray.get(self.actors[0].save.remote(str(path)))
        for rel, blob in (files or {}).items():  # rank 0 has no access to this folder
            out = path.parent / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(blob)

    def load(self, path: Path) -> None:
        self._ray.get([a.load.remote(str(path)) for a in self.actors])

    def infos(self) -> list[dict[str, Any]]:
        return list(self._ray.get([a.info.remote() for a in self.actors]))

    def nccl_sync(self, engines: Sequence[Any]) -> str:
        """The GPU weight path (UNVERIFIED, :mod:`rlpacer_trainer.nccl_weights`): rank 0
        broadcasts this update to every engine's workers over NCCL; the group is made on first
        use and anew when the engines change. Returns the learner's version."""
        ray = self._ray
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
        return list(self._ray.get([a.fingerprint.remote() for a in self.actors]))

    def shutdown(self) -> None:
        for a in self.actors:
            self._ray.kill(a)


def driver_rng_state() -> dict[str, Any]:
    return {"torch_rng": torch.get_rng_state(), "py_rng": random.getstate()}


def set_driver_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["py_rng"])
