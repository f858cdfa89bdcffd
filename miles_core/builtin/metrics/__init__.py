"""Metrics exporters: the run's metrics, phases and weight updates, fed from the run hooks to Prometheus and
TensorBoard (both off by default: ``--metrics prometheus,tensorboard``).

``plugin.py`` is the built-in plugin that feeds the hooks to the exporters ``metrics.exporters`` names
(``config.py``); ``prometheus.py`` serves a scrape endpoint, ``tensorboard.py`` writes event files; ``values.py``
picks the numeric metrics. The exporter modules import their libraries, so this package does not import them.
"""

from miles_core.builtin.metrics.values import numeric

__all__ = ["numeric"]
