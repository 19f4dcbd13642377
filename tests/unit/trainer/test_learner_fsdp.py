"""The sharded learner (FSDP over gloo ranks, :mod:`rlpacer_trainer.sharding`): its updates
equal one unsharded learner's on the whole batch, each rank holds 1/world of the parameters
and optimizer state, and its checkpoints resume on another number of ranks (4 -> 2, 2 -> 4)."""

from __future__ import annotations

import dataclasses
import json
import random
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rlpacer_trainer import learners, models, sharding, tiny, weights
from rlpacer_trainer.learner import Learner, LearnerConfig, Sample

pytestmark = pytest.mark.unit

#: a small budget: several micro-batches per mini-batch, a different number on each rank
CFG = LearnerConfig(learning_rate=1e-3, mini_batches=2, kl_coef=0.05, clip_low=0.2,
                    clip_high=0.28, micro_batch_tokens=80, sharding="FSDP")
N = 12  # samples per step


def _batch(step: int) -> list[Sample]:
    rng = random.Random(step)
    out = []
    for _ in range(N):
        prompt = [tiny.BOS_ID, *tiny.encode(f"{rng.randint(10, 99)}-{rng.randint(1, 9)}:")]
        resp = tiny.encode("".join(rng.choice("0123456789,") for _ in range(rng.randint(2, 30))))
        out.append(Sample(prompt, resp, rng.uniform(-1.5, 1.5)))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, model: str, steps: list[int], resume: str | None,
          out: str, ac: bool) -> None:
    import torch.distributed as dist

    cfg = dataclasses.replace(CFG, activation_checkpointing=ac)
    w = learners.LearnerWorker(model, cfg, rank=rank, world=world, threads=1)
    assert w.sharded
    try:
        w.join(f"tcp://127.0.0.1:{port}")
        if resume:
            w.load(resume)
        for step in steps:
            batch = _batch(step)
            pos = learners.shard_positions(N, world)[rank]
            stats = w.train_step([batch[i] for i in pos], pos, N)
        full = sharding.full_state(w.learner.model, None)
        version = w.fingerprint()  # every rank gathers
        info = w.info()
        ckpt = Path(out, f"ckpt-{world}")
        ckpt.mkdir(exist_ok=True)
        if world == 2:
            # a checkpoint folder this rank cannot see (no shared claim): each rank writes
            # its part here and returns the files, which the driver writes (as RayLearners)
            files = w.save(str(Path(out, "not-mounted", f"step-{world}", "learner.pt")))
            assert files is not None
            for rel, blob in files.items():
                (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
                (ckpt / rel).write_bytes(blob)
        else:
            assert w.save(str(ckpt / "learner.pt")) is None
        Path(out, f"info-{world}-{rank}.json").write_text(json.dumps(
            {"bytes": info["bytes"], "version": version, "micro": stats["micro_batches"]}))
        if rank == 0:
            assert full is not None
            torch.save(full, Path(out, f"weights-{world}.pt"))
    finally:
        dist.destroy_process_group()


def _run(world: int, model: Path, steps: list[int], out: Path, resume: Path | None = None,
         ac: bool = False) -> None:
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=sharding.spawned_rank,
                         args=(_rank, r, world, port, str(model), steps,
                               str(resume) if resume else None, str(out), ac))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0] * world


def _dist(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a) ** 0.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny")
    tiny.save_model(tiny.new_model(seed=1), d)
    return d


def _single(model_dir: Path, steps: int, micro_batch_tokens: int = 80) -> Learner:
    cfg = dataclasses.replace(CFG, sharding="Replicated", micro_batch_tokens=micro_batch_tokens)
    one = Learner(models.load_causal_lm(model_dir), cfg)
    for step in range(steps):
        one.train_step(_batch(step))
    return one


def test_micro_batches_leave_the_update_unchanged(model_dir: Path) -> None:
    """Gradients summed over micro-batches (each normalized by the whole mini-batch's count)
    are the mini-batch's: the same update as one pass per mini-batch."""
    start = models.load_causal_lm(model_dir).state_dict()
    whole = _single(model_dir, 2, micro_batch_tokens=0).model.state_dict()
    parts = _single(model_dir, 2, micro_batch_tokens=80)
    parts2 = {k: v.clone() for k, v in parts.model.state_dict().items()}
    assert parts.train_step(_batch(5))["micro_batches"] >= 6  # several per mini-batch
    update = _dist(whole, start)
    assert update > 1e-2
    assert _dist(parts2, whole) < 1e-3 * update


def test_fsdp_ranks_equal_one_learner_hold_a_quarter_and_resume_on_another_world(
        model_dir: Path, tmp_path: Path) -> None:
    start = {k: v.clone() for k, v in models.load_causal_lm(model_dir).state_dict().items()}
    want2 = _single(model_dir, 2).model.state_dict()
    _run(4, model_dir, [0, 1], tmp_path)
    got4 = torch.load(tmp_path / "weights-4.pt", weights_only=True)
    update = _dist(want2, start)
    assert update > 1e-2
    # equal up to float summation order (as the replicated data-parallel learner)
    assert _dist(got4, want2) < 1e-3 * update, (_dist(got4, want2), update)

    # each of 4 ranks holds a quarter of the parameters and of AdamW's two moments
    infos = [json.loads((tmp_path / f"info-4-{r}.json").read_text()) for r in range(4)]
    full_params = sum(v.numel() * 4 for k, v in start.items() if k != "lm_head.weight")
    for i in infos:
        assert abs(i["bytes"]["parameters"] / full_params - 0.25) < 0.02, i
        assert abs(i["bytes"]["optimizer"] / (2 * full_params) - 0.25) < 0.02, i
    # the fingerprint every rank computes is of the gathered weights
    assert {i["version"] for i in infos} == {weights.fingerprint(got4.items())}
    assert len({i["micro"] for i in infos}) == 1  # every rank made the same passes
    # the Hugging Face export of the gathered model loads as the source does
    exported = models.load_causal_lm(tmp_path / "ckpt-4" / "model").state_dict()
    assert _dist({k: exported[k] for k in got4}, got4) == 0.0

    # a 4-rank checkpoint resumes on 2 ranks: one more step equals 3 uninterrupted steps
    want3 = _single(model_dir, 3).model.state_dict()
    _run(2, model_dir, [2], tmp_path, resume=tmp_path / "ckpt-4" / "learner.pt")
    got2 = torch.load(tmp_path / "weights-2.pt", weights_only=True)
    assert _dist(got2, want3) < 1e-3 * update, (_dist(got2, want3), update)
    # and restarting from the step-2 weights without the optimizer state goes elsewhere
    fresh = Learner(models.load_causal_lm(model_dir), dataclasses.replace(
        CFG, sharding="Replicated"))
    fresh.model.load_state_dict(got4)
    fresh.train_step(_batch(2))
    assert _dist(fresh.model.state_dict(), want3) > 0.05 * update

    # ... and a 2-rank checkpoint on 4 ranks (step 3 -> 4), its files written by the driver
    # from what each rank returned (a folder the ranks could not see)
    assert len(list((tmp_path / "ckpt-2" / sharding.DCP_DIR).glob("*.distcp"))) == 2
    want4 = _single(model_dir, 4).model.state_dict()
    (tmp_path / "r").mkdir()
    _run(4, model_dir, [3], tmp_path / "r", resume=tmp_path / "ckpt-2" / "learner.pt")
    got = torch.load(tmp_path / "r" / "weights-4.pt", weights_only=True)
    assert _dist(got, want4) < 1e-3 * update, (_dist(got, want4), update)


def test_an_unsharded_checkpoint_loads_into_sharded_ranks(model_dir: Path,
                                                          tmp_path: Path) -> None:
    """A checkpoint an unsharded learner wrote (older jobs, one rank) resumes sharded (here
    with activation checkpointing: recomputed activations, the same update)."""
    one = _single(model_dir, 2)
    torch.save({"learner": one.state_dict(), "torch_rng": torch.get_rng_state()},
               tmp_path / "learner.pt")
    want3 = _single(model_dir, 3).model.state_dict()
    _run(2, model_dir, [2], tmp_path, resume=tmp_path / "learner.pt", ac=True)
    got = torch.load(tmp_path / "weights-2.pt", weights_only=True)
    update = _dist(want3, one.model.state_dict())
    assert _dist(got, want3) < 1e-3 * max(update, 1e-2)


def test_activation_checkpointing_leaves_the_update_unchanged(model_dir: Path) -> None:
    cfg = dataclasses.replace(CFG, sharding="Replicated", activation_checkpointing=True)
    model = models.load_causal_lm(model_dir)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing
    ac = Learner(model, cfg)
    for step in range(2):
        ac.train_step(_batch(step))
    start = models.load_causal_lm(model_dir).state_dict()
    want = _single(model_dir, 2).model.state_dict()
    assert _dist(ac.model.state_dict(), want) < 1e-4 * _dist(want, start)


def test_one_sharded_rank_in_process_publishes_bucket_bytes(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The single-GPU shape (one rank, FSDP for its mixed precision), played on the CPU: the
    in-process learner joins a group of one, trains as the unsharded learner does, and
    publishes its weights as buckets of bytes (no Ray in the process) in the engines' dtype."""
    import torch.distributed as dist

    monkeypatch.setattr(learners, "is_sharded", lambda cfg, world, gpu: True)
    cfg = dataclasses.replace(CFG, kl_coef=0.0, publish_dtype="bfloat16",
                              publish_bucket_bytes=16 << 10)
    group = learners.InProcessLearners(learners.LearnerWorker(str(model_dir), cfg))
    try:
        assert group.worker.sharded and dist.get_world_size() == 1
        plain = Learner(models.load_causal_lm(model_dir),
                        dataclasses.replace(cfg, sharding="Replicated"))
        for step in range(2):
            group.train_step(_batch(step))
            plain.train_step(_batch(step))
        buckets, version = group.publish()
        assert isinstance(buckets, list) and len(buckets) > 1
        assert all(isinstance(b, bytes) for b in buckets)
        got: dict[str, torch.Tensor] = {}
        for b in buckets:
            got |= weights.from_bytes(b)
        assert {t.dtype for t in got.values()} == {torch.bfloat16}
        assert version == weights.fingerprint(got.items())
        want = plain.published_state()  # bfloat16 too: equal up to rounding
        assert max(float((got[k].float() - want[k].float()).abs().max()) for k in want) < 2e-2
    finally:
        group.shutdown()  # leaves the group of one: the model goes, then the group
    assert not dist.is_initialized() and group.worker._learner is None
