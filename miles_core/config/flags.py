"""Named command-line flags that set a path in the config."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ConfigFlag:
    """A command-line flag that sets one config path.

    ``path`` is dotted: ``"weight_transfer.mode"``, or a key inside a mapping field such as
    ``"model.implementations.deepseek_v4"``. With ``mapping=True`` the flag is repeatable and each value is
    ``KEY=VALUE``, setting ``path.KEY`` (this is how ``--model-impl FAMILY=NAME`` works). With ``const`` the value
    may be left out: ``--dashboard`` alone sets ``const`` (``--dashboard false`` still works).
    """

    flag: str
    path: str
    help: str = ""
    metavar: str | None = None
    mapping: bool = False
    const: str | None = None
