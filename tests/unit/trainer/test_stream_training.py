"""Stream training: the learner makes a step's passes as its groups come in, and the update
is the one it takes on the whole batch.

:meth:`Learner.stream_add` takes samples at their positions in the batch, in any order and
any parts, while the rollout runs; :meth:`Learner.stream_finish` completes the step once the
batch is whole. The weights after it equal :meth:`Learner.train_step`'s on the same batch
(float summation order aside), for one or more mini-batches, with or without the KL term,
for both loss aggregations, and on two data-parallel ranks; a batch that is not what was
streamed is trained whole instead (never a wrong update)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from test_learner_dp import _batch, _learner  # the same batches and starting learner

from rlpacer_trainer import algos, tiny
from rlpacer_trainer.learner import Learner, LearnerConfig, Sample, Shard

pytestmark = pytest.mark.unit


def _parts(n: int, seed: int) -> list[list[int]]:
    """Positions 0..n-1 in groups of 1-5, the groups in a shuffled order (groups finish in
    any order; the driver streams them in the batch's order, but the learner need not care)."""
    rng = random.Random(seed)
    parts, i = [], 0
    while i < n:
        m = rng.randint(1, 5)
        parts.append(list(range(i, min(n, i + m))))
        i += m
    rng.shuffle(parts)
    return parts


def _close(a: Learner, b: Learner) -> float:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


@pytest.mark.parametrize(("k", "kl", "aggregation", "budget"), [
    (1, 0.0, algos.LossAggregation.TOKEN_MEAN.value, 0),
    (2, 0.0, algos.LossAggregation.TOKEN_MEAN.value, 0),
    (2, 0.05, algos.LossAggregation.TOKEN_MEAN.value, 120),
    (3, 0.05, algos.LossAggregation.SEQUENCE_MEAN_TOKEN_MEAN.value, 0),
])
def test_a_streamed_step_takes_the_whole_batchs_update(k: int, kl: float, aggregation: str,
                                                       budget: int) -> None:
    cfg = LearnerConfig(learning_rate=1e-3, mini_batches=k, aggregation=aggregation,
                        kl_coef=kl, clip_low=0.2, clip_high=0.28, micro_batch_tokens=budget,
                        warmup_updates=3, reference_samples=16)
    whole, streamed = _learner(cfg), _learner(cfg)
    start = {n: v.clone() for n, v in whole.model.state_dict().items()}
    for step in range(3):  # the later steps start from moved weights and optimizer moments
        batch = _batch(13, seed=step)
        ref_stats = whole.train_step(batch)
        assert streamed.stream_begin()
        for part in _parts(len(batch), seed=step):
            streamed.stream_add([batch[i] for i in part], part)
        stats = streamed.stream_finish(batch)
        assert stats["streamed"] == len(batch) and stats["stream_s"] > 0
        assert "stream_refused" not in stats
        assert stats["loss"] == pytest.approx(ref_stats["loss"], rel=1e-4, abs=1e-6)
        assert stats["kl"] == pytest.approx(ref_stats["kl"], rel=1e-4, abs=1e-7)
        assert stats["clipfrac"] == pytest.approx(ref_stats["clipfrac"], abs=1e-6)
    assert whole.updates == streamed.updates == 3 * k
    assert _close(whole, streamed) < 1e-5
    moved = max(float((v - start[n]).abs().max()) for n, v in whole.model.state_dict().items())
    assert moved > 1e-3  # the steps did train: equal, not both unchanged


def test_a_batch_other_than_the_one_streamed_is_trained_whole() -> None:
    cfg = LearnerConfig(learning_rate=1e-3, mini_batches=2)
    batch = _batch(9, seed=4)
    cases = {
        "a sample missing": (batch[:-1], batch),
        "a sample changed": ([*batch[:-1], Sample(batch[-1].prompt_ids,
                                                   batch[-1].response_ids, 0.5)], batch),
        "fewer samples than mini-batches": (batch[:1], batch[:1]),
    }
    for what, (streamed_part, trained) in cases.items():
        whole, learner = _learner(cfg), _learner(cfg)
        whole.train_step(trained)
        learner.stream_begin()
        learner.stream_add(streamed_part, list(range(len(streamed_part))))
        stats = learner.stream_finish(trained)
        assert stats["streamed"] == 0, what
        assert stats.get("stream_refused") == 1.0 or len(trained) < 2, what
        assert _close(whole, learner) < 1e-6, what
    # positions given twice: the stream is refused at the finish, the step still whole
    whole, learner = _learner(cfg), _learner(cfg)
    whole.train_step(batch)
    learner.stream_begin()
    learner.stream_add(batch[:3], [0, 1, 2])
    learner.stream_add(batch[2:4], [2, 3])
    stats = learner.stream_finish(batch)
    assert stats["streamed"] == 0 and stats["stream_refused"] == 1.0
    assert _close(whole, learner) < 1e-6
    # no stream begun: the whole step
    learner = _learner(cfg)
    assert learner.stream_finish(batch)["streamed"] == 0


def _rank(rank: int, world: int, port: int, cfg: LearnerConfig, n: int, out: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        learner = _learner(cfg)
        for step in range(2):
            batch = _batch(n, seed=step)
            mine = list(range(rank, n, world))  # as RayLearners shards a batch
            learner.stream_begin()
            for part in _parts(n, seed=step):
                pos = [i for i in part if i % world == rank]
                learner.stream_add([batch[i] for i in pos], pos)
            stats = learner.stream_finish([batch[i] for i in mine], Shard(mine, n))
            assert stats["streamed"] == len(mine), stats
        torch.save(learner.model.state_dict(), out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("world", "n"), [(2, 11), (3, 2)])
def test_data_parallel_ranks_streaming_equal_one_learner_on_the_batch(
        tmp_path: Path, world: int, n: int) -> None:
    """Two ranks; and three on a batch of two, so that one rank's shard is empty."""
    cfg = LearnerConfig(learning_rate=1e-3, mini_batches=2, kl_coef=0.05)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, port, cfg, n, tmp_path))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert p.exitcode == 0
    single = _learner(cfg)
    start = {k: v.clone() for k, v in single.model.state_dict().items()}
    for step in range(2):
        single.train_step(_batch(n, seed=step))
    want = single.model.state_dict()
    update = sum(float((want[k] - start[k]).double().pow(2).sum()) for k in want) ** 0.5
    assert update > 1e-2
    for r in range(world):  # equal up to float summation order, as test_learner_dp's
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        off = sum(float((got[k] - want[k]).double().pow(2).sum()) for k in want) ** 0.5
        assert off < 1e-3 * update, (r, off, update)


def _fsdp_rank(rank: int, world: int, port: int, model: str, out: str) -> None:
    from rlpacer_trainer import learners, sharding

    cfg = LearnerConfig(learning_rate=1e-3, mini_batches=2, kl_coef=0.05, clip_low=0.2,
                        clip_high=0.28, micro_batch_tokens=80, sharding="FSDP")
    w = learners.LearnerWorker(model, cfg, rank=rank, world=world, threads=1)
    assert w.sharded
    w.join(f"tcp://127.0.0.1:{port}")
    n = 12
    for step in range(2):
        batch = _batch(n, seed=step)
        assert w.stream_begin()
        for part in _parts(n, seed=step):  # as RayLearners: every rank every part
            pos = [i for i in part if i % world == rank]
            w.stream_add([batch[i] for i in pos], pos)
        mine = learners.shard_positions(n, world)[rank]
        stats = w.stream_finish([batch[i] for i in mine], mine, n)
        assert stats["streamed"] == len(mine) and "stream_refused" not in stats, stats
    full = sharding.full_state(w.learner.model, None)
    if rank == 0:
        assert full is not None
        torch.save(full, Path(out, "fsdp.pt"))
    w.leave()


def test_sharded_fsdp_ranks_streaming_equal_one_learner_on_the_batch(tmp_path: Path) -> None:
    """FSDP ranks make every pass together (each forward gathers, each backward
    reduce-scatters): each is given every part, its share possibly empty, and pads with
    dummy passes; the update is still one learner's on the whole batch."""
    from rlpacer_trainer import models, sharding

    model_dir = tmp_path / "tiny"
    tiny.save_model(tiny.new_model(seed=1), model_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=sharding.spawned_rank,
                         args=(_fsdp_rank, r, 2, port, str(model_dir), str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    cfg = LearnerConfig(learning_rate=1e-3, mini_batches=2, kl_coef=0.05, clip_low=0.2,
                        clip_high=0.28, micro_batch_tokens=80)
    single = Learner(models.load_causal_lm(model_dir), cfg)
    start = {k: v.clone() for k, v in single.model.state_dict().items()}
    for step in range(2):
        single.train_step(_batch(12, seed=step))
    want = single.model.state_dict()
    got = torch.load(tmp_path / "fsdp.pt", weights_only=True)
    # equal up to float summation order (as test_learner_fsdp measures it: L2 over all
    # weights, against the update's own size)
    update = sum(float((want[k] - start[k]).double().pow(2).sum()) for k in want) ** 0.5
    off = sum(float((got[k] - want[k]).double().pow(2).sum()) for k in want) ** 0.5
    assert update > 1e-2
    assert off < 1e-3 * update, (off, update)


def test_an_update_asked_for_more_mini_batches_takes_them_streamed_or_whole() -> None:
    """A long round of several steps' prompts (tailBatching.longRound.prompts) is trained in
    ``mini_batches`` optimizer steps given per update: the same update a learner configured
    with that many takes, streamed or whole; a stream begun for another count is trained
    whole at the count the finish asks for."""
    cfg = LearnerConfig(learning_rate=1e-3, mini_batches=2, warmup_updates=3)
    wide = LearnerConfig(learning_rate=1e-3, mini_batches=6, warmup_updates=3)
    batch = _batch(13, seed=7)
    ref = _learner(wide)
    ref_stats = ref.train_step(batch)
    asked = _learner(cfg)
    stats = asked.train_step(batch, mini_batches=6)
    assert ref.updates == asked.updates == 6 and stats["updates"] == ref_stats["updates"] == 6
    assert _close(ref, asked) < 1e-6
    streamed = _learner(cfg)
    assert streamed.stream_begin(6)
    for part in _parts(len(batch), seed=7):
        streamed.stream_add([batch[i] for i in part], part)
    st = streamed.stream_finish(batch, mini_batches=6)
    assert st["streamed"] == len(batch) and st["updates"] == 6 and streamed.updates == 6
    assert _close(ref, streamed) < 1e-5
    other = _learner(cfg)
    assert other.stream_begin()  # the configured 2
    other.stream_add(batch, list(range(len(batch))))
    st = other.stream_finish(batch, mini_batches=6)
    assert st["stream_refused"] == 1.0 and st["updates"] == 6 and _close(ref, other) < 1e-6
    plain = _learner(cfg)
    assert plain.train_step(batch)["updates"] == 2 and _close(ref, plain) > 1e-4
    with pytest.raises(TypeError, match="mini_batches"):
        plain.train_step(batch, mini_batches=2.5)  # type: ignore[arg-type]
