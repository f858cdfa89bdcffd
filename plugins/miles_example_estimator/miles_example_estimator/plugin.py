"""The plugin's one hook: it registers the ``opo`` advantage estimator (by import string: listing plugins imports
nothing of it)."""

from __future__ import annotations

from miles_core import Implementation, hookimpl


@hookimpl
def provide_advantage_estimators() -> list[Implementation]:
    return [Implementation("opo", "miles_example_estimator.opo:Opo", "length-weighted group baseline (OPO)")]
