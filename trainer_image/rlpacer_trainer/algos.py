"""Loss and advantage functions of GRPO and DAPO: small, pure, shapes in the docstrings.

Shapes: ``B`` sequences (responses), ``T`` response tokens (right-padded), ``P`` prompts,
``G`` responses per prompt (the group). Masks are 1.0 on real response tokens, 0.0 on padding.

References: GRPO, Shao et al. 2024 (DeepSeekMath, arXiv 2402.03300); DAPO, Yu et al. 2025
(arXiv 2503.14476): clip-higher, dynamic sampling, token-level policy-gradient loss, overlong
reward shaping. Registry style after verl's ``core_algos.py``: an enum picks the aggregation
and an unknown name fails loudly.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch


class LossAggregation(enum.StrEnum):
    """How per-token losses become one scalar.

    * ``TokenMean`` (DAPO): mean over all response tokens of the batch; long responses weigh
      in proportion to their length.
    * ``SequenceMeanTokenMean`` (GRPO as published): mean over tokens within each response,
      then over responses.
    * ``SequenceMeanTokenSum``: sum over tokens within each response, mean over responses.
    """

    TOKEN_MEAN = "TokenMean"
    SEQUENCE_MEAN_TOKEN_MEAN = "SequenceMeanTokenMean"
    SEQUENCE_MEAN_TOKEN_SUM = "SequenceMeanTokenSum"


def group_advantages(
    rewards: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages. ``rewards``: [P, G] -> [P, G].

    ``A[p, g] = (r[p, g] - mean_g r[p]) / (std_g r[p] + eps)`` with the unbiased std (as in
    GRPO's reference implementations); without ``scale_by_std`` only the mean is removed.
    A group whose rewards are all equal gets advantage 0 everywhere.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [P, G], got {tuple(rewards.shape)}")
    mean = rewards.mean(dim=1, keepdim=True)
    centered = rewards - mean
    if not scale_by_std:
        return centered
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    std = rewards.std(dim=1, keepdim=True, unbiased=True)
    return centered / (std + eps)


def ragged_group_advantages(
    groups: Sequence[Sequence[float]], *, scale_by_std: bool = True, eps: float = 1e-6
) -> list[list[float]]:
    """:func:`group_advantages` for groups of possibly different sizes (lists in, lists out)."""
    out = []
    for g in groups:
        t = torch.tensor([list(g)], dtype=torch.float64)
        out.append(group_advantages(t, scale_by_std=scale_by_std, eps=eps)[0].tolist())
    return out


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: LossAggregation | str,
              denominator: torch.Tensor | float | None = None) -> torch.Tensor:
    """Per-token ``loss`` [B, T] and ``mask`` [B, T] -> scalar, by ``mode``.

    ``denominator`` replaces the batch's own count (:func:`aggregate_count`): data-parallel
    ranks each pass the whole batch's count, so their losses sum to the whole batch's loss."""
    if denominator is None:
        denominator = aggregate_count(mask, mode)
    return aggregate_sum(loss, mask, mode) / denominator


def aggregate_sum(loss: torch.Tensor, mask: torch.Tensor, mode: LossAggregation | str
                  ) -> torch.Tensor:
    """The numerator of :func:`aggregate`: additive over any split of the batch's rows."""
    mode = LossAggregation(mode)
    masked = loss * mask
    if mode is LossAggregation.TOKEN_MEAN:
        return masked.sum()
    if mode is LossAggregation.SEQUENCE_MEAN_TOKEN_MEAN:
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)).sum()
    return masked.sum()


def aggregate_count(mask: torch.Tensor, mode: LossAggregation | str) -> torch.Tensor:
    """The denominator of :func:`aggregate` (tokens for token-mean, else sequences), >= 1."""
    if LossAggregation(mode) is LossAggregation.TOKEN_MEAN:
        return mask.sum().clamp_min(1.0)
    return torch.tensor(float(max(1, mask.shape[0])))


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    aggregation: LossAggregation | str,
    denominator: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-style clipped surrogate with separate low/high ratios (DAPO's clip-higher).

    ``logp``, ``old_logp``: [B, T] log-probabilities of the sampled tokens under the current
    and the behaviour policy; ``advantages``: [B] (one per response, broadcast over its tokens);
    ``mask``: [B, T]. Per token: ``-min(r*A, clip(r, 1-clip_low, 1+clip_high)*A)`` with
    ``r = exp(logp - old_logp)``. GRPO is the case ``clip_low == clip_high``.
    Returns (scalar loss, stats with the clipped fraction and mean ratio).
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(1).to(logp.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate(per_token, mask, aggregation, denominator)
    with torch.no_grad():
        n = mask.sum().clamp_min(1.0)
        clipfrac = (((clipped < unclipped).to(mask.dtype)) * mask).sum() / n
        mean_ratio = (ratio * mask).sum() / n
    return loss, {"clipfrac": float(clipfrac), "ratio": float(mean_ratio)}


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate (Schulman's k3, as GRPO uses): [B, T] -> [B, T].

    ``exp(ref - logp) - (ref - logp) - 1``, non-negative, zero when the policies agree.
    """
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def overlong_penalty(length: int, *, max_tokens: int, buffer_tokens: int) -> float:
    """DAPO's soft overlong punishment, added to the reward of a response of ``length`` tokens.

    0 up to ``max_tokens - buffer_tokens``; then falls linearly to -1 at ``max_tokens``;
    -1 beyond. ``buffer_tokens == 0`` disables it.
    """
    if buffer_tokens <= 0:
        return 0.0
    start = max_tokens - buffer_tokens
    if length <= start:
        return 0.0
    if length <= max_tokens:
        return (start - length) / buffer_tokens
    return -1.0


def informative_groups(rewards: Sequence[Sequence[float]], *, tol: float = 1e-9) -> list[int]:
    """DAPO dynamic sampling: indices of groups whose rewards are not all equal.

    A group where every response got the same reward has zero advantage everywhere and only
    dilutes the batch; DAPO drops it and samples more prompts to refill the batch.
    """
    keep = []
    for i, g in enumerate(rewards):
        if len(g) and max(g) - min(g) > tol:
            keep.append(i)
    return keep


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of ``targets`` [B, T] under ``logits`` [B, T, V] -> [B, T]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return torch.gather(logp, 2, targets.unsqueeze(-1)).squeeze(-1)
