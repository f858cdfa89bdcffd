"""Metrics exporters: the run's metrics, phases and weight updates, fed from the run hooks to Prometheus,
TensorBoard, W&B and MLflow (all off by default: ``--metrics prometheus,tensorboard,wandb,mlflow``).

``plugin.py`` is the built-in plugin that feeds the hooks to the exporters ``metrics.exporters`` names
(``config.py``); ``prometheus.py`` serves a scrape endpoint, ``tensorboard.py`` writes event files,
``wandb_tracker.py`` and ``mlflow_tracker.py`` log to the experiment trackers; ``values.py`` picks the numeric
metrics and flattens the config. The exporter modules import their libraries, so this package does not import them.
"""

from miles_core.builtin.metrics.values import numeric

__all__ = ["numeric"]
