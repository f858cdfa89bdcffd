"""The core's group filters (``--rollout-filters``, registered through ``provide_rollout_filters``): which finished
groups may enter a training batch (DAPO's dynamic sampling). A filter is ``keep(group) -> bool``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_core.errors import ConfigError

if TYPE_CHECKING:
    from miles_core.registry import Registry
    from miles_core.rollout.samples import Group, GroupFilter


def nonzero_reward_std(group: Group) -> bool:
    """Keep a group whose rewards differ: when all are equal every GRPO advantage is zero and the group teaches
    nothing (it only dilutes the batch)."""
    rewards = [sample.reward for sample in group.samples]
    return max(rewards) > min(rewards)


def no_truncated(group: Group) -> bool:
    """Keep a group none of whose samples was stopped by ``max_new_tokens`` (DAPO's overlong filter: a cut
    answer's reward says little about the answer)."""
    return all(sample.finish_reason != "length" for sample in group.samples)


def load_filters(names: list[str], registry: Registry) -> list[GroupFilter]:
    """The filters ``names`` from the registry, each loaded and checked callable; an unknown name lists the
    available ones."""
    filters: list[GroupFilter] = []
    for name in names:
        keep = registry.get_or_raise(name).load()
        if not callable(keep):
            raise ConfigError(f"rollout filter {name!r} ({registry[name].target_text}) is not callable")
        filters.append((name, keep))
    return filters
