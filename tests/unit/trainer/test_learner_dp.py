"""Data-parallel learners: two ranks (torch.distributed, gloo) on disjoint shards of a batch
take exactly the update one learner takes on the whole batch."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rlpacer_trainer import algos, tiny
from rlpacer_trainer.learner import Learner, LearnerConfig, Sample, Shard

pytestmark = pytest.mark.unit


def _batch(n: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [tiny.BOS_ID, *tiny.encode(f"{rng.randint(10, 99)}-{rng.randint(1, 9)}:")]
        resp = tiny.encode("".join(rng.choice("0123456789,") for _ in range(rng.randint(2, 30))))
        out.append(Sample(prompt, resp, rng.uniform(-1.5, 1.5)))
    return out


def _learner(cfg: LearnerConfig) -> Learner:
    torch.manual_seed(0)
    return Learner(tiny.new_model(seed=1), cfg)


def _rank(rank: int, world: int, port: int, cfg: LearnerConfig, n: int, steps: int,
          out: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        learner = _learner(cfg)
        for step in range(steps):
            batch = _batch(n, seed=step)
            # an uneven split: rank 0 gets every third sample, rank 1 the rest
            mine = [i for i in range(n) if (i % 3 == 0) == (rank == 0)]
            learner.train_step([batch[i] for i in mine], Shard(mine, n))
        torch.save(learner.model.state_dict(), out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("aggregation", [algos.LossAggregation.TOKEN_MEAN.value,
                                         algos.LossAggregation.SEQUENCE_MEAN_TOKEN_MEAN.value])
def test_two_ranks_on_shards_equal_one_learner_on_the_batch(aggregation: str,
                                                           tmp_path: Path) -> None:
    cfg = LearnerConfig(learning_rate=1e-3, mini_batches=2, aggregation=aggregation,
                        kl_coef=0.05, clip_low=0.2, clip_high=0.28)
    n, steps = 10, 2
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, cfg, n, steps, tmp_path))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert p.exitcode == 0
    got = {r: torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)}

    single = _learner(cfg)
    start = {k: v.clone() for k, v in single.model.state_dict().items()}
    for step in range(steps):
        single.train_step(_batch(n, seed=step))
    want = single.model.state_dict()
    # a shard trained alone (what DP without the all-reduce would do) moves elsewhere
    alone = _learner(cfg)
    for step in range(steps):
        alone.train_step([s for i, s in enumerate(_batch(n, seed=step)) if i % 3 == 0])

    def dist_(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a) ** 0.5

    # equal up to float summation order (Adam's normalization lifts a 1e-9 difference in a
    # near-zero gradient to ~1e-6 in that weight): a tiny part of the update
    update = dist_(want, start)
    assert update > 1e-2  # the update moved the weights
    assert dist_(alone.model.state_dict(), want) > 0.05 * update  # a shard alone: elsewhere
    for rank in (0, 1):
        assert dist_(got[rank], want) < 1e-3 * update, (rank, dist_(got[rank], want), update)
