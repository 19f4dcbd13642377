"""The learner: packing/positions, on-policy ratio, updates that move the policy."""

from __future__ import annotations

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
