"""The metrics exporters' built-in plugin: feeds the run hooks into the exporters that ``metrics.exporters`` names
(none by default, and then no exporter's library is imported).

Exporting never kills training, as with the dashboard: a failing exporter warns at a limited rate and the run goes
on. What can be known before the run starts is a config error instead: an unknown exporter, a bad host or port,
a missing library. An experiment tracker (wandb, mlflow) that cannot start fails the run at its start, before any
worker starts: its record is what the user asked the run for, and a run without it would be lost to them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_core.builtin.core_plugin import check_output_dir
from miles_core.builtin.dashboard.plugin import RateLimitedWarnings
from miles_core.config.flags import ConfigFlag
from miles_core.errors import ConfigError
from miles_core.hookspecs import hookimpl

if TYPE_CHECKING:
    from miles_core.config.build import MilesConfig

LIBRARIES = {
    "prometheus": (("prometheus_client", "prometheus-client"),),
    "tensorboard": (("tensorboard", "tensorboard"),),
    "wandb": (("wandb", "wandb"),),
    "mlflow": (("mlflow", "mlflow-skinny"), ("sqlalchemy", "sqlalchemy"), ("alembic", "alembic")),
}
"""Exporter -> (the module it imports, the package that provides it) for each library it needs."""
EXTRAS = {"prometheus": "metrics", "tensorboard": "metrics", "wandb": "wandb", "mlflow": "mlflow"}
"""Exporter -> the extra of miles-core that installs its libraries."""
TRACKERS = frozenset({"wandb", "mlflow"})
"""Exporters whose failure to start fails the run."""


class MetricsPlugin:
    """One per plugin manager: the exporters of the run in progress."""

    def __init__(self) -> None:
        self.exporters: dict[str, Any] = {}  # name -> exporter, while a run exports
        self.warnings = RateLimitedWarnings(interval_s=60.0, subject="metrics")

    @hookimpl
    def config_sections(self) -> dict[str, type]:
        from miles_core.builtin.metrics.config import MetricsSection  # deferred: pydantic, as in the core plugin

        return {"metrics": MetricsSection}

    @hookimpl
    def config_flags(self) -> list[ConfigFlag]:
        return [
            ConfigFlag(
                flag="--metrics",
                path="metrics.exporters",
                metavar="NAME[,NAME]",
                help="metrics exporters: prometheus, tensorboard, wandb, mlflow",
            )
        ]

    @hookimpl
    def validate_config(self, config: MilesConfig, registries: Any) -> None:
        from miles_core.builtin.metrics.config import MetricsSection  # deferred: pydantic (loaded with the config)

        metrics = config.section("metrics", MetricsSection)
        for name in metrics.exporters:
            _check_installed(name, metrics.exporters)
        if "tensorboard" in metrics.exporters and metrics.tensorboard_dir is not None:
            check_output_dir(metrics.tensorboard_dir, setting="metrics.tensorboard_dir (--metrics-tensorboard-dir)")
        if "wandb" in metrics.exporters and metrics.wandb_dir is not None:
            check_output_dir(metrics.wandb_dir, setting="metrics.wandb_dir (--metrics-wandb-dir)")

    # -- the run ------------------------------------------------------------------------------------------------

    @hookimpl(tryfirst=True)  # a tracker that cannot start fails the run before other plugins start anything
    def on_run_start(self, config: MilesConfig, run_dir: Path, start_step: int) -> None:
        from miles_core.builtin.metrics.config import MetricsSection  # deferred: pydantic (loaded with the config)

        metrics = config.section("metrics", MetricsSection)
        for name in metrics.exporters:
            if name in TRACKERS:
                self._start_tracker(name, config, run_dir, start_step)
                continue
            with self.warnings.guard(f"starting the {name} exporter"):
                exporter = _make_exporter(name, metrics, run_dir)
                exporter.start(start_step=start_step)
                self.exporters[name] = exporter

    def _start_tracker(self, name: str, config: MilesConfig, run_dir: Path, start_step: int) -> None:
        """Start the tracker ``name``; when it cannot start, close the exporters started so far and raise."""
        try:
            exporter = make_tracker(name, config, run_dir)
            exporter.start(start_step=start_step)
        except BaseException:
            self.on_run_end(status="failed", error=None)
            raise
        self.exporters[name] = exporter

    @hookimpl
    def on_run_resume(self, run_dir: Path, from_step: int) -> None:
        self._each("on_run_resume", "resume", from_step)

    @hookimpl
    def on_run_end(self, status: str, error: str | None) -> None:
        if status != "finished" and (error or "").startswith("KeyboardInterrupt"):
            status = "stopped"  # Ctrl-C, SIGTERM or SIGHUP: a tracker marks the run killed rather than failed
        for name, exporter in self.exporters.items():
            with self.warnings.guard(f"closing the {name} exporter"):
                exporter.close(status=status)
        self.exporters = {}

    @hookimpl
    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._each("on_metrics", "metrics", step, metrics)

    @hookimpl
    def on_eval(self, step: int, metrics: dict[str, float], started: float, ended: float) -> None:
        self._each("on_eval", "eval", step, metrics, ended - started)

    @hookimpl
    def on_phase(self, step: int, phase: str, started: float, ended: float) -> None:
        if phase != "eval":  # every eval reaches on_eval, the one before training too
            self._each("on_phase", "phase", step, phase, ended - started)

    @hookimpl
    def after_weight_update(self, version: int, protocol: Any, report: Any) -> None:
        self._each("after_weight_update", "weight_update", version, report)

    # -- failures never reach the loop --------------------------------------------------------------------------

    def _each(self, hook: str, method: str, *args: Any) -> None:
        for name, exporter in self.exporters.items():
            with self.warnings.guard(f"{hook} of the {name} exporter"):
                getattr(exporter, method)(*args)


def _check_installed(name: str, exporters: list[str]) -> None:
    """A :class:`ConfigError` naming what to install when a library of the exporter ``name`` is missing."""
    for module, package in LIBRARIES[name]:
        if importlib.util.find_spec(module) is None:  # found, not imported: `miles config show` stays light
            everything = " ".join(package for _, package in LIBRARIES[name])
            raise ConfigError(
                f"metrics.exporters (--metrics) = {','.join(exporters)}: the {name} exporter needs the package "
                f"{package}, which is not installed: pip install {everything} (or miles-core[{EXTRAS[name]}])"
            )


def make_tracker(name: str, config: MilesConfig, run_dir: Path) -> Any:
    """The experiment tracker ``name`` (wandb or mlflow) of a run in ``run_dir``, not started yet."""
    from miles_core.builtin.metrics.config import MetricsSection  # deferred: pydantic (loaded with the config)

    section = config.section("metrics", MetricsSection)
    run_name = section.run_name or run_dir.resolve().name
    facts = {"config": config.model_dump(mode="json"), "labels": section.labels, "name": run_name}
    if name == "wandb":
        from miles_core.builtin.metrics.wandb_tracker import WandbExporter  # deferred: wandb

        directory = Path(section.wandb_dir) if section.wandb_dir is not None else run_dir
        return WandbExporter(
            project=section.wandb_project,
            entity=section.wandb_entity,
            mode=section.wandb_mode,
            directory=directory,
            **facts,
        )
    from miles_core.builtin.metrics.mlflow_tracker import MlflowExporter, default_tracking_uri  # deferred: mlflow

    uri = section.mlflow_tracking_uri or default_tracking_uri(run_dir)
    print(f"miles: MLflow run {run_name!r} in experiment {section.mlflow_experiment!r} at {uri}", flush=True)
    return MlflowExporter(
        tracking_uri=uri, experiment=section.mlflow_experiment, artifact_dir=run_dir / "mlartifacts", **facts
    )


def _make_exporter(name: str, section: Any, run_dir: Path) -> Any:
    """The exporter ``name`` of a run in ``run_dir``; the Prometheus one prints its URL and writes it to a file."""
    if name == "prometheus":
        from miles_core.builtin.metrics.prometheus import (  # deferred: prometheus-client
            PrometheusExporter,
            write_url_file,
        )

        exporter = PrometheusExporter(host=section.prometheus_host, port=section.prometheus_port)
        write_url_file(run_dir, exporter.url)
        print(f"miles: Prometheus metrics at {exporter.url}", flush=True)
        return exporter
    from miles_core.builtin.metrics.tensorboard import DEFAULT_DIR, TensorBoardExporter  # deferred: torch, tensorboard

    log_dir = Path(section.tensorboard_dir) if section.tensorboard_dir is not None else run_dir / DEFAULT_DIR
    exporter = TensorBoardExporter(log_dir=log_dir)
    print(f"miles: TensorBoard event files in {log_dir} (tensorboard --logdir {log_dir})", flush=True)
    return exporter
