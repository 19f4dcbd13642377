"""The learner: packing/positions, on-policy ratio, updates that move the policy."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlpacer_trainer import tiny
from rlpacer_trainer.learner import Learner, LearnerConfig, Sample, pack, sequence_logprobs

pytestmark = pytest.mark.unit


def test_pack_right_pads_with_positions_from_zero() -> None:
    ids, attn, pos, tgt, mask = pack([[1, 5], [1, 6, 7]], [[8, 2], [9]])
    assert ids.tolist() == [[1, 5, 8, 2], [1, 6, 7, 9]]
    assert attn.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert pos.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    # targets are next tokens; the mask covers response targets only
    assert tgt.tolist() == [[5, 8, 2], [6, 7, 9]]
    assert mask.tolist() == [[0, 1, 1], [0, 0, 1]]
    ids, attn, _, _, mask = pack([[1]], [[4, 4, 4]])
    _ids2, attn2, _, _, mask2 = pack([[1], [1, 2, 3, 4, 5]], [[4, 4, 4], [6]])
    assert attn2[0].tolist() == [1, 1, 1, 1, 0, 0]
    assert mask2[0].tolist() == [1, 1, 1, 0, 0]


def test_padding_does_not_change_logprobs() -> None:
    torch.manual_seed(0)
    model = tiny.new_model(0).eval()
    a = pack([[1, 5, 6]], [[7, 8]])
    b = pack([[1, 5, 6], [1, 4, 4, 4, 4, 4]], [[7, 8], [9, 9, 9]])
    with torch.no_grad():
        la = sequence_logprobs(model, *a[:4])
        lb = sequence_logprobs(model, *b[:4])
    assert torch.allclose(la[0], lb[0, : la.shape[1]], atol=1e-5)


def _samples() -> list[Sample]:
    p = tiny.prompt_ids("47-9:")
    good = [*tiny.encode("38,29,20,11,2,"), tiny.EOS_ID]
    bad = [*tiny.encode("38,28,"), tiny.EOS_ID]
    return [Sample(p, good, 1.0), Sample(p, bad, -1.0)]


def test_update_raises_logprob_of_positive_advantage() -> None:
    model = tiny.new_model(0)
    learner = Learner(model, LearnerConfig(learning_rate=3e-3, mini_batches=1))
    s = _samples()
    ids, attn, pos, tgt, mask = pack([x.prompt_ids for x in s], [x.response_ids for x in s])

    def seq_lp() -> torch.Tensor:
        with torch.no_grad():
            return (sequence_logprobs(model, ids, attn, pos, tgt) * mask).sum(1)

    before = seq_lp()
    for _ in range(5):
        stats = learner.train_step(s)
    after = seq_lp()
    assert after[0] > before[0] and after[1] < before[1]
    assert stats["samples"] == 2.0


def test_first_minibatch_is_on_policy_and_kl_is_zero_at_start() -> None:
    model = tiny.new_model(0)
    learner = Learner(model, LearnerConfig(learning_rate=1e-3, mini_batches=1, kl_coef=0.1))
    stats = learner.train_step(_samples())
    assert stats["clipfrac"] == 0.0
    assert stats["kl"] == pytest.approx(0.0, abs=1e-7)


def test_weights_bytes_round_trip() -> None:
    import io

    model = tiny.new_model(0)
    learner = Learner(model, LearnerConfig())
    sd = torch.load(io.BytesIO(learner.weights_bytes()), weights_only=True)
    assert set(sd) == set(model.state_dict())


def test_warmup_ramps_the_learning_rate_and_resumes() -> None:
    learner = Learner(tiny.new_model(0), LearnerConfig(learning_rate=1e-3, mini_batches=2,
                                                      warmup_updates=4))
    seen = []
    for _ in range(3):
        learner.train_step(_samples())  # two optimizer steps each
        seen.append(learner.opt.param_groups[0]["lr"])
    assert seen == pytest.approx([5e-4, 1e-3, 1e-3])  # after updates 2, 4, 6 of a 4-step ramp
    other = Learner(tiny.new_model(0), LearnerConfig(learning_rate=1e-3, warmup_updates=4))
    other.load_state_dict(learner.state_dict())
    assert other.updates == 6


def test_small_batches_take_sqrt_scaled_steps() -> None:
    learner = Learner(tiny.new_model(0), LearnerConfig(learning_rate=1e-3, mini_batches=1,
                                                      reference_samples=8))
    learner.train_step(_samples())  # 2 samples of a reference 8: lr * sqrt(2 / 8)
    assert learner.opt.param_groups[0]["lr"] == pytest.approx(5e-4)
    learner.train_step(_samples() * 8)  # 16 >= 8: the full rate, never more
    assert learner.opt.param_groups[0]["lr"] == pytest.approx(1e-3)


class _ReferenceLearner(Learner):
    """The update as it was computed before the old-log-prob pass was trimmed: one no-grad
    forward over the whole batch for every mini-batch's behaviour log-probs."""

    def _train_step(self, samples, shard, n, positions, asked):  # type: ignore[no-untyped-def]
        from rlpacer_trainer import algos

        cfg = self.cfg
        packed = pack([s.prompt_ids for s in samples], [s.response_ids for s in samples])
        ids, attn, pos, tgt, mask = packed
        adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
        with torch.no_grad():
            old = sequence_logprobs(self.model, ids, attn, pos, tgt, cfg.temperature)
            ref = (sequence_logprobs(self.ref, ids, attn, pos, tgt, cfg.temperature)
                   if self.ref is not None else None)
        k = max(1, min(asked, n))
        for j in range(k):
            sel = torch.tensor([i for i, g in enumerate(positions) if g % k == j])
            width = int(attn[sel].sum(dim=1).max())
            m = mask[sel, : width - 1]
            logp = sequence_logprobs(self.model, ids[sel, :width], attn[sel, :width],
                                     pos[sel, :width], tgt[sel, : width - 1], cfg.temperature)
            loss, _ = algos.clipped_policy_loss(
                logp, old[sel, : width - 1], adv[sel], m, clip_low=cfg.clip_low,
                clip_high=cfg.clip_high, aggregation=cfg.aggregation)
            if ref is not None:
                loss = loss + cfg.kl_coef * algos.aggregate(
                    algos.kl_k3(logp, ref[sel, : width - 1]), m, cfg.aggregation)
            self._set_lr(n)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
            self.opt.step()
            self.updates += 1
        return {}


def _random_batch(n: int, seed: int) -> list[Sample]:
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [tiny.BOS_ID, *tiny.encode(f"{rng.randint(10, 99)}-{rng.randint(1, 9)}:")]
        resp = tiny.encode("".join(rng.choice("0123456789,") for _ in range(rng.randint(2, 30))))
        out.append(Sample(prompt, resp, rng.uniform(-1.5, 1.5)))
    return out


def _rows_through(model: torch.nn.Module) -> list[tuple[int, bool]]:
    """Records (rows, grad enabled) of every forward pass of ``model``."""
    seen: list[tuple[int, bool]] = []

    def hook(_m: torch.nn.Module, _args: object, kwargs: dict[str, torch.Tensor]) -> None:
        seen.append((int(kwargs["input_ids"].shape[0]), torch.is_grad_enabled()))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


@pytest.mark.parametrize(("k", "kl", "aggregation"), [
    (1, 0.0, "TokenMean"), (2, 0.0, "TokenMean"), (1, 0.05, "TokenMean"),
    (2, 0.05, "TokenMean"), (2, 0.05, "SequenceMeanTokenMean"), (3, 0.0, "TokenMean")])
def test_update_equals_the_full_old_logprob_pass_with_fewer_passes(
        k: int, kl: float, aggregation: str) -> None:
    """The first mini-batch's behaviour log-probs are its own forward's (detached), so the
    no-grad pass covers mini-batches 2..k only; the update is the one the full pass gives (up
    to float rounding), over several steps (the later mini-batches do go off-policy: the
    clipped ratios matter). The data-parallel ranks equal this learner (test_learner_dp)."""
    cfg = LearnerConfig(learning_rate=3e-3, mini_batches=k, kl_coef=kl, clip_low=0.2,
                        clip_high=0.28, aggregation=aggregation)
    new, ref = Learner(tiny.new_model(1), cfg), _ReferenceLearner(tiny.new_model(1), cfg)
    start = {name: t.clone() for name, t in new.model.state_dict().items()}
    rows = _rows_through(new.model)
    n = 12
    for step in range(3):
        rows.clear()
        new.train_step(_random_batch(n, step))
        ref.train_step(_random_batch(n, step))
        # policy passes: k grad forwards over the batch, one no-grad over (k-1)/k of it
        assert sorted(rows) == sorted([(n // k, True)] * k
                                      + ([(n - n // k, False)] if k > 1 else []))
    got, want = new.model.state_dict(), ref.model.state_dict()
    moved = sum(float((want[p] - start[p]).pow(2).sum()) for p in want) ** 0.5
    diff = sum(float((got[p] - want[p]).pow(2).sum()) for p in want) ** 0.5
    assert moved > 1e-2
    assert diff < 1e-4 * moved, (diff, moved)


def test_local_learners_get_the_hosts_cores_and_pods_keep_one() -> None:
    import os
    from pathlib import Path

    from rlpacer_trainer.learners import host_cores, pick_threads

    cores = len(os.sched_getaffinity(0))
    assert host_cores() == cores
    assert pick_threads(0, pinned=False, replicas=1) == cores  # rlpacer run: every core
    assert pick_threads(0, pinned=False, replicas=2) == max(1, cores // 2)  # DP on one host
    assert pick_threads(0, pinned=True, replicas=1) == 1  # a learner pod: as before
    assert pick_threads(3, pinned=True, replicas=1) == 3  # an explicit setting wins
    # the worker's process trains on two threads: a fresh process, as a learner actor's is
    # (this one's OpenMP state depends on what ran before it, e.g. an engine's thread binding)
    asset = Path(__file__).parents[3] / "trainer_image/rlpacer_trainer/assets"
    code = ("import torch\n"
            "from rlpacer_trainer.learners import LearnerWorker\n"
            "from rlpacer_trainer.learner import LearnerConfig\n"
            f"w = LearnerWorker({str(asset / 'wordproblems-qwen2')!r}, LearnerConfig(),"
            " threads=2)\n"
            "print(torch.get_num_threads(), w.info()['threads'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["2", "2"], out
