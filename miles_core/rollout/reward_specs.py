"""Reward specs as the config names them (``--reward math:1.0,format:0.1``, ``--rollout-reward-by-source``): parsed
and checked against the reward registry when the config is built, without importing the rollout (torch) or any
reward function; :mod:`miles_core.rollout.rewards` loads and runs them."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from miles_core.errors import ConfigError, RegistryError
from miles_core.targets import is_target

if TYPE_CHECKING:  # annotations only
    from miles_core.config import MilesConfig
    from miles_core.registry import Registries

REMOTE = "remote"
"""The part name of the reward server (``--reward-url``)."""

_WEIGHT = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def parse_reward_spec(text: str, *, field: str) -> list[tuple[str, float]]:
    """``"math:1.0,format:0.1"`` as ``[("math", 1.0), ("format", 0.1)]``: comma-separated parts, each a name (or
    ``module:function``) with an optional trailing ``:WEIGHT`` (1.0 without). A malformed spec is a one-line
    :class:`ConfigError` naming ``field``."""
    parts: list[tuple[str, float]] = []
    for raw in text.split(","):
        piece = raw.strip()
        head, sep, tail = piece.rpartition(":")
        tail = tail.strip()
        if sep and _WEIGHT.fullmatch(tail):
            name, weight = head.strip(), float(tail)
        elif sep and not all(word.isidentifier() for word in tail.split(".")):
            raise ConfigError(
                f"{field} = {text!r}: the weight {tail!r} of {head.strip()!r} is not a number; write NAME:WEIGHT, "
                "e.g. math:1.0,format:0.1"
            )
        else:
            name, weight = piece, 1.0
        if not name:
            raise ConfigError(f"{field} = {text!r}: a part names no reward; write NAME[:WEIGHT],NAME[:WEIGHT]...")
        if not math.isfinite(weight):
            raise ConfigError(f"{field} = {text!r}: the weight of {name!r} is not finite")
        if name in (known for known, _ in parts):
            raise ConfigError(f"{field} = {text!r}: {name!r} appears twice; give it one weight")
        parts.append((name, weight))
    return parts


def check_reward_specs(config: MilesConfig, registries: Registries) -> None:
    """Every reward the config names (``--reward``, each ``--rollout-reward-by-source`` value) parses, its
    registered names exist (an unknown one: the closest names) and ``remote`` goes with ``--reward-url``: checked
    when the config is built, before anything starts. ``module:function`` targets are imported when the run
    starts."""
    rollout = config.rollout
    specs = [("rollout.reward (--reward)", rollout.reward)] if rollout.reward is not None else []
    specs += [(f"rollout.reward_by_source.{source}", spec) for source, spec in rollout.reward_by_source.items()]
    named: set[str] = set()
    for field, spec in specs:
        for name, _ in parse_reward_spec(spec, field=field):
            named.add(name)
            if name != REMOTE and not is_target(name):
                try:
                    registries.reward_functions.get_or_raise(name)
                except RegistryError as exc:
                    raise ConfigError(f"{field} = {spec!r}: {exc}; or module:function") from None
    if REMOTE in named and rollout.reward_url is None:
        raise ConfigError(
            f"the reward part {REMOTE!r} is the reward server, but rollout.reward_url (--reward-url) is not set"
        )
    if rollout.reward_url is not None and specs and REMOTE not in named:
        raise ConfigError(
            f"rollout.reward_url (--reward-url) is set but no reward names {REMOTE!r}: add it, e.g. "
            f"--reward {REMOTE}:1.0,format:0.1"
        )
