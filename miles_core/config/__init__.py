"""Configuration: frozen pydantic sections contributed by plugins, built from defaults, YAML and flags.

The names below are re-exported lazily (PEP 562): plugin modules import :class:`ConfigFlag` at start-up, and
``miles plugins`` must not pay for importing pydantic.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ConfigFlag": "miles_core.config.flags",
    "MilesConfig": "miles_core.config.build",
    "Section": "miles_core.config.section",
    "build_config": "miles_core.config.build",
    "config_model": "miles_core.config.build",
    "load_config_file": "miles_core.config.build",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'miles_core.config' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
