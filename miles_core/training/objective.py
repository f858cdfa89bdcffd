"""``Objective``: what every trainer minimises, built once per run from the ``train`` section and the chosen policy
loss: the policy loss per token (against the rollout's logprobs, or with TIS the trainer's own), the KL to the
reference by the chosen estimator, the entropy bonus, each reduced by the run's loss aggregation, and each
micro-batch's share of the step. The torch trainer and the Megatron ranks call the same code, so they optimise the
same numbers."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from miles_core.targets import import_target
from miles_core.training.algorithms import AdvantageEstimator, PolicyLoss, resolved_weights, with_weights
from miles_core.training.batch import TrainBatch, trained_tokens
from miles_core.training.losses import aggregate, kl_per_token, masked_mean, truncated_importance_weights


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The sizes of a whole step's batch that each micro-batch's share is a fraction of: its trained tokens and its
    samples with at least one trained token."""

    tokens: float
    samples: int

    @classmethod
    def of(cls, batch: TrainBatch) -> StepShape:
        """The shape of ``batch`` (a :class:`MilesError` when it has nothing to train on)."""
        return cls(tokens=trained_tokens(batch), samples=sum(s.trained_tokens > 0 for s in batch.samples))


@dataclasses.dataclass(frozen=True)
class Objective:
    """The loss of a run: ``policy_loss`` (an instance), ``aggregation`` (one of
    :data:`~miles_core.training.algorithms.LOSS_AGGREGATIONS`), ``kl_estimator`` (k1, k2 or k3), ``norm_constant``
    (``seq-mean-token-sum-norm``'s divisor: the rollout's ``max_new_tokens``) and the ``train`` section (clip
    ranges, TIS, KL and entropy coefficients), its ``kl_coef`` and ``entropy_coef`` resolved at construction where
    they are unset (the estimator's defaults: :func:`~miles_core.training.algorithms.resolved_weights`)."""

    train: Any
    policy_loss: PolicyLoss
    estimator: AdvantageEstimator | None = None
    """The run's estimator, when the trainer needs it (one with a critic computes its advantages there)."""
    aggregation: str = "token-mean"
    kl_estimator: str = "k3"
    norm_constant: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "train", resolved_weights(self.train, self.estimator))

    def weight(self, mask: torch.Tensor, shape: StepShape) -> float:
        """The micro-batch's share of the step (the micro-batches' shares add up to 1): its trained tokens' share
        with ``token-mean``, its trained samples' share with the per-sample aggregations."""
        if self.aggregation == "token-mean":
            return float(mask.sum()) / shape.tokens
        return float((mask.sum(-1) > 0).sum()) / max(shape.samples, 1)

    def loss(
        self,
        logprobs: torch.Tensor,
        tensors: dict[str, torch.Tensor],
        *,
        token_entropy: torch.Tensor,
        ref_logprobs: torch.Tensor | None = None,
        old_logprobs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's loss and its metrics: ``loss`` (the total), ``pg_loss``, ``kl`` (0 without a
        reference), ``entropy``, and the policy loss's diagnostics (with TIS: ``tis_weight_mean`` and
        ``tis_clip_fraction``, and ``approx_kl_rollout`` to the rollout's logprobs). ``tensors`` is the micro-batch
        (:meth:`TrainBatch.tensors`); ``old_logprobs``: the trainer's own before the step (needed with TIS)."""
        mask, rollout_logprobs = tensors["response_mask"], tensors["rollout_logprobs"]
        anchor, weights, tis_stats = rollout_logprobs, None, {}
        if self.train.tis_clip is not None:
            if old_logprobs is None:
                raise ValueError("tis_clip needs old_logprobs: the trainer's own logprobs of the batch before the step")
            weights, tis_stats = truncated_importance_weights(
                old_logprobs, rollout_logprobs, mask, clip=self.train.tis_clip
            )
            anchor = old_logprobs
        token_losses, stats = self.policy_loss.token_losses(
            logprobs, anchor, tensors["advantages"], mask, train=self.train, token_weights=weights
        )
        pg_loss = self._aggregate(token_losses, mask)
        if self.train.tis_clip is not None:
            with torch.no_grad():
                to_rollout = torch.where(mask > 0, logprobs - rollout_logprobs, torch.zeros_like(logprobs))
                stats["approx_kl_rollout"] = masked_mean(0.5 * to_rollout.pow(2), mask)
        mean_entropy = self._aggregate(token_entropy, mask)
        kl = torch.zeros((), device=logprobs.device)
        if ref_logprobs is not None:
            kl = self._aggregate(kl_per_token(logprobs, ref_logprobs, self.kl_estimator), mask)
        total = pg_loss + self.train.kl_coef * kl - self.train.entropy_coef * mean_entropy
        metrics = {"loss": total, "pg_loss": pg_loss, "kl": kl, "entropy": mean_entropy, **stats, **tis_stats}
        return total, metrics

    def _aggregate(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return aggregate(values, mask, self.aggregation, norm_constant=self.norm_constant)


def mini_batches(batch: TrainBatch, count: int) -> list[TrainBatch]:
    """``batch`` split into ``count`` contiguous mini-batches of near-equal size (at most one per sample), each one
    optimizer step; mini-batches with no trained token are left out (they would take a step on nothing)."""
    count = max(1, min(count, len(batch)))
    size, extra = divmod(len(batch), count)
    found, start = [], 0
    for index in range(count):
        end = start + size + (index < extra)
        mini = TrainBatch(batch.samples[start:end])
        if any(sample.trained_tokens > 0 for sample in mini.samples):
            found.append(mini)
        start = end
    return found


def averaged(steps: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of several optimizer steps of one rollout, each key averaged over the steps that report it."""
    if len(steps) == 1:
        return steps[0]
    keys = dict.fromkeys(key for step in steps for key in step)
    return {key: sum(step[key] for step in steps if key in step) / sum(key in step for step in steps) for key in keys}


def objective_from_spec(train: Any, spec: dict[str, Any]) -> Objective:
    """The :class:`~miles_core.training.objective.Objective` of :meth:`AlgorithmChoice.trainer_spec`."""

    if "kl_coef" in spec:  # the driver's resolved weights
        train = with_weights(train, kl_coef=spec["kl_coef"], entropy_coef=spec["entropy_coef"])
    estimator = None
    if spec.get("estimator_target"):
        estimator = import_target(spec["estimator_target"], what="the run's advantage estimator")(
            spec.get("estimator_settings") or {}
        )
    return Objective(
        train=train,
        estimator=estimator,
        policy_loss=import_target(spec["policy_loss_target"], what="the run's policy loss")(
            spec["policy_loss_settings"]
        ),
        aggregation=spec["aggregation"],
        kl_estimator=spec["kl_estimator"],
        norm_constant=spec["norm_constant"],
    )
