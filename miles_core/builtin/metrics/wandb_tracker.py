"""The Weights & Biases exporter (``--metrics wandb``): one W&B run per ``miles train``, with the config, the labels
as tags and every metric at its step.

``--metrics-wandb-mode offline`` (or ``WANDB_MODE=offline``) writes the run under ``RUN_DIR/wandb/`` with no network;
``wandb sync`` uploads it later and ``wandb leet inspect --json`` reads it back. The eval's metrics and the step's
other metrics reach the same history row (W&B merges what is logged at one step). The run is finished when the
``miles`` run ends: exit code 0 when it finished, 1 when it failed or was stopped.

A resumed run (``--run-resume true``) is a new W&B run with the same name, grouped with the interrupted one (the
group is the run name), whose history starts at the first step it runs again; its config says
``miles_resumed_from_step``. W&B cannot drop steps from a run's history, so the steps the interrupted run logged
after its checkpoint stay in that run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles_core.builtin.metrics.config import wandb_tag
from miles_core.builtin.metrics.values import numeric
from miles_core.errors import MilesError

PACKAGE = "wandb"
INIT_TIMEOUT_S = 90.0
"""How long ``wandb.init`` may take before the run fails with W&B's error (online: reaching the server)."""


class WandbExporter:
    """A W&B run for the metrics of one ``miles`` run; opened by :meth:`start`, finished by :meth:`close`."""

    def __init__(
        self,
        *,
        project: str,
        name: str,
        directory: Path,
        config: Mapping[str, Any],
        labels: Mapping[str, str],
        entity: str | None = None,
        mode: str | None = None,
    ) -> None:
        try:
            import wandb  # deferred: an optional dependency, imported by runs that ask for it only
        except ImportError as exc:
            raise MilesError(
                f"metrics.exporters (--metrics) names wandb, which needs the package {PACKAGE}: pip install "
                f"{PACKAGE} (or miles-core[wandb]) ({exc})"
            ) from None
        self._wandb = wandb
        self._init = {
            "project": project,
            "entity": entity,
            "name": name,
            "group": name,
            "dir": str(directory),
            "config": dict(config),
            "tags": [wandb_tag(key, value) for key, value in labels.items()],
            "settings": wandb.Settings(init_timeout=INIT_TIMEOUT_S, silent=True),
            **({"mode": mode} if mode is not None else {}),
        }
        self.run: Any = None

    def start(self, *, start_step: int) -> None:
        """Open the W&B run (``dir`` is created if missing); W&B's own error when it cannot."""
        Path(self._init["dir"]).mkdir(parents=True, exist_ok=True)
        self.run = self._wandb.init(**self._init)

    def resume(self, from_step: int) -> None:
        """This W&B run's history starts at ``from_step``: the config says so."""
        self.run.config.update({"miles_resumed_from_step": from_step}, allow_val_change=True)

    def metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log(numeric(metrics), step=step)

    def eval(self, step: int, metrics: Mapping[str, Any], seconds: float) -> None:
        self.run.log(numeric(metrics), step=step)

    def phase(self, step: int, phase: str, seconds: float) -> None:
        """Phase durations reach W&B as the ``time/PHASE`` metrics of the step."""

    def weight_update(self, version: int, report: Any) -> None:
        """Weight-update bytes and seconds reach W&B as the ``weight_transfer/`` metrics of the step."""

    def close(self, status: str = "finished") -> None:
        """Finish the W&B run: exit code 0 for a finished run, 1 for a failed or stopped one."""
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "finished" else 1)
            self.run = None
