"""What a trainer computes for an estimator that needs it (a critic's, or the KL in the reward), shared by the
trainers: each sample's reward per response token, the estimator's advantages and returns per token from it and the
critic's values, set on the samples (``advantage``, ``returns``, ``old_values``) with the critic's metrics; and the
critic's clipped value loss."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from miles_core.training.batch import TrainBatch
from miles_core.training.losses import masked_mean

if TYPE_CHECKING:
    from miles_core.training.algorithms import AdvantageEstimator


def with_trainer_advantages(
    batch: TrainBatch,
    estimator: AdvantageEstimator,
    values: Sequence[torch.Tensor] | None,
    *,
    kl_penalties: Sequence[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
) -> tuple[TrainBatch, dict[str, float]]:
    """The batch with the estimator's per-token advantages, from each token's reward (the sample's at its last
    token, less ``kl_coef`` x ``kl_penalties`` where the run puts the KL in the reward) and the critic's ``values``
    of each response token before the update (``None``: no critic); with values, each sample's ``returns`` and
    ``old_values`` too, and the critic's metrics."""
    token_rewards = [torch.zeros(len(sample.response_ids)) for sample in batch.samples]
    for rewards, sample in zip(token_rewards, batch.samples, strict=True):
        rewards[-1] = sample.reward
    metrics: dict[str, float] = {}
    if kl_penalties is not None:
        token_rewards = [r - kl_coef * kl for r, kl in zip(token_rewards, kl_penalties, strict=True)]
        metrics["kl_in_reward"] = float(torch.cat(list(kl_penalties)).mean())
    advantages, returns = estimator.token_advantages(token_rewards, values)
    if values is None:
        samples = [
            dataclasses.replace(sample, advantage=tuple(advantage.tolist()))
            for sample, advantage in zip(batch.samples, advantages, strict=True)
        ]
        return TrainBatch(samples), metrics
    samples = [
        dataclasses.replace(
            sample,
            advantage=tuple(advantage.tolist()),
            returns=tuple(sample_returns.tolist()),
            old_values=tuple(sample_values.tolist()),
        )
        for sample, advantage, sample_returns, sample_values in zip(
            batch.samples, advantages, returns, values, strict=True
        )
    ]
    all_returns, all_values = torch.cat(list(returns)), torch.cat(list(values))
    metrics |= {
        "critic/explained_variance": explained_variance(all_returns, all_values),
        "critic/value_mean": float(all_values.mean()),
        "critic/return_mean": float(all_returns.mean()),
    }
    return TrainBatch(samples), metrics


def response_values(values: torch.Tensor, batch: TrainBatch) -> list[torch.Tensor]:
    """Each sample's values at its response tokens (1-D) from ``values [B, L-1]`` aligned with the batch's targets."""
    found = []
    for row, sample in enumerate(batch.samples):
        start = len(sample.prompt_ids) - 1
        found.append(values[row, start : start + len(sample.response_ids)].detach().float().clone())
    return found


def clipped_value_loss(values: torch.Tensor, tensors: dict[str, torch.Tensor], *, clip: float) -> torch.Tensor:
    """PPO's clipped value loss ``0.5 max((V - R)^2, (V_old + clip(V - V_old) - R)^2)``, averaged over the response
    tokens of a micro-batch (``tensors``: its ``returns``, ``old_values`` and ``response_mask``)."""
    returns, old, mask = tensors["returns"], tensors["old_values"], tensors["response_mask"]
    clipped = old + (values - old).clamp(-clip, clip)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask)


def explained_variance(returns: torch.Tensor, values: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the batch's response tokens: 1 when the values predict the returns, 0 when
    they explain nothing, negative when they are worse than a constant."""
    variance = returns.var(unbiased=False)
    if float(variance) == 0.0:
        return 0.0
    return float(1 - (returns - values).var(unbiased=False) / variance)
