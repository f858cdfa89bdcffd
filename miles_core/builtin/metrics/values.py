"""The metric values that exporters export: the numeric entries of a metrics mapping."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of ``metrics`` (ints, floats, bools, numpy numbers) as floats; text and other values are
    skipped (no exporter can show them as a number)."""
    return {
        str(name): float(value)
        for name, value in metrics.items()
        if isinstance(value, int | float) or _is_numpy_number(value)
    }


def _is_numpy_number(value: Any) -> bool:
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    return type(value).__module__ == "numpy" and kind in ("b", "i", "u", "f")


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``config`` as one level of ``section.key`` (``a.b.c`` for nested mappings) to the value as text (JSON-like:
    lists and ``None`` as Python writes them), for trackers that take flat string parameters (MLflow)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, prefix=name + "."))
        else:
            flat[name] = str(value)
    return flat
