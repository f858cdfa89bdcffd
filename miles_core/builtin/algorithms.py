"""The core's advantage estimators and policy losses (registered by the core plugin; see
:mod:`miles_core.training.algorithms` for the contracts and ``docs/guides/algorithms.md`` for the formulas).

Estimators: ``grpo`` (the default), ``dr_grpo``, ``rloo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``
and ``gspo``. Policy losses: ``ppo_clip`` (the default) and ``gspo``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pydantic

from miles_core.training.algorithms import (
    Advantage,
    AdvantageEstimator,
    AlgorithmSettings,
    PolicyLoss,
    ScoredSample,
)

if TYPE_CHECKING:
    import torch

WHITENING_EPS = 1e-6
"""Added to a standard deviation before dividing by it (as GRPO's group std): a batch whose values are all equal
gets zeros, not NaN."""


def _rewards(group: Sequence[ScoredSample]) -> torch.Tensor:
    import torch

    return torch.tensor([sample.reward for sample in group], dtype=torch.float32)


class GrpoSettings(AlgorithmSettings):
    normalize_std: bool = pydantic.Field(
        default=True, description="Divide each group's centred rewards by the group's standard deviation."
    )


class Grpo(AdvantageEstimator):
    """GRPO (Shao et al. 2024): ``(r - mean(group)) / (std(group) + 1e-6)``, the same for every token of a sample;
    ``std`` is the unbiased sample standard deviation."""

    name = "grpo"
    settings_model = GrpoSettings
    min_group_size = 2

    def advantages(self, groups: Sequence[Sequence[ScoredSample]]) -> list[Advantage]:
        from miles_core.training.losses import grpo_advantages

        found: list[Advantage] = []
        for group in groups:  # group by group: an agent's branches make a group larger than group_size
            values = grpo_advantages(_rewards(group), len(group), normalize_std=self.settings.normalize_std)
            found += values.tolist()
        return found


ENTROPY_COEF_AGAINST_COLLAPSE = 0.03
"""The default entropy-bonus weight of dr_grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline and ppo:
without one they collapse onto one answer on the default task before they learn it (their token entropy falls to
0.6-1.0 while grpo's is still 1.9). The bonus keeps the entropy without a reference model (a KL to the reference did
as well but loads a copy of the policy and runs its forward each step); it is not free: the entropy's backward through
the logits made a step of the tiny default model 1.22-1.25x grpo's (measured: docs/concepts/algorithms.md). RLOO's
and REINFORCE++'s papers train with a KL instead: ``--train-kl-coef``."""


class DrGrpo(AdvantageEstimator):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): ``r - mean(group)``, no division by the
    group's std, with the constant-normaliser aggregation (``seq-mean-token-sum-norm``): no length bias."""

    name = "dr_grpo"
    default_entropy_coef = ENTROPY_COEF_AGAINST_COLLAPSE
    default_loss_aggregation = "seq-mean-token-sum-norm"
    min_group_size = 2

    def advantages(self, groups: Sequence[Sequence[ScoredSample]]) -> list[Advantage]:
        from miles_core.training.losses import grpo_advantages

        found: list[Advantage] = []
        for group in groups:
            found += grpo_advantages(_rewards(group), len(group), normalize_std=False).tolist()
        return found


class Rloo(AdvantageEstimator):
    """REINFORCE leave-one-out (Ahmadian et al. 2024): ``r_i - mean(r_j, j != i)``, which is
    ``G / (G - 1) * (r_i - mean(group))``."""

    name = "rloo"
    default_entropy_coef = ENTROPY_COEF_AGAINST_COLLAPSE
    min_group_size = 2

    def advantages(self, groups: Sequence[Sequence[ScoredSample]]) -> list[Advantage]:
        found: list[Advantage] = []
        for group in groups:
            rewards = _rewards(group)
            others = (rewards.sum() - rewards) / (len(group) - 1)
            found += (rewards - others).tolist()
        return found


class ReinforcePlusPlusSettings(AlgorithmSettings):
    gamma: float = pydantic.Field(
        default=1.0, ge=0.0, le=1.0, description="Discount of the reward per token, counted back from the last."
    )


def _whitened(per_sample: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each sample's token values minus the mean over every token of the batch, divided by their std (+1e-6)."""
    import torch

    tokens = torch.cat(per_sample) if per_sample else torch.zeros(0)
    if tokens.numel() == 0:
        return per_sample
    mean = tokens.mean()
    std = tokens.std() if tokens.numel() > 1 else torch.zeros(())
    return [(values - mean) / (std + WHITENING_EPS) for values in per_sample]


class ReinforcePlusPlus(AdvantageEstimator):
    """REINFORCE++ (Hu 2025): each token's return is the sample's reward discounted by ``gamma`` per token to the end
    of the response (``gamma ** (T - 1 - t) * r``), whitened over every response token of the batch. A KL to the
    reference is a loss term (``--train-kl-coef``) or, with ``--train-kl-placement reward``, in each token's reward."""

    name = "reinforce_plus_plus"
    default_entropy_coef = ENTROPY_COEF_AGAINST_COLLAPSE
    settings_model = ReinforcePlusPlusSettings
    takes_token_rewards = True

    def advantages(self, groups: Sequence[Sequence[ScoredSample]]) -> list[Advantage]:
        import torch

        gamma = self.settings.gamma
        returns = []
        for sample in (sample for group in groups for sample in group):
            steps_to_end = torch.arange(sample.response_length - 1, -1, -1, dtype=torch.float32)
            returns.append(sample.reward * torch.pow(torch.tensor(gamma, dtype=torch.float32), steps_to_end))
        return [tuple(values.tolist()) for values in _whitened(returns)]

    def token_advantages(
        self, token_rewards: Sequence[torch.Tensor], values: Sequence[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """With the KL in the reward: each token's discounted return of the rewards from it to the end, whitened."""
        returns = [discounted_returns(rewards, self.settings.gamma) for rewards in token_rewards]
        return _whitened(returns), returns


def discounted_returns(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = sum_k gamma^(k - t) r_k`` over the rest of the response."""
    import torch

    returns = torch.zeros(rewards.numel(), dtype=torch.float32)
    following = 0.0
    for t in range(rewards.numel() - 1, -1, -1):
        following = float(rewards[t]) + gamma * following
        returns[t] = following
    return returns


class ReinforcePlusPlusBaseline(AdvantageEstimator):
    """REINFORCE++ with a baseline: ``r - mean(group)`` for every token of a sample, whitened over every response
    token of the batch."""

    name = "reinforce_plus_plus_baseline"
    default_entropy_coef = ENTROPY_COEF_AGAINST_COLLAPSE
    min_group_size = 2

    def advantages(self, groups: Sequence[Sequence[ScoredSample]]) -> list[Advantage]:
        import torch

        centred = []
        for group in groups:
            rewards = _rewards(group)
            for sample, value in zip(group, (rewards - rewards.mean()).tolist(), strict=True):
                centred.append(torch.full((sample.response_length,), value, dtype=torch.float32))
        return [tuple(values.tolist()) for values in _whitened(centred)]


class Gspo(Grpo):
    """GSPO (Zheng et al. 2025): GRPO's advantages with the ``gspo`` policy loss (a sequence-level importance ratio)
    and per-sample aggregation (``seq-mean-token-mean``)."""

    name = "gspo"
    default_policy_loss = "gspo"
    default_loss_aggregation = "seq-mean-token-mean"


class PpoClip(PolicyLoss):
    """PPO's clipped surrogate per token (the clip ranges are ``--train-clip-eps`` and ``--train-clip-eps-high``)."""

    name = "ppo_clip"

    def token_losses(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        train: Any,
        token_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from miles_core.training.losses import ppo_clip_token_losses

        return ppo_clip_token_losses(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            clip_eps=train.clip_eps,
            clip_eps_high=train.clip_eps_high,
            token_weights=token_weights,
        )


class GspoSettings(AlgorithmSettings):
    clip_eps: float = pydantic.Field(
        default=3e-4, gt=0, description="Lower clip range of the sequence ratio (GSPO's paper: 3e-4)."
    )
    clip_eps_high: float = pydantic.Field(
        default=4e-4, gt=0, description="Upper clip range of the sequence ratio (GSPO's paper: 4e-4)."
    )


class GspoLoss(PolicyLoss):
    """GSPO's sequence-level clipped surrogate: the ratio of a sample is the length-normalised geometric mean of its
    token ratios, ``s = exp(mean_t(log p - log p_old))``, clipped per sample. Written per token as GSPO-token: each
    token's ratio has the value ``s`` and the gradient ``s * grad log p_t``, so with ``seq-mean-token-mean`` the
    gradient is GSPO's."""

    name = "gspo"
    settings_model = GspoSettings

    def token_losses(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        train: Any,
        token_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        import torch

        from miles_core.training.losses import clipped_surrogate_losses

        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(-1)
        log_ratio = torch.where(mask > 0, logprobs - old_logprobs, torch.zeros_like(logprobs))
        sequence_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1e-12)
        token_log_ratio = sequence_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()
        ratio = torch.where(mask > 0, token_log_ratio, torch.zeros_like(token_log_ratio)).exp()
        return clipped_surrogate_losses(
            ratio,
            log_ratio,
            advantages,
            mask,
            low=self.settings.clip_eps,
            high=self.settings.clip_eps_high,
            token_weights=token_weights,
        )


class PpoSettings(AlgorithmSettings):
    gamma: float = pydantic.Field(default=1.0, ge=0.0, le=1.0, description="GAE's discount per token.")
    lambd: float = pydantic.Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="GAE's lambda (bias against variance); 1.0 (verl's default too): the Monte-Carlo return less the "
        "value, which a young critic biases least.",
    )
    critic_lr: float = pydantic.Field(default=3e-3, gt=0, le=1.0, description="The critic's AdamW learning rate.")
    critic_warmup_steps: int = pydantic.Field(
        default=0, ge=0, le=100_000, description="Steps at the start that train the critic only (the policy waits)."
    )
    value_clip: float = pydantic.Field(
        default=0.2, gt=0, description="Clip range of the new value around the rollout's (PPO's clipped value loss)."
    )
    critic_model: str | None = pydantic.Field(
        default=None,
        max_length=4096,
        description="An HF checkpoint directory to start the critic from (its architecture with a scalar head; "
        "the same vocabulary as the policy's); default: the policy's initial checkpoint.",
    )
    normalize_advantages: bool = pydantic.Field(
        default=True, description="Whiten the advantages over every response token of the batch."
    )

    example = '{"gamma": 1.0, "lambd": 0.95, "critic_lr": 0.003}'


def gae(
    rewards: torch.Tensor, values: torch.Tensor, *, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over one response, from each token's reward (the
    sample's reward at its last token, less any KL penalty) and value, the value after the last token 0:
    ``delta_t = r_t + gamma V_{t+1} - V_t`` and ``A_t = delta_t + gamma lambda A_{t+1}``. Returns the advantages and
    the returns ``A_t + V_t``."""
    import torch

    length = values.numel()
    advantages = torch.zeros(length, dtype=torch.float32)
    following = 0.0
    for t in range(length - 1, -1, -1):
        next_value = float(values[t + 1]) if t + 1 < length else 0.0
        delta = float(rewards[t]) + gamma * next_value - float(values[t])
        following = delta + gamma * lambd * following
        advantages[t] = following
    return advantages, advantages + values.float()


class Ppo(AdvantageEstimator):
    """PPO with a critic: a value model trained beside the policy (clipped value loss, its own AdamW), GAE per token
    with ``gamma`` and ``lambd``, the advantages whitened over the batch. The driver's advantages are placeholders:
    the torch trainer computes them from the critic's values before each update."""

    name = "ppo"
    default_entropy_coef = 0.05  # measured: without a bonus ppo ends far lower; with 0.03 it passes 0.5 barely
    settings_model = PpoSettings
    needs_critic = True

    def advantages(self, groups: Sequence[Sequence[ScoredSample]]) -> list[Advantage]:
        return [0.0 for group in groups for _ in group]

    def token_advantages(
        self, token_rewards: Sequence[torch.Tensor], values: Sequence[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if values is None:
            raise ValueError("ppo's advantages need the critic's values")
        pairs = [
            gae(rewards, value, gamma=self.settings.gamma, lambd=self.settings.lambd)
            for rewards, value in zip(token_rewards, values, strict=True)
        ]
        advantages = [advantage for advantage, _ in pairs]
        if self.settings.normalize_advantages:
            advantages = _whitened(advantages)
        return advantages, [returns for _, returns in pairs]
