"""Policy-gradient pieces shared by every trainer: advantages, token logprobs, PPO-clip loss with truncated
importance sampling, KL and entropy."""

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


LOGITS_DTYPES: dict[str, torch.dtype | None] = {"float32": torch.float32, "model": None}
"""``train.logits_dtype`` as the ``dtype`` keyword of :func:`token_logprobs` and :func:`entropy`: ``None`` keeps the
logits' own dtype (the model's)."""


def logits_dtype(setting: str) -> torch.dtype | None:
    """The ``dtype`` keyword for a ``train.logits_dtype`` setting (``float32`` or ``model``)."""
    if setting not in LOGITS_DTYPES:
        raise ValueError(f"train.logits_dtype = {setting!r}: allowed are {sorted(LOGITS_DTYPES)}")
    return LOGITS_DTYPES[setting]


def _log_softmax(logits: torch.Tensor, *, temperature: float, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None:
        logits = logits.to(dtype)
    if temperature != 1.0:  # x / 1.0 == x exactly: skipping it saves a copy of the [B, T, V] logits
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    dtype: torch.dtype | None = torch.float32,
) -> torch.Tensor:
    """``log p(target)`` per position, from logits ``[B, T, V]`` and targets ``[B, T]``, computed in ``dtype``
    (float32 by default: the logits upcast; ``None``: the logits' own dtype, which with a bfloat16 model halves the
    ``[B, T, V]`` intermediates and rounds each logprob to bf16)."""
    logprobs = _log_softmax(logits, temperature=temperature, dtype=dtype)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy(
    logits: torch.Tensor, *, temperature: float = 1.0, dtype: torch.dtype | None = torch.float32
) -> torch.Tensor:
    """Entropy of the token distribution per position, computed in ``dtype`` (as :func:`token_logprobs`)."""
    logprobs = _log_softmax(logits, temperature=temperature, dtype=dtype)
    return -(logprobs.exp() * logprobs).sum(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` where ``mask`` is set (weighted by it); 0 where nothing is."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def ppo_clip_token_losses(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO-clip loss of every token, ``-min(ratio * A, clip(ratio) * A)`` with the importance ratio against
    ``old_logprobs``, and diagnostics (clip fraction, approximate KL to ``old_logprobs``, averaged over the trained
    tokens). ``advantages`` is per sample ``[B]`` or per token ``[B, T]``; ``token_weights`` ``[B, T]`` (no gradient)
    multiply each token's surrogate."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    # A masked-off token's ratio is set to 1 rather than multiplied by 0 afterwards: a stale token can be far from
    # the policy, and exp() of a large gap is inf, whose product with a zero mask (and its gradient) is NaN.
    log_ratio = torch.where(mask > 0, logprobs - old_logprobs, torch.zeros_like(logprobs))
    high = clip_eps if clip_eps_high is None else clip_eps_high
    return clipped_surrogate_losses(
        log_ratio.exp(), log_ratio, advantages, mask, low=clip_eps, high=high, token_weights=token_weights
    )


def clipped_surrogate_losses(
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float,
    high: float,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``-min(ratio * A, clip(ratio, 1 - low, 1 + high) * A)`` per token (times ``token_weights``), and the clip
    fraction and the approximate KL ``log_ratio^2 / 2`` to the anchor over the trained tokens: the clipped surrogate
    of PPO (a token's ratio) and of GSPO (its sample's). ``advantages``: ``[B, 1]`` or ``[B, T]``."""
    clipped = ratio.clamp(1 - low, 1 + high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    if token_weights is not None:
        surrogate = surrogate * token_weights.detach()
    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean((ratio != clipped).float(), mask),
            "approx_kl_rollout": masked_mean(0.5 * log_ratio.pow(2), mask),
        }
    return -surrogate, stats


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip surrogate with the importance ratio against ``old_logprobs``, averaged over response tokens
    (:func:`ppo_clip_token_losses`, then :func:`masked_mean`).

    ``old_logprobs`` are the rollout's (or, with TIS, the trainer's own: :func:`policy_loss`). Returns the loss and
    diagnostics (clip fraction, approximate KL to ``old_logprobs``).
    """
    losses, stats = ppo_clip_token_losses(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        token_weights=token_weights,
    )
    return masked_mean(losses, mask), stats


def truncated_importance_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *, clip: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance sampling (TIS) weights ``min(exp(old - rollout), clip)`` per token, without gradient.

    The rollout's logprobs come from the inference engine, whose kernels (and, with asynchronous training, whose
    weights) differ from the trainer's: the weight corrects the policy gradient for sampling from the engine's
    distribution instead of the trainer's, and truncating it at ``clip`` bounds its variance (Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training"). Masked-off tokens get weight 0.
    Returns the weights and their diagnostics: ``tis_weight_mean`` (of the truncated weights) and
    ``tis_clip_fraction`` (the share of tokens whose weight was truncated).
    """
    with torch.no_grad():
        log_ratio = torch.where(mask > 0, old_logprobs - rollout_logprobs, torch.zeros_like(old_logprobs))
        raw = log_ratio.exp()  # may be inf for a far-off token: min() makes it ``clip``
        weights = torch.where(mask > 0, raw.clamp(max=clip), torch.zeros_like(raw))
        stats = {
            "tis_weight_mean": masked_mean(weights, mask),
            "tis_clip_fraction": masked_mean((raw > clip).float(), mask),
        }
    return weights, stats


def policy_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    tis_clip: float | None = None,
    old_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy-gradient loss of every trainer (``train`` section settings as keywords).

    Without ``tis_clip``: :func:`ppo_clip_loss` with the ratio against the rollout logprobs. With it: the ratio is
    against ``old_logprobs``, the trainer's own logprobs of the batch computed without gradient before the step's
    optimizer step, and each token's surrogate is multiplied by its :func:`truncated_importance_weights`; the
    diagnostics add ``tis_weight_mean`` and ``tis_clip_fraction``, and ``approx_kl_rollout`` stays the KL to the
    rollout's logprobs.
    """
    if tis_clip is None:
        return ppo_clip_loss(
            logprobs, rollout_logprobs, advantages, mask, clip_eps=clip_eps, clip_eps_high=clip_eps_high
        )
    if old_logprobs is None:
        raise ValueError("tis_clip needs old_logprobs: the trainer's own logprobs of the batch before the step")
    weights, tis_stats = truncated_importance_weights(old_logprobs, rollout_logprobs, mask, clip=tis_clip)
    loss, stats = ppo_clip_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        token_weights=weights,
    )
    with torch.no_grad():
        to_rollout = torch.where(mask > 0, logprobs - rollout_logprobs, torch.zeros_like(logprobs))
        stats["approx_kl_rollout"] = masked_mean(0.5 * to_rollout.pow(2), mask)
    return loss, {**stats, **tis_stats}


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(policy || reference), ``exp(r) - r - 1`` with ``r = ref - policy``: unbiased, >= 0."""
    return masked_mean(kl_per_token(logprobs, ref_logprobs, "k3"), mask)


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """KL(policy || reference) per token by ``estimator`` (see :data:`~miles_core.training.algorithms.KL_ESTIMATORS`):
    ``k1 = log p - log p_ref``, ``k2 = (log p - log p_ref)^2 / 2``, ``k3 = exp(r) - r - 1`` with
    ``r = log p_ref - log p``."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs).pow(2)
    if estimator == "k3":
        log_ratio = ref_logprobs - logprobs
        return log_ratio.exp() - log_ratio - 1
    raise ValueError(f"unknown KL estimator {estimator!r}: k1, k2 or k3")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, *, norm_constant: float = 1.0) -> torch.Tensor:
    """A micro-batch's token values ``[B, T]`` reduced to its loss by the loss aggregation ``mode`` (see
    :data:`~miles_core.training.algorithms.LOSS_AGGREGATIONS`); ``mask`` weighs each token (a sample whose mask is
    all 0 is not counted); ``norm_constant``: ``seq-mean-token-sum-norm``'s constant."""
    if mode == "token-mean":
        return masked_mean(values, mask)
    per_sample = (values * mask).sum(-1)
    tokens = mask.sum(-1)
    trained = tokens > 0
    samples = trained.sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        return torch.where(trained, per_sample / tokens.clamp(min=1e-12), torch.zeros_like(per_sample)).sum() / samples
    if mode == "seq-mean-token-sum":
        return per_sample.sum() / samples
    if mode == "seq-mean-token-sum-norm":
        return per_sample.sum() / (samples * norm_constant)
    raise ValueError(f"unknown loss aggregation {mode!r}")
