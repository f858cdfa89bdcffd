"""The TensorBoard exporter (``--metrics tensorboard``): event files with every metric of the run as scalars.

Written by ``torch.utils.tensorboard.SummaryWriter`` (torch is a dependency of the core already; it needs the
``tensorboard`` package, whose reader also reads the files back) rather than ``tensorboardX``, which would add a
second writer of the same format. One scalar per numeric metric per step, tagged with the metric's name as in
``metrics.jsonl`` (``rollout/reward_mean``: TensorBoard groups the tags by their first part), evals included (the
eval before training at step 0). A scalar is stored as a float32 (``simple_value``), so a value read back is the
metric rounded to float32. The writer flushes after every step and is closed when the run ends.

A resumed run writes a new event file in the same directory that starts by purging the steps it runs again
(``SummaryWriter(purge_step=...)``: a ``SessionLog.START`` event at that step, after which TensorBoard's reader
discards the earlier files' events of that step and later), so every step is read back once.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles_core.builtin.metrics.values import numeric
from miles_core.errors import MilesError

PACKAGE = "tensorboard"
DEFAULT_DIR = "tensorboard"
"""The event files' directory under the run directory, unless ``metrics.tensorboard_dir`` names one."""


class TensorBoardExporter:
    """Writes the run's metrics as TensorBoard scalars in ``log_dir`` (created if missing)."""

    def __init__(self, *, log_dir: Path) -> None:
        try:
            # Deferred: torch.utils.tensorboard imports tensorboard and its protobufs, for runs that ask for it only.
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise MilesError(
                f"metrics.exporters (--metrics) names tensorboard, which needs the package {PACKAGE}: "
                f"pip install {PACKAGE} (or miles-core[metrics]) ({exc})"
            ) from None
        self.log_dir = log_dir
        self._writer_class = SummaryWriter
        self._writer: Any = None  # opened by the first write: a resumed run's purge step must be known by then
        self._purge_step: int | None = None
        self._eval_written: tuple[int, frozenset[str]] | None = None  # the last eval's step and tags

    def start(self, *, start_step: int) -> None:
        """Nothing to do: the event file is opened by the first write."""

    def resume(self, from_step: int) -> None:
        """The run records steps ``from_step`` and later again: its event file purges the earlier ones'."""
        self._purge_step = from_step

    def metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        # on_metrics repeats the eval/ metrics of an eval in this step, which on_eval wrote already: write them once.
        written = self._eval_written[1] if self._eval_written and self._eval_written[0] == step else frozenset()
        self._write(step, {name: value for name, value in numeric(metrics).items() if name not in written})

    def eval(self, step: int, metrics: Mapping[str, Any], seconds: float) -> None:
        values = numeric(metrics)
        self._write(step, values)
        self._eval_written = (step, frozenset(values))

    def phase(self, step: int, phase: str, seconds: float) -> None:
        """Phase durations reach TensorBoard as the ``time/PHASE`` metrics of the step."""

    def weight_update(self, version: int, report: Any) -> None:
        """Weight-update bytes and seconds reach TensorBoard as the ``weight_transfer/`` metrics of the step."""

    def close(self, status: str = "finished") -> None:
        if self._writer is not None:
            self._writer.close()

    def _write(self, step: int, values: Mapping[str, float]) -> None:
        if self._writer is None:
            self._writer = self._writer_class(log_dir=str(self.log_dir), purge_step=self._purge_step)
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()
