"""The dashboard's built-in plugin: records every dashboard hook of a run in ``RUN_DIR/dashboard.sqlite`` and, with
``--dashboard``, serves the live dashboard while the run goes on.

Observability never kills training: every hook body runs under :meth:`RateLimitedWarnings.guard`, which catches any
exception and warns about it at a limited rate (once per ``dashboard.warn_interval_s`` per kind of event).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_core.builtin.dashboard.store import DashboardStore
from miles_core.config.flags import ConfigFlag
from miles_core.errors import ConfigError
from miles_core.events import EngineInfo, RouterInfo, TrainerInfo
from miles_core.hookspecs import hookimpl

if TYPE_CHECKING:
    from miles_core.config.build import MilesConfig


class RateLimitedWarnings:
    """Warns about a kind of failure at most once per ``interval_s``, counting the ones it held back."""

    def __init__(self, interval_s: float, *, subject: str = "dashboard") -> None:
        self.interval_s = interval_s
        self.subject = subject  # what failed, for the message: the dashboard, the metrics exporters
        self.last: dict[str, float] = {}
        self.held_back: dict[str, int] = {}

    def warn(self, kind: str, exc: BaseException) -> bool:
        """Log ``exc`` for ``kind`` unless one was logged less than ``interval_s`` ago; returns whether it logged."""
        now = time.monotonic()
        if kind in self.last and now - self.last[kind] < self.interval_s:
            self.held_back[kind] = self.held_back.get(kind, 0) + 1
            return False
        held = self.held_back.pop(kind, 0)
        self.last[kind] = now
        more = f" ({held} more since the last warning)" if held else ""
        logging.getLogger(f"miles.{self.subject}").warning(
            "%s: %s failed: %s: %s%s; training goes on", self.subject, kind, type(exc).__name__, exc, more
        )
        return True

    @contextlib.contextmanager
    def guard(self, kind: str) -> Iterator[None]:
        """Run the body; an exception of ``kind`` is warned about (rate-limited), never raised."""
        try:
            yield
        except Exception as exc:
            self.warn(kind, exc)


class DashboardPlugin:
    """One per plugin manager (the plugin manager builds it): the run's store and, with ``--dashboard``, its
    server."""

    def __init__(self) -> None:
        self.store: DashboardStore | None = None  # while a run records
        self.server: Any = None  # a DashboardServer while a run serves
        self.warnings = RateLimitedWarnings(interval_s=60.0)
        self._weight_update_started: float | None = None

    # -- configuration ------------------------------------------------------------------------------------------

    @hookimpl
    def config_sections(self) -> dict[str, type]:
        from miles_core.builtin.dashboard.config import DashboardSection  # deferred: pydantic, as in the core plugin

        return {"dashboard": DashboardSection}

    @hookimpl
    def config_flags(self) -> list[ConfigFlag]:
        return [
            ConfigFlag(
                flag="--dashboard",
                path="dashboard.serve",
                const="true",
                metavar="BOOL",
                help="serve the live dashboard during the run and print its URL",
            )
        ]

    @hookimpl
    def validate_config(self, config: MilesConfig, registries: Any) -> None:
        from miles_core.builtin.dashboard.config import DashboardSection  # deferred: pydantic (loaded with the config)

        dashboard = config.section("dashboard", DashboardSection)
        if dashboard.serve and not dashboard.record:
            raise ConfigError(
                "dashboard.serve (--dashboard) = True needs dashboard.record = True: the dashboard "
                "shows what the run records (drop --dashboard-record false)"
            )

    # -- the run ------------------------------------------------------------------------------------------------

    @hookimpl
    def on_run_start(self, config: MilesConfig, run_dir: Path, start_step: int) -> None:
        from miles_core.builtin.dashboard.config import DashboardSection  # deferred: pydantic (loaded with the config)

        dashboard = config.section("dashboard", DashboardSection)
        self.warnings.interval_s = dashboard.warn_interval_s
        if not dashboard.record:
            return
        with self.warnings.guard("opening the dashboard database"):
            self.store = DashboardStore(run_dir)
            self.store.run_started(
                run_dir=str(run_dir),
                start_step=start_step,
                num_steps=config.run.num_steps,
                config=config.model_dump(mode="json"),
            )
        if dashboard.serve and self.store is not None:
            with self.warnings.guard("starting the dashboard server"):
                from miles_core.builtin.dashboard.server import DashboardServer  # deferred: http.server, for runs only

                self.server = DashboardServer(run_dir, host=dashboard.host, port=dashboard.port)
                self.server.start()
                print(f"miles: dashboard at {self.server.url}", flush=True)

    @hookimpl
    def on_run_resume(self, run_dir: Path, from_step: int) -> None:
        self._record("on_run_resume", "drop_steps_from", from_step)

    @hookimpl
    def on_run_end(self, status: str, error: str | None) -> None:
        if self.store is not None:
            with self.warnings.guard("closing the dashboard database"):
                self.store.run_ended(status=status, error=error)
                self.store.close()
            self.store = None
        if self.server is not None:
            with self.warnings.guard("stopping the dashboard server"):
                print(
                    f"miles: the dashboard stops with this run; `miles dashboard {self.server.run_dir}` serves it "
                    "again",
                    flush=True,
                )
                self.server.stop()
            self.server = None

    # -- topology and events ------------------------------------------------------------------------------------

    @hookimpl
    def register_trainer(self, trainer: TrainerInfo) -> None:
        self._record("register_trainer", "set_trainer", trainer.to_dict())

    @hookimpl
    def register_engines(self, engines: list[EngineInfo]) -> None:
        self._record("register_engines", "set_engines", [engine.to_dict() for engine in engines])

    @hookimpl
    def register_router(self, router: RouterInfo) -> None:
        self._record("register_router", "set_router", router.to_dict())

    # Events are stored under ``step``, the number the terminal and metrics.jsonl show (rollout_id + 1), so that
    # the terminal's step 160 is /api/steps/160 and the eval before training is step 0.

    @hookimpl
    def on_phase(self, step: int, phase: str, started: float, ended: float) -> None:
        if phase != "eval":  # every eval is recorded by on_eval, which also sees the one before training
            self._record("on_phase", "add_phase", step=step, phase=phase, started=started, ended=ended)

    @hookimpl
    def on_eval(self, step: int, metrics: dict[str, float], started: float, ended: float) -> None:
        self._record("on_eval", "add_phase", step=step, phase="eval", started=started, ended=ended)
        self._record("on_eval", "add_metrics", step=step, metrics=metrics)

    @hookimpl
    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._record("on_metrics", "add_metrics", step=step, metrics=metrics)

    @hookimpl
    def on_samples(self, step: int, samples: list[Any]) -> None:
        self._record("on_samples", "add_samples", step=step, samples=samples)

    @hookimpl
    def before_weight_update(self, version: int, protocol: Any) -> None:
        self._weight_update_started = time.time()

    @hookimpl
    def after_weight_update(self, version: int, protocol: Any, report: Any) -> None:
        self._record("after_weight_update", "add_weight_update", report=report, started=self._weight_update_started)

    # -- failures never reach the loop --------------------------------------------------------------------------

    def _record(self, kind: str, method: str, *args: Any, **kwargs: Any) -> None:
        """Call ``store.method`` under :meth:`RateLimitedWarnings.guard`; nothing when the run records nothing."""
        if self.store is not None:
            with self.warnings.guard(kind):
                getattr(self.store, method)(*args, **kwargs)
