"""The metrics exporters' built-in plugin: feeds the run hooks into the exporters that ``metrics.exporters`` names
(none by default, and then neither prometheus-client nor tensorboard is imported).

Exporting never kills training, as with the dashboard: a failing exporter warns at a limited rate and the run goes
on. What can be known before the run starts is a config error instead: an unknown exporter, a bad host or port,
a missing library.
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

LIBRARIES = {"prometheus": ("prometheus_client", "prometheus-client"), "tensorboard": ("tensorboard", "tensorboard")}
"""Exporter -> (the module it imports, the package that provides it)."""


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
                help="metrics exporters: prometheus and/or tensorboard",
            )
        ]

    @hookimpl
    def validate_config(self, config: MilesConfig, registries: Any) -> None:
        from miles_core.builtin.metrics.config import MetricsSection  # deferred: pydantic (loaded with the config)

        metrics = config.section("metrics", MetricsSection)
        for name in metrics.exporters:
            module, package = LIBRARIES[name]
            if importlib.util.find_spec(module) is None:  # found, not imported: `miles config show` stays light
                raise ConfigError(
                    f"metrics.exporters (--metrics) = {','.join(metrics.exporters)}: the {name} "
                    f"exporter needs the package {package}, which is not installed: pip install "
                    f"{package} (or miles-core[metrics])"
                )
        if "tensorboard" in metrics.exporters and metrics.tensorboard_dir is not None:
            check_output_dir(metrics.tensorboard_dir, setting="metrics.tensorboard_dir (--metrics-tensorboard-dir)")

    # -- the run ------------------------------------------------------------------------------------------------

    @hookimpl
    def on_run_start(self, config: MilesConfig, run_dir: Path, start_step: int) -> None:
        from miles_core.builtin.metrics.config import MetricsSection  # deferred: pydantic (loaded with the config)

        metrics = config.section("metrics", MetricsSection)
        for name in metrics.exporters:
            with self.warnings.guard(f"starting the {name} exporter"):
                exporter = _make_exporter(name, metrics, run_dir)
                exporter.start(start_step=start_step)
                self.exporters[name] = exporter

    @hookimpl
    def on_run_resume(self, run_dir: Path, from_step: int) -> None:
        self._each("on_run_resume", "resume", from_step)

    @hookimpl
    def on_run_end(self, status: str, error: str | None) -> None:
        for name, exporter in self.exporters.items():
            with self.warnings.guard(f"closing the {name} exporter"):
                exporter.close()
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
