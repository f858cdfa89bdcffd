"""``TrainBatch``: what a rollout hands the trainer (token ids in, token ids and logprobs out, no retokenising)."""

from __future__ import annotations

import dataclasses
import math

import torch

from miles_core.engines.routed_experts import NOT_ROUTED, RoutedExperts, RoutedExpertsError, check_routed_experts
from miles_core.errors import MilesError


@dataclasses.dataclass(frozen=True)
class TrainSample:
    """One sample: its tokens, the rollout's logprob of each response token, its advantage and reward.

    ``advantage`` is one number for every response token, or a tuple with one number per response token (token-level
    estimators such as ``reinforce_plus_plus``).

    ``loss_mask`` has one entry per response token, between 0 and 1: 1 trains on the token, 0 masks it off (a token
    generated under older weights, for example); ``None`` trains on every response token.

    ``routed_experts`` (routing replay): the experts the engine routed each token to, ``[tokens][layers][top_k]``
    for the ``len(prompt_ids) + len(response_ids) - 1`` tokens it ran (all but the last response token, as SGLang
    reports them); ``None``: the trainer routes this sample's tokens itself.

    ``returns`` and ``old_values`` (an estimator with a critic, set by the trainer): the critic's regression target
    and its value before the update, one per response token."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    advantage: float | tuple[float, ...]
    reward: float
    loss_mask: tuple[float, ...] | None = None
    routed_experts: RoutedExperts | None = None
    returns: tuple[float, ...] | None = None
    old_values: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.advantage, int | float):
            advantage = tuple(self.advantage)
            if len(advantage) != len(self.response_ids):
                raise ValueError(
                    f"{self.describe()}: {len(advantage)} token advantages; a per-token advantage needs one per "
                    f"response token ({len(self.response_ids)})"
                )
            object.__setattr__(self, "advantage", advantage)
        if self.routed_experts is not None:
            tokens = max(len(self.prompt_ids) + len(self.response_ids) - 1, 0)
            try:
                routed = check_routed_experts(self.routed_experts, num_tokens=tokens)
            except RoutedExpertsError as exc:
                raise ValueError(f"{self.describe()}: routed_experts: {exc}") from None
            object.__setattr__(self, "routed_experts", routed)
        for field in ("returns", "old_values"):
            values = getattr(self, field)
            if values is not None:
                if len(values) != len(self.response_ids):
                    raise ValueError(
                        f"{self.describe()}: {len(values)} {field}; the critic needs one per response token "
                        f"({len(self.response_ids)})"
                    )
                object.__setattr__(self, field, tuple(float(value) for value in values))
        if self.loss_mask is None:
            return
        mask = tuple(self.loss_mask)
        if len(mask) != len(self.response_ids):
            raise ValueError(
                f"{self.describe()}: loss_mask has {len(mask)} entries; it needs one per response token "
                f"({len(self.response_ids)}), or None to train on every one"
            )
        bad = [value for value in mask if not (isinstance(value, int | float) and math.isfinite(value))]
        bad = bad or [value for value in mask if not 0 <= value <= 1]
        if bad:
            raise ValueError(f"{self.describe()}: loss_mask entries must be numbers from 0 to 1, got {bad[0]!r}")
        object.__setattr__(self, "loss_mask", tuple(float(value) for value in mask))  # a list given becomes a tuple

    def describe(self) -> str:
        """The sample as an error message names it: its lengths and the start of its prompt."""
        head = ", ".join(str(token) for token in self.prompt_ids[:8])
        more = ", ..." if len(self.prompt_ids) > 8 else ""
        return (
            f"the sample with prompt [{head}{more}] ({len(self.prompt_ids)} prompt tokens, "
            f"{len(self.response_ids)} response tokens)"
        )

    @property
    def trained_tokens(self) -> float:
        """How many response tokens the loss counts: all of them, less those ``loss_mask`` masks off."""
        return float(len(self.response_ids)) if self.loss_mask is None else sum(self.loss_mask)


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """What a training backend trains on in one step: the step's samples as token ids, with their advantages and
    masks."""

    samples: list[TrainSample]

    def __len__(self) -> int:
        return len(self.samples)

    def micro_batches(self, size: int) -> list[TrainBatch]:
        return [TrainBatch(self.samples[i : i + size]) for i in range(0, len(self.samples), size)]

    def tensors(self, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
        """Right-padded ``input_ids [B, L]`` and, aligned with the next-token targets ``input_ids[:, 1:]``:
        ``response_mask`` (1 on response tokens, times each sample's ``loss_mask``), ``rollout_logprobs`` (both
        ``[B, L-1]``), plus ``advantages``: ``[B]``, or ``[B, L-1]`` aligned as the mask when a sample has one per
        token; ``rewards [B]``; ``returns`` and ``old_values`` ``[B, L-1]`` when every sample has them (a critic's
        targets); when a sample carries routed experts, ``routed_experts [B, L,
        layers, top_k]`` (:data:`NOT_ROUTED` where nothing was recorded: padding, the last token, samples without
        them)."""
        length = max(len(s.prompt_ids) + len(s.response_ids) for s in self.samples)
        ids, masks, olds = [], [], []  # Python rows, then one tensor each: a tensor per row costs more than its data
        for sample in self.samples:
            sequence = [*sample.prompt_ids, *sample.response_ids]
            ids.append(sequence + [pad_token_id] * (length - len(sequence)))
            before = [0.0] * (len(sample.prompt_ids) - 1)  # up to the target position of the first response token
            after = [0.0] * (length - len(sequence))
            response = [1.0] * len(sample.response_ids) if sample.loss_mask is None else list(sample.loss_mask)
            masks.append(before + response + after)
            olds.append(before + list(sample.rollout_logprobs) + after)
        input_ids = torch.tensor(ids, dtype=torch.long)
        mask = torch.tensor(masks, dtype=torch.float32)
        old = torch.tensor(olds, dtype=torch.float32)
        advantages = self._advantages(length)
        rewards = torch.tensor([s.reward for s in self.samples], dtype=torch.float32)
        tensors = {
            "input_ids": input_ids,
            "response_mask": mask,
            "rollout_logprobs": old,
            "advantages": advantages,
            "rewards": rewards,
        }
        for field in ("returns", "old_values"):
            if all(getattr(sample, field) is not None for sample in self.samples):
                tensors[field] = self._per_token(field, length)
        routed = self.routed_experts(length)
        if routed is not None:
            tensors["routed_experts"] = routed
        return tensors

    def _per_token(self, field: str, length: int) -> torch.Tensor:
        """A per-response-token field of every sample as ``[B, L-1]``, aligned as the response mask."""
        rows = []
        for sample in self.samples:
            before = [0.0] * (len(sample.prompt_ids) - 1)
            after = [0.0] * (length - len(sample.prompt_ids) - len(sample.response_ids))
            rows.append(before + list(getattr(sample, field)) + after)
        return torch.tensor(rows, dtype=torch.float32)

    def _advantages(self, length: int) -> torch.Tensor:
        if all(isinstance(s.advantage, int | float) for s in self.samples):
            return torch.tensor([s.advantage for s in self.samples], dtype=torch.float32)
        rows = []
        for sample in self.samples:
            before = [0.0] * (len(sample.prompt_ids) - 1)
            after = [0.0] * (length - len(sample.prompt_ids) - len(sample.response_ids))
            per_token = sample.advantage
            if isinstance(per_token, int | float):
                per_token = (float(per_token),) * len(sample.response_ids)
            rows.append(before + list(per_token) + after)
        return torch.tensor(rows, dtype=torch.float32)

    def routed_experts(self, length: int) -> torch.Tensor | None:
        """The samples' routed experts as ``[B, length, layers, top_k]`` (see :meth:`tensors`); ``None`` when no
        sample has any. Samples whose layers or ``top_k`` differ are a :class:`MilesError`."""
        shapes = {(len(s.routed_experts[0]), len(s.routed_experts[0][0])) for s in self.samples if s.routed_experts}
        if not shapes:
            return None
        if len(shapes) > 1:
            raise MilesError(f"the batch's routed experts have different [layers][top_k]: {sorted(shapes)}")
        layers, top_k = shapes.pop()
        out = torch.full((len(self.samples), length, layers, top_k), NOT_ROUTED, dtype=torch.long)
        for row, sample in enumerate(self.samples):
            if sample.routed_experts:
                out[row, : len(sample.routed_experts)] = torch.tensor(sample.routed_experts, dtype=torch.long)
        return out


def trained_tokens(batch: TrainBatch) -> float:
    """The response tokens the loss of ``batch`` counts (what each micro-batch's share of the step divides by); a
    batch with none is a :class:`MilesError`."""
    if not any(sample.response_ids for sample in batch.samples):
        raise MilesError("the batch has no response tokens to train on")
    total = sum(sample.trained_tokens for sample in batch.samples)
    if total <= 0:
        raise MilesError(
            f"every response token of the batch's {len(batch)} samples is masked off by their loss_mask: nothing to "
            "train on (a loss_mask needs a 1 somewhere in the batch)"
        )
    return total
