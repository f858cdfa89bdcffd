"""Policy-gradient pieces shared by every trainer: advantages, token logprobs, PPO-clip loss, KL and entropy."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True) -> torch.Tensor:
    """Group-normalised advantages: each sample's reward minus its group's mean (divided by the group's std)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.view(-1, group_size).float()
    centered = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (groups.std(dim=1, keepdim=True) + 1e-6)
    return centered.view(-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """``log p(target)`` per position, from logits ``[B, T, V]`` and targets ``[B, T]`` (float32 math)."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy(logits: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the token distribution per position."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logprobs.exp() * logprobs).sum(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip surrogate with the importance ratio against the rollout logprobs, averaged over response tokens.

    ``advantages`` is per sample ``[B]`` or per token ``[B, T]``. Returns the loss and diagnostics (clip fraction,
    approximate KL to the rollout policy).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1 - clip_eps, 1 + (clip_eps if clip_eps_high is None else clip_eps_high))
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    loss = -masked_mean(surrogate, mask)
    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean((ratio != clipped).float(), mask),
            "approx_kl_rollout": masked_mean(0.5 * log_ratio.pow(2), mask),
        }
    return loss, stats


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(policy || reference), ``exp(r) - r - 1`` with ``r = ref - policy``: unbiased, >= 0."""
    log_ratio = ref_logprobs - logprobs
    return masked_mean(log_ratio.exp() - log_ratio - 1, mask)
