"""The contracts of an RL algorithm: advantage estimators and policy losses, chosen by name.

Plugins register implementations through the ``provide_advantage_estimators`` and ``provide_policy_losses`` hooks
(the core's built-ins live in :mod:`miles_core.builtin.algorithms`); a run names them with
``--train-advantage-estimator NAME`` and ``--train-policy-loss NAME``, each with its settings
(``--train-advantage-estimator-settings '{...}'``), validated against the implementation's ``settings_model`` when
the config is built. This module names no implementation.

* An :class:`AdvantageEstimator` runs in the driver, on each step's scored groups: it turns the rewards into one
  advantage per sample, or one per response token.
* A :class:`PolicyLoss` runs in every trainer, on each micro-batch: it turns logprobs and advantages into a loss per
  token, which the run's loss aggregation (:data:`LOSS_AGGREGATIONS`) reduces to the micro-batch's loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from miles_core.errors import ConfigError, RegistryError
from miles_core.weight_transfer.settings import ProtocolSettings, validate_settings

if TYPE_CHECKING:
    import torch

Advantage = float | tuple[float, ...]
"""One sample's advantage: a number for all its response tokens, or one number per response token."""


class AlgorithmSettings(ProtocolSettings):
    """The base of an estimator's or a policy loss's settings model (frozen, strict, unknown keys refused, every
    field with a default and a description): the model of an implementation that takes no settings."""


@dataclasses.dataclass(frozen=True)
class ScoredSample:
    """What an estimator knows of one sample: its reward and its number of response tokens."""

    reward: float
    response_length: int


class AdvantageEstimator:
    """Base class of advantage estimators. Subclasses set :attr:`name` and :attr:`settings_model`, may change the
    defaults the run takes when the user names none (:attr:`default_policy_loss`,
    :attr:`default_loss_aggregation`, :attr:`default_kl_coef`, :attr:`default_entropy_coef`) and
    :attr:`min_group_size`, and implement
    :meth:`advantages`."""

    name: ClassVar[str] = ""
    settings_model: ClassVar[type[AlgorithmSettings]] = AlgorithmSettings
    default_policy_loss: ClassVar[str] = "ppo_clip"
    """The policy loss a run with this estimator uses unless ``train.policy_loss`` names one."""
    default_loss_aggregation: ClassVar[str] = "token-mean"
    """The loss aggregation a run with this estimator uses unless ``train.loss_aggregation`` names one."""
    default_kl_coef: ClassVar[float] = 0.0
    """The weight of the KL to the reference a run with this estimator uses unless ``train.kl_coef`` sets one (a
    non-zero weight loads a reference model and costs its forward pass each step)."""
    default_entropy_coef: ClassVar[float] = 0.0
    """The weight of the entropy bonus a run with this estimator uses unless ``train.entropy_coef`` sets one (it
    needs no reference model, but a non-zero weight adds the entropy's backward through the logits to each step)."""
    min_group_size: ClassVar[int] = 1
    """The smallest ``rollout.group_size`` it can work with (a group baseline needs two samples)."""
    needs_critic: ClassVar[bool] = False
    """Whether its advantages need a value model: the trainer then trains a critic beside the policy and calls
    :meth:`token_advantages` with the critic's values (what :meth:`advantages` returns in the driver is replaced)."""
    takes_token_rewards: ClassVar[bool] = False
    """Whether :meth:`token_advantages` can take a reward per token: with ``--train-kl-placement reward`` the trainer
    subtracts the KL to the reference from each token's reward and calls it (a critic's estimator always is)."""

    def __init__(self, settings: Any = None) -> None:
        self.settings = validate_algorithm_settings(type(self), settings or {}, kind="advantage estimator")

    def advantages(self, groups: Sequence[Sequence[ScoredSample]]) -> list[Advantage]:
        """The advantage of every sample of the step, group after group, in order: a float, or a tuple with one
        float per response token."""
        raise NotImplementedError

    def token_advantages(
        self, token_rewards: Sequence[torch.Tensor], values: Sequence[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """In the trainer (:attr:`needs_critic`, :attr:`takes_token_rewards`): each sample's advantage and return per
        response token (1-D tensors) from its reward per response token (the sample's reward at its last token, less
        the KL penalty where the run puts it in the reward) and, with a critic, the critic's value of each token."""
        raise NotImplementedError(f"{type(self).__name__} does not take rewards per token")


class PolicyLoss:
    """Base class of policy losses. Subclasses set :attr:`name` and :attr:`settings_model` and implement
    :meth:`token_losses`."""

    name: ClassVar[str] = ""
    settings_model: ClassVar[type[AlgorithmSettings]] = AlgorithmSettings

    def __init__(self, settings: Any = None) -> None:
        self.settings = validate_algorithm_settings(type(self), settings or {}, kind="policy loss")

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
        """The loss of every token ``[B, T]`` (what the run's aggregation reduces; masked-off tokens' values are
        ignored) and diagnostics (scalars, already averaged over the micro-batch's trained tokens).

        ``logprobs`` (with gradient), ``old_logprobs`` (the ratio's anchor: the rollout's, or with TIS the trainer's
        own before the step) and ``mask`` are ``[B, T]``; ``advantages`` is ``[B]`` or ``[B, T]``; ``train`` is the
        run's ``train`` section (``clip_eps`` and the like); ``token_weights`` (no gradient), when given, multiply
        each token's loss (truncated importance sampling)."""
        raise NotImplementedError


def validate_algorithm_settings(implementation: type, settings: Any, *, kind: str) -> AlgorithmSettings:
    """``settings`` checked against ``implementation.settings_model``; a refusal is a :class:`ConfigError` naming
    the config field, the implementation and every refused setting."""
    field = "advantage_estimator_settings" if kind == "advantage estimator" else "policy_loss_settings"
    flag = "--train-" + field.replace("_", "-")
    return validate_settings(implementation, settings, field=f"train.{field}", flag=flag, kind=kind)


LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""How a batch's token losses become its loss:

* ``token-mean``: the mean over every trained token of the batch (a long response weighs more);
* ``seq-mean-token-mean``: each sample's mean over its tokens, then the mean over samples;
* ``seq-mean-token-sum``: each sample's sum over its tokens, then the mean over samples;
* ``seq-mean-token-sum-norm``: the sum over all tokens divided by samples times a constant (``max_new_tokens``):
  Dr. GRPO's unbiased normaliser, with no length bias and no per-group scale."""

KL_ESTIMATORS = ("k1", "k2", "k3")
"""Estimators of KL(policy || reference) per token, from ``r = log p_ref - log p``: ``k1 = -r`` (unbiased, may be
negative), ``k2 = r^2 / 2`` (biased, low variance), ``k3 = exp(r) - r - 1`` (unbiased, non-negative, low variance)."""


@dataclasses.dataclass(frozen=True)
class AlgorithmChoice:
    """A run's algorithm, every name resolved once: the estimator (built with its settings), the policy loss (its
    import target and validated settings, which a trainer in another process builds again), the aggregation and the
    KL and entropy weights (``train.kl_coef`` and ``train.entropy_coef``, or the estimator's defaults where they are
    unset)."""

    estimator_name: str
    estimator: AdvantageEstimator
    estimator_target: str
    policy_loss_name: str
    policy_loss_target: str
    policy_loss_settings: dict[str, Any]
    aggregation: str
    kl_estimator: str
    norm_constant: float
    kl_coef: float
    entropy_coef: float

    def trainer_spec(self) -> dict[str, Any]:
        """What a trainer in another process needs to build the same :class:`~miles_core.training.objective.Objective`
        (plain data: :func:`~miles_core.training.objective.objective_from_spec` reads it)."""
        return {
            "estimator_target": self.estimator_target,
            "estimator_settings": self.estimator.settings.model_dump(),
            "policy_loss_target": self.policy_loss_target,
            "policy_loss_settings": self.policy_loss_settings,
            "aggregation": self.aggregation,
            "kl_estimator": self.kl_estimator,
            "norm_constant": self.norm_constant,
            "kl_coef": self.kl_coef,
            "entropy_coef": self.entropy_coef,
        }

    def describe(self) -> str:
        """``grpo advantages, ppo_clip loss, token-mean`` (and ``, KL 0.05 (k3)`` with a KL weight, ``, entropy
        bonus 0.03`` with one): the run says so at start."""
        kl = f", KL {self.kl_coef:g} ({self.kl_estimator})" if self.kl_coef > 0 else ""
        entropy = f", entropy bonus {self.entropy_coef:g}" if self.entropy_coef > 0 else ""
        return f"{self.estimator_name} advantages, {self.policy_loss_name} loss, {self.aggregation}{kl}{entropy}"


def choose_algorithm(train: Any, registries: Any, *, group_size: int, max_new_tokens: int) -> AlgorithmChoice:
    """Resolve the ``train`` section's estimator, policy loss and aggregation through ``registries``; an unknown name,
    settings that do not fit, or a ``group_size`` the estimator cannot work with are a :class:`ConfigError`."""

    def entry(registry: Any, name: str, field: str) -> Any:
        try:
            return registry.get_or_raise(name)
        except RegistryError as exc:
            raise ConfigError(f"train.{field} (--train-{field.replace('_', '-')}) = {name!r}: {exc}") from None

    estimator_entry = entry(registries.advantage_estimators, train.advantage_estimator, "advantage_estimator")
    estimator_class = estimator_entry.load()
    _check_class(estimator_class, AdvantageEstimator, train.advantage_estimator, "advantage estimator")
    estimator = estimator_class(train.advantage_estimator_settings)
    if group_size < estimator.min_group_size:
        raise ConfigError(
            f"train.advantage_estimator (--train-advantage-estimator) = {train.advantage_estimator!r} needs groups of "
            f"at least {estimator.min_group_size} samples (its baseline comes from the other samples of a prompt); "
            f"rollout.group_size (--rollout-group-size) is {group_size}"
        )
    kl_coef = resolve_kl_coef(train, estimator)
    check_kl_placement(train, estimator, kl_coef=kl_coef)
    loss_name = train.policy_loss or estimator.default_policy_loss
    loss_entry = entry(registries.policy_losses, loss_name, "policy_loss")
    loss_class = loss_entry.load()
    _check_class(loss_class, PolicyLoss, loss_name, "policy loss")
    settings = loss_class(train.policy_loss_settings).settings.model_dump()
    return AlgorithmChoice(
        estimator_name=train.advantage_estimator,
        estimator=estimator,
        estimator_target=_target_of(estimator_entry.target, estimator_class),
        policy_loss_name=loss_name,
        policy_loss_target=_target_of(loss_entry.target, loss_class),
        policy_loss_settings=settings,
        aggregation=train.loss_aggregation or estimator.default_loss_aggregation,
        kl_estimator=train.kl_estimator,
        norm_constant=float(max_new_tokens),
        kl_coef=kl_coef,
        entropy_coef=resolve_entropy_coef(train, estimator),
    )


def resolve_kl_coef(train: Any, estimator: AdvantageEstimator | None) -> float:
    """The run's KL weight: ``train.kl_coef`` where it is set (0 included), else the estimator's
    :attr:`~AdvantageEstimator.default_kl_coef` (0 without an estimator)."""
    if train.kl_coef is not None:
        return float(train.kl_coef)
    return float(estimator.default_kl_coef) if estimator is not None else 0.0


def resolve_entropy_coef(train: Any, estimator: AdvantageEstimator | None) -> float:
    """The run's entropy-bonus weight: ``train.entropy_coef`` where it is set (0 included), else the estimator's
    :attr:`~AdvantageEstimator.default_entropy_coef` (0 without an estimator)."""
    if train.entropy_coef is not None:
        return float(train.entropy_coef)
    return float(estimator.default_entropy_coef) if estimator is not None else 0.0


def with_weights(train: Any, *, kl_coef: float, entropy_coef: float) -> Any:
    """``train`` (a frozen section) with its ``kl_coef`` and ``entropy_coef`` resolved to these: what a trainer
    reads."""
    update = {
        field: value
        for field, value in (("kl_coef", kl_coef), ("entropy_coef", entropy_coef))
        if getattr(train, field) != value
    }
    return train.model_copy(update=update) if update else train


def resolved_weights(train: Any, estimator: AdvantageEstimator | None) -> Any:
    """``train`` with its KL and entropy weights resolved: the user's where set, else ``estimator``'s defaults."""
    return with_weights(
        train, kl_coef=resolve_kl_coef(train, estimator), entropy_coef=resolve_entropy_coef(train, estimator)
    )


def check_kl_placement(train: Any, estimator: AdvantageEstimator, *, kl_coef: float) -> None:
    """``kl_placement = reward`` needs a KL weight (``kl_coef``, resolved) and an estimator that takes rewards per
    token."""
    if train.kl_placement != "reward":
        return
    flag = "train.kl_placement (--train-kl-placement) = 'reward'"
    if kl_coef == 0:
        raise ConfigError(
            f"{flag} subtracts kl_coef x KL from each token's reward, and train.kl_coef is 0: set it "
            f"(--train-kl-coef; unset, it is the estimator {estimator.name!r}'s default)"
        )
    if not (estimator.takes_token_rewards or estimator.needs_critic):
        raise ConfigError(
            f"{flag} needs an estimator that takes a reward per token (ppo, reinforce_plus_plus); "
            f"{estimator.name!r} takes one reward per sample: use kl_placement loss with it"
        )


def trainer_side(estimator: AdvantageEstimator | None, train: Any) -> bool:
    """Whether the trainer computes the advantages (a critic's estimator, or the KL in the reward)."""
    if estimator is None:
        return False
    return estimator.needs_critic or (train.kl_placement == "reward" and estimator.takes_token_rewards)


def _check_class(found: Any, base: type, name: str, kind: str) -> None:
    if not (isinstance(found, type) and issubclass(found, base)):
        raise ConfigError(f"{kind} {name!r} is {found!r}, not a subclass of miles_core.{base.__name__}")


def _target_of(target: Any, loaded: type) -> str:
    return target if isinstance(target, str) else f"{loaded.__module__}:{loaded.__qualname__}"
