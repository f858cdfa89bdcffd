"""The MLflow exporter (``--metrics mlflow``): one MLflow run per ``miles train``, with the flattened config as
params, the labels as tags and every metric at its step.

The tracking store is ``metrics.mlflow_tracking_uri``: a server (``http://HOST:PORT``, checked to answer before the
run starts, so an unreachable one is an error within seconds rather than MLflow's minutes of retries) or a local
database, by default ``sqlite:///RUN_DIR/mlflow.db`` (MLflow's file store, ``./mlruns``, is in maintenance mode and
refused by MLflow 3 unless ``MLFLOW_ALLOW_FILE_STORE=true``). ``mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db``
shows it; ``MlflowClient().get_metric_history`` reads it back.

MLflow's limits shape what is logged: a param value is cut to 6000 characters, ending in ``...[truncated]``; a
metric or param name keeps only the characters MLflow allows (``@`` becomes ``_at_``, any other character ``_``:
``eval/pass@4`` is ``eval/pass_at_4``); params and tags go in batches of 100.

A resumed run (``--run-resume true``) is a new MLflow run with the same name, tagged ``miles.resumed_from_step``:
MLflow cannot drop points from a metric's history.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from miles_core.builtin.metrics.values import flatten, numeric
from miles_core.errors import MilesError

PACKAGES = "mlflow-skinny sqlalchemy alembic"
MAX_PARAM_VALUE = 6000
"""MLflow's longest param value (``mlflow.utils.validation.MAX_PARAM_VAL_LENGTH``)."""
MAX_KEY = 250
BATCH = 100
"""Params or tags per ``log_batch`` call: MLflow's limit."""
TRUNCATED = "...[truncated]"
REACH_TIMEOUT_S = 10.0
"""How long the server may take to answer the check before the run starts."""
DEFAULT_DB = "mlflow.db"


def mlflow_key(name: str) -> str:
    """``name`` with only the characters MLflow allows in a metric or param name, at most 250 of them, and no empty,
    ``.`` or ``..`` part between slashes (MLflow refuses a name that a path would normalise to another)."""
    key = re.sub(r"[^/\w.\- ]", "_", name.replace("@", "_at_"), flags=re.ASCII)
    key = "/".join(part for part in key.split("/") if part not in ("", ".", ".."))
    return key[:MAX_KEY].rstrip("/") or "_"


def param_value(value: str) -> str:
    """``value``, cut to MLflow's longest param value with a marker saying so."""
    if len(value) <= MAX_PARAM_VALUE:
        return value
    return value[: MAX_PARAM_VALUE - len(TRUNCATED)] + TRUNCATED


def default_tracking_uri(run_dir: Path) -> str:
    """``sqlite:///RUN_DIR/mlflow.db``, the store of a run that names none."""
    return f"sqlite:///{(run_dir / DEFAULT_DB).resolve()}"


def check_reachable(uri: str) -> None:
    """For a server URI, a :class:`MilesError` unless it answers an HTTP request within ``REACH_TIMEOUT_S``."""
    if urlsplit(uri).scheme not in ("http", "https"):
        return
    try:
        httpx.get(uri.rstrip("/") + "/health", timeout=REACH_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise MilesError(
            f"metrics.mlflow_tracking_uri (--metrics-mlflow-tracking-uri) = {uri}: the MLflow server does not "
            f"answer ({type(exc).__name__}: {exc}); start it, or name another one"
        ) from None


class MlflowExporter:
    """An MLflow run for the metrics of one ``miles`` run; opened by :meth:`start`, ended by :meth:`close`."""

    def __init__(
        self,
        *,
        tracking_uri: str,
        experiment: str,
        name: str,
        config: Mapping[str, Any],
        labels: Mapping[str, str],
        artifact_dir: Path,
    ) -> None:
        try:
            # Deferred: an optional dependency, imported by runs that ask for it only.
            from mlflow.entities import Metric, Param, RunTag
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise MilesError(
                f"metrics.exporters (--metrics) names mlflow, which needs the packages {PACKAGES}: pip install "
                f"{PACKAGES} (or miles-core[mlflow]) ({exc})"
            ) from None
        self._entities = (Metric, Param, RunTag)
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.experiment, self.name, self.artifact_dir = experiment, name, artifact_dir
        self.params = {mlflow_key(key): param_value(value) for key, value in flatten(config).items()}
        self.labels = dict(labels)
        self.run_id: str | None = None
        self._eval_logged: tuple[int, frozenset[str]] | None = None  # the last eval's step and names

    def start(self, *, start_step: int) -> None:
        """Check the server answers, then create the run (and the experiment if missing) and log its params."""
        check_reachable(self.tracking_uri)
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            location = self.artifact_dir.resolve().as_uri() if urlsplit(self.tracking_uri).scheme == "sqlite" else None
            experiment_id = self.client.create_experiment(self.experiment, artifact_location=location)
        self.run_id = self.client.create_run(experiment_id, run_name=self.name, tags=self.labels).info.run_id
        _, Param, _ = self._entities
        params = [Param(key, value) for key, value in self.params.items()]
        for first in range(0, len(params), BATCH):
            self.client.log_batch(self.run_id, params=params[first : first + BATCH])

    def resume(self, from_step: int) -> None:
        """This MLflow run's history starts at ``from_step``: a tag says so."""
        self.client.set_tag(self.run_id, "miles.resumed_from_step", str(from_step))

    def metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        # on_metrics repeats the eval/ metrics of an eval in this step, which eval() logged: log them once.
        logged = self._eval_logged[1] if self._eval_logged and self._eval_logged[0] == step else frozenset()
        self._log(step, {name: value for name, value in numeric(metrics).items() if name not in logged})

    def eval(self, step: int, metrics: Mapping[str, Any], seconds: float) -> None:
        values = numeric(metrics)
        self._log(step, values)
        self._eval_logged = (step, frozenset(values))

    def phase(self, step: int, phase: str, seconds: float) -> None:
        """Phase durations reach MLflow as the ``time/PHASE`` metrics of the step."""

    def weight_update(self, version: int, report: Any) -> None:
        """Weight-update bytes and seconds reach MLflow as the ``weight_transfer/`` metrics of the step."""

    def close(self, status: str = "finished") -> None:
        """End the MLflow run: FINISHED for a finished run, FAILED for a failed one, KILLED for a stopped one."""
        if self.run_id is None:
            return
        state = "FINISHED" if status == "finished" else "KILLED" if status == "stopped" else "FAILED"
        self.client.set_terminated(self.run_id, status=state)
        self.run_id = None

    def _log(self, step: int, metrics: Mapping[str, float]) -> None:
        Metric, _, _ = self._entities
        now = int(time.time() * 1000)
        values = [Metric(mlflow_key(name), value, now, step) for name, value in metrics.items()]
        for first in range(0, len(values), 1000):  # MLflow's limit of metrics per batch
            self.client.log_batch(self.run_id, metrics=values[first : first + 1000])
