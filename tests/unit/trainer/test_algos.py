"""GRPO/DAPO losses and advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlpacer_trainer import algos

pytestmark = pytest.mark.unit


def test_group_advantages_hand_computed() -> None:
    # mean 0.5; unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.8660
    adv = algos.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), eps=0.0)
    assert torch.allclose(adv, torch.tensor([[0.8660254, -0.8660254, -0.8660254, 0.8660254]]))
    centered = algos.group_advantages(torch.tensor([[3.0, 1.0]]), scale_by_std=False)
    assert centered.tolist() == [[1.0, -1.0]]


def test_equal_rewards_give_zero_advantage() -> None:
    adv = algos.group_advantages(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert torch.count_nonzero(adv) == 0


def test_ragged_groups() -> None:
    out = algos.ragged_group_advantages([[1.0, 0.0], [0.0, 0.0, 0.0, 1.0]], eps=0.0)
    assert out[0] == pytest.approx([0.70710678, -0.70710678])
    assert out[1] == pytest.approx([-0.5, -0.5, -0.5, 1.5])  # mean .25, std .5


def test_aggregation_modes() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(algos.aggregate(loss, mask, "TokenMean")) == pytest.approx(2.5)
    assert float(algos.aggregate(loss, mask, "SequenceMeanTokenMean")) == pytest.approx(3.0)
    assert float(algos.aggregate(loss, mask, "SequenceMeanTokenSum")) == pytest.approx(5.0)
    with pytest.raises(ValueError):
        algos.aggregate(loss, mask, "Bogus")


@pytest.mark.parametrize(
    ("ratio", "adv", "expected"),
    [
        (1.5, 1.0, -1.28),  # clipped at 1 + clip_high
        (1.5, -1.0, 1.5),  # pessimistic: unclipped
        (0.5, -1.0, 0.8),  # clipped at 1 - clip_low
        (0.5, 1.0, -0.5),
        (1.0, 2.0, -2.0),  # on-policy: plain policy gradient
    ],
)
def test_clip_higher(ratio: float, adv: float, expected: float) -> None:
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(ratio))
    loss, stats = algos.clipped_policy_loss(
        logp, old, torch.tensor([adv]), torch.ones(1, 1), clip_low=0.2, clip_high=0.28,
        aggregation="TokenMean")
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    assert stats["ratio"] == pytest.approx(ratio)


def test_clip_loss_masks_padding_and_has_gradient() -> None:
    logp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    loss, _ = algos.clipped_policy_loss(
        logp, logp.detach(), torch.tensor([1.0]), torch.tensor([[1.0, 1.0, 0.0]]),
        clip_low=0.2, clip_high=0.2, aggregation="TokenMean")
    loss.backward()
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-0.5, -0.5, 0.0])


def test_kl_k3() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.3]]))
    ref = torch.log(torch.tensor([[0.25, 0.3]]))
    kl = algos.kl_k3(logp, ref)
    assert kl[0, 0] == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    assert kl[0, 1] == pytest.approx(0.0, abs=1e-7)


def test_overlong_penalty() -> None:
    f = lambda n: algos.overlong_penalty(n, max_tokens=100, buffer_tokens=20)  # noqa: E731
    assert [f(50), f(80), f(90), f(100), f(130)] == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert algos.overlong_penalty(100, max_tokens=100, buffer_tokens=0) == 0.0


def test_dynamic_sampling_filter() -> None:
    assert algos.informative_groups([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 0.2]]) == [1, 3]


def test_token_logprobs_shapes() -> None:
    logits = torch.zeros(2, 3, 4)
    out = algos.token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long))
    assert out.shape == (2, 3)
    assert torch.allclose(out, torch.full((2, 3), -math.log(4)))
