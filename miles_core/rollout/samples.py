"""The value types of a rollout: a :class:`Sample` (one response to one prompt, with its tokens, logprobs, reward
and the weight versions that generated it), a :class:`Group` (the samples of one prompt, what a rollout filter
judges) and a :class:`Rollout` (one step's samples and the training batch made of them).

They hold data and the masks derived from it, nothing that runs: the hookspecs, the executor, the stream and the
dashboard all import them from here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from miles_core.engines.routed_experts import RoutedExperts
from miles_core.rollout.prompts import Prompt
from miles_core.rollout.sessions.session import Turn
from miles_core.training.batch import TrainBatch


@dataclasses.dataclass
class Sample:
    """One response to one prompt: its token ids and logprobs, its reward, and where and under which weight versions
    it was generated."""

    index: int  # position in the step: prompt_index * group_size + k
    prompt: Prompt
    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    response: str = ""
    finish_reason: str = ""
    weight_version: int | None = None  # the Miles version that generated its last tokens; None: the initial weights
    reward: float = 0.0
    engine: str = ""
    group: int = -1  # the index of its group in the data order (rollout_id * batch_size + slot); -1: an eval sample
    seed: int = 0  # its sampling seed: a function of (run seed, rollout_id, index) alone
    segments: list[tuple[int | None, int]] = dataclasses.field(default_factory=list)
    """``(weight version, tokens generated under it)`` in order: more than one when a weight update cut the request
    and it continued under the new weights (``--rollout-partial``)."""
    loss_mask: list[int] | None = None
    """An agent's sample: per response token, 1 for the policy's tokens and 0 for the messages its agent added."""
    turns: list[Turn] = dataclasses.field(default_factory=list)
    """An agent's sample: its assistant turns, as spans of ``response_ids``."""
    transcript: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """An agent's sample, turn by turn as the dashboard shows it: ``{"source": "policy" | "agent", "text",
    "tokens"}`` per span of ``response_ids`` (the policy's turns are trained on, the agent's messages masked)."""
    reward_parts: dict[str, float] = dataclasses.field(default_factory=dict)
    """Each reward part's value (before its weight), by its name; a failed part's is 0.0."""
    reward_errors: int = 0  # reward parts that raised or returned no finite number (each scored 0)
    reward_timeouts: int = 0  # reward parts that ran past --rollout-reward-timeout-s (each scored 0)
    routed_experts: RoutedExperts | None = None
    """Routing replay: the experts each token the engine ran was routed to, ``[prompt + response - 1][layers]
    [top_k]``; a continued request's are appended after those it already has."""

    def off_policy_mask(self) -> tuple[float, ...]:
        """Per response token: 1.0 for the tokens of the last weight version, 0.0 for earlier ones."""
        last = self.segments[-1][0] if self.segments else None
        return tuple(float(version == last) for version, count in self.segments for _ in range(count))

    def train_mask(self, *, mask_off_policy: bool) -> tuple[float, ...] | None:
        """The sample's loss mask: its agent's (the policy's tokens), times the off-policy mask when asked; ``None``
        when every response token trains."""
        masks = [tuple(float(m) for m in self.loss_mask)] if self.loss_mask is not None else []
        if mask_off_policy:
            masks.append(self.off_policy_mask())
        if not masks:
            return None
        return tuple(math.prod(values) for values in zip(*masks, strict=True))


@dataclasses.dataclass
class Group:
    """The ``group_size`` samples of one prompt, generated, scored and (when ``--rollout-filters`` are set) kept."""

    index: int  # the group's place in its data order: rollout_id * batch_size + slot
    rollout_id: int
    slot: int
    samples: list[Sample]

    def versions(self, initial: int) -> list[int]:
        """Every weight version any of its tokens were generated with (``None``, the initial weights, as
        ``initial``)."""
        return sorted({initial if v is None else v for s in self.samples for v, _ in s.segments} or {initial})


@dataclasses.dataclass
class Rollout:
    """One step's rollout: its samples, the training batch made of them (``None`` for an eval) and its statistics."""

    rollout_id: int
    samples: list[Sample]
    batch: TrainBatch | None
    stats: dict[str, float]
    groups: list[int] = dataclasses.field(default_factory=list)  # the indices of its groups, in batch order


GroupFilter = tuple[str, Callable[[Group], bool]]
"""A ``--rollout-filters`` entry: its name and ``keep(group) -> bool``."""
