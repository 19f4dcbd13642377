"""Learner replicas as Ray actors (the runtime path of `rlpacer run` and the driver pod): two
replicas train data-parallel on disjoint shards and take one learner's update on the whole
batch; rank 0 publishes the weights into the object store and writes the checkpoint that
every replica resumes from."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rlpacer_trainer import runtime, tiny, weights
from rlpacer_trainer.learner import LearnerConfig, Sample
from rlpacer_trainer.learners import InProcessLearners, LearnerWorker, RayLearners

pytestmark = pytest.mark.e2e
MODEL = str(tiny.resolve_source("builtin://tiny-chain"))
CFG = LearnerConfig(learning_rate=1e-3, mini_batches=2, clip_low=0.2, clip_high=0.28)


def _batch(n: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    return [Sample(tiny.prompt_ids(f"{rng.randint(10, 99)}-{rng.randint(1, 9)}:"),
                   tiny.encode("".join(rng.choice("0123456789,") for _ in range(
                       rng.randint(2, 30)))), rng.uniform(-1.5, 1.5)) for _ in range(n)]


def _norm(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The L2 distance between two state dicts."""
    return sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a) ** 0.5


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    import ray

    runtime.init_ray(num_cpus=2)
    yield
    ray.shutdown()


def test_two_learner_actors_take_one_learners_update(ray_local: None, tmp_path: Path) -> None:
    import ray

    group = RayLearners(MODEL, CFG, 2, num_cpus=0.5, pinned=False)
    single = InProcessLearners(LearnerWorker(MODEL, CFG))
    try:
        infos = group.infos()
        assert [i["rank"] for i in infos] == [0, 1]
        assert len({i["pid"] for i in infos}) == 2  # two processes
        start = group.fingerprints()[0]
        start_sd = {k: v.clone() for k, v in single.model.state_dict().items()}
        for step in range(2):
            batch = _batch(11, seed=step)
            stats = group.train_step(batch)
            single.train_step(batch)
            assert stats["samples"] == 11.0
        fps = group.fingerprints()
        assert fps[0] == fps[1] != start  # the replicas hold identical, updated weights
        blob_ref, version = group.publish()
        assert isinstance(blob_ref, ray.ObjectRef)  # the driver never held the bytes
        got = weights.from_bytes(ray.get(blob_ref))
        assert version == weights.fingerprint(got.items())
        want = single.model.state_dict()
        # equal up to float summation order: the difference is a tiny part of the update
        assert _norm(got, want) < 1e-3 * _norm(want, start_sd), (_norm(got, want),
                                                                  _norm(want, start_sd))

        group.save(tmp_path / "learner.pt")  # rank 0 writes it
        other = RayLearners(MODEL, CFG, 1, num_cpus=0.5, pinned=False)
        try:
            assert other.fingerprints()[0] == start
            other.load(tmp_path / "learner.pt")
            assert other.fingerprints()[0] == fps[0]
            # the optimizer came back too: the next update matches the group's
            batch = _batch(11, seed=9)
            group.train_step(batch)
            other.train_step(batch)
            a = weights.from_bytes(ray.get(group.publish()[0]))
            b = weights.from_bytes(ray.get(other.publish()[0]))
            assert _norm(a, b) < 1e-3 * _norm(want, start_sd)
        finally:
            other.shutdown()
    finally:
        group.shutdown()


WORDPROBLEMS = str(Path(__file__).resolve().parents[2] / "trainer_image" / "rlpacer_trainer"
                   / "assets" / "wordproblems-qwen2")


def _wp_batch(n: int, seed: int) -> list[Sample]:
    """Word problems and their worked solutions, through the word-problem model's own
    tokenizer and chat template."""
    from rlpacer_trainer import models, wordproblems

    tok = models.tokenizer(WORDPROBLEMS, Path(WORDPROBLEMS))
    rng = random.Random(seed)
    out = []
    for ex in wordproblems.make(n, seed=seed):
        resp = tok.tok(ex["solution"], add_special_tokens=False)["input_ids"]  # type: ignore[attr-defined]
        out.append(Sample(tok.prompt_ids(ex["question"]), list(resp), rng.uniform(-1.5, 1.5)))
    return out


def test_four_sharded_ranks_on_two_pods_take_one_learners_update(ray_local: None,
                                                                   tmp_path: Path) -> None:
    """2 learner pods x 2 CPU ranks, FSDP over all four (gloo): after each step the gathered
    weights equal one unsharded learner's on the whole batch, each rank holds a quarter of the
    parameters and optimizer state, the weights leave in buckets whose fingerprint is the
    version, and the 4-rank checkpoint resumes on 2 ranks."""
    import ray

    cfg = LearnerConfig(learning_rate=1e-3, mini_batches=2, clip_low=0.2, clip_high=0.28,
                        micro_batch_tokens=2048, sharding="FSDP",
                        publish_bucket_bytes=64 << 10)
    group = RayLearners(WORDPROBLEMS, cfg, 2, ranks_per_pod=2, num_cpus=0.25, pinned=False)
    single = InProcessLearners(LearnerWorker(
        WORDPROBLEMS, dataclasses.replace(cfg, sharding="Replicated")))
    try:
        infos = group.infos()
        assert [i["rank"] for i in infos] == [0, 1, 2, 3] and all(i["sharded"] for i in infos)
        assert len({i["pid"] for i in infos}) == 4
        start = {k: v.clone() for k, v in single.model.state_dict().items()}
        full = sum(v.numel() * v.element_size() for k, v in start.items()
                   if k != "lm_head.weight")  # tied to the embeddings
        for step in range(3):
            batch = _wp_batch(16, seed=step)
            stats = group.train_step(batch)
            single.train_step(batch)
            blob_ref, version = group.publish()
            refs = ray.get(blob_ref)
            assert isinstance(refs, list) and len(refs) > 1  # several buckets
            got: dict[str, torch.Tensor] = {}
            for r in refs:
                got |= weights.from_bytes(ray.get(r))
            assert version == weights.fingerprint(got.items())
            want = single.model.state_dict()
            moved = _norm(want, start)
            assert moved > 1e-2
            assert _norm(got, want) < 1e-3 * moved, (step, _norm(got, want), moved)
            print(f"step {step}: loss {stats['loss']:.4f}, |sharded - single| ="
                  f" {_norm(got, want):.2e} of an update {moved:.3f}")
        for i in group.infos():
            print("rank", i["rank"], i["bytes"], "of", full)
            assert abs(i["bytes"]["parameters"] / full - 0.25) < 0.03, i
            assert abs(i["bytes"]["optimizer"] / (2 * full) - 0.25) < 0.03, i
        assert len(set(group.fingerprints())) == 1

        group.save(tmp_path / "learner.pt")
        assert len(list((tmp_path / "learner-dcp").glob("*.distcp"))) == 4
        other = RayLearners(WORDPROBLEMS, cfg, 1, ranks_per_pod=2, num_cpus=0.25,
                            pinned=False)
        try:
            other.load(tmp_path / "learner.pt")
            assert other.fingerprints()[0] == group.fingerprints()[0]
            batch = _wp_batch(16, seed=9)
            group.train_step(batch)
            other.train_step(batch)
            single.train_step(batch)
            a = {k: v for r in ray.get(ray.get(group.publish()[0]))
                 for k, v in weights.from_bytes(r).items()}
            b = {k: v for r in ray.get(ray.get(other.publish()[0]))
                 for k, v in weights.from_bytes(r).items()}
            assert _norm(a, b) < 1e-3 * _norm(single.model.state_dict(), start)
        finally:
            other.shutdown()
    finally:
        group.shutdown()


@pytest.mark.parametrize("sharding", ["Replicated", "FSDP"])
def test_a_step_streamed_to_learner_actors_takes_one_learners_update(
        ray_local: None, sharding: str) -> None:
    """``trainer.streamTraining`` over Ray (the driver's path): a step's parts go to the
    ranks as they come (each sample to rank position mod ranks; sharded ranks each get every
    part) and return at once; the finish takes one learner's update on the whole batch, with
    every sample streamed."""
    cfg = dataclasses.replace(CFG, sharding=sharding, kl_coef=0.05, micro_batch_tokens=256)
    group = RayLearners(MODEL, cfg, 2, num_cpus=0.5, pinned=False)
    single = InProcessLearners(LearnerWorker(MODEL, dataclasses.replace(
        cfg, sharding="Replicated")))
    try:
        assert group.sharded == (sharding == "FSDP")
        start = {k: v.clone() for k, v in single.model.state_dict().items()}
        for step in range(2):
            batch = _batch(13, seed=step)
            assert group.stream_begin()
            rng = random.Random(step)
            i = 0
            while i < len(batch):  # groups of 1-4 samples, in the batch's order
                m = rng.randint(1, 4)
                part = list(range(i, min(len(batch), i + m)))
                group.stream_add([batch[j] for j in part], part)
                i += m
            stats = group.stream_finish(batch)
            assert stats["streamed"] == 13.0 and stats["stream_s"] > 0, stats
            assert "stream_refused" not in stats
            single.train_step(batch)
        blob_ref, _ = group.publish()
        import ray

        got_obj = ray.get(blob_ref)
        got: dict[str, torch.Tensor] = {}
        if isinstance(got_obj, list):  # sharded: bucket references
            for r in got_obj:
                got |= weights.from_bytes(ray.get(r))
        else:
            got = weights.from_bytes(got_obj)
        want = single.model.state_dict()
        moved = _norm(want, start)
        assert moved > 1e-2
        assert _norm(got, want) < 1e-3 * moved, (_norm(got, want), moved)
    finally:
        group.shutdown()
        single.shutdown()
