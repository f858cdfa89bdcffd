"""What a run shows and writes: a progress bar, a line per step, metrics as JSON lines, a final table."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from miles_core.errors import MilesError

SUMMARY_FIELDS = (
    ("reward", "rollout/reward_mean", ".3f", ""),
    ("loss", "train/loss", "+.4f", ""),
    ("entropy", "train/entropy", ".3f", ""),
    ("step", "time/step", ".2f", "s"),
    ("eval", "eval/reward_mean", ".3f", ""),
)
"""The step line: label, metric, format, unit; a metric the step did not report is left out."""

METRICS_FILE = "metrics.jsonl"
"""The run's rows, one JSON object a line, in the run directory."""


class RunReporter:
    def __init__(self, run_dir: Path, *, total_steps: int, start_step: int, enabled: bool = True) -> None:
        self.metrics_file = run_dir / METRICS_FILE
        self.rows: list[dict[str, Any]] = []
        self.bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc="steps",
            unit="step",
            file=sys.stderr,
            disable=not enabled,
            dynamic_ncols=True,
        )
        self.started = time.monotonic()

    def step(self, step: int, metrics: dict[str, float], *, labels: dict[str, str] | None = None) -> None:
        """Record one step: a JSON line, a summary line, the progress bar. ``labels`` are the step's facts that are
        not numbers (the weight-transfer protocol that ran, ``auto/tensor``): kept in the JSON line under
        ``"labels"``, apart from the numbers the metrics exporters take."""
        row = {"step": step, "time": round(time.monotonic() - self.started, 3), **metrics}
        if labels:
            row["labels"] = labels
        self.rows.append(row)
        with open(self.metrics_file, "a") as out:
            out.write(json.dumps(row) + "\n")
        fields = [f"{label} {metrics[key]:{spec}}{unit}" for label, key, spec, unit in SUMMARY_FIELDS if key in metrics]
        summary = "  ".join([f"step {step:4d}", *fields])  # a trainer reports its own set of metrics
        self.bar.write(summary)
        self.bar.set_postfix(reward=f"{metrics.get('rollout/reward_mean', 0):.3f}")
        self.bar.update(1)

    def eval(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": round(time.monotonic() - self.started, 3), **metrics}
        self.rows.append(row)
        with open(self.metrics_file, "a") as out:
            out.write(json.dumps(row) + "\n")
        at_k = "".join(f", {name[5:]} {value:.3f}" for name, value in metrics.items() if name.startswith("eval/pass@"))
        self.bar.write(f"eval at step {step}: reward {metrics['eval/reward_mean']:.3f}{at_k}")

    def close(self) -> None:
        self.bar.close()

    def final_table(self) -> str:
        """Steps with an eval, and the last step: reward, eval reward, loss, KL, entropy, step time."""
        header = ("step", "reward", "eval", "loss", "kl", "entropy", "step s")
        keys = ("rollout/reward_mean", "eval/reward_mean", "train/loss", "train/kl", "train/entropy", "time/step")
        merged: dict[int, dict[str, Any]] = {}
        for row in self.rows:
            merged.setdefault(row["step"], {}).update(row)
        shown = [r for r in merged.values() if "eval/reward_mean" in r] or list(merged.values())[-1:]
        lines = ["  ".join(f"{h:>8s}" for h in header)]
        for row in shown:
            cells = [f"{row['step']:8d}"] + [f"{row[k]:8.3f}" if k in row else f"{'-':>8s}" for k in keys]
            lines.append("  ".join(cells))
        return "\n".join(lines)


def drop_rows_from(path: Path, *, from_step: int) -> int:
    """Drop the rows of steps ``from_step`` and later from the metrics file ``path`` (a resumed run records them
    again; see the ``on_run_resume`` hook), and a last line that a killed run left unfinished; every other line is
    kept as it was. Returns how many rows were dropped; a missing file is left missing.

    The file is rewritten atomically (a new file beside it, synced, then renamed over it): a crash at any moment
    leaves either the old file or the new one, never a mix or an empty file. It is read twice, line by line, rather
    than held in memory: a long run's file is large, and most resumes (after a checkpoint at the end) drop nothing."""
    what = f"--run-resume true: the rows of the steps that run again cannot be dropped from {str(path)!r}"
    if not os.path.lexists(path):
        return 0
    if not path.is_file():  # a FIFO would block the read
        raise MilesError(f"{what}: it is not a regular file (a directory, FIFO or device); move it aside")
    path = path.resolve()  # a link to the rows: they are rewritten where it points, as the run appends them there
    rewritten = path.with_name(f".{path.name}.rewrite")  # a name of its own: one run writes a run directory
    try:
        with open(path, "rb") as lines:
            if all(_kept(line, from_step) == line for line in lines):
                return 0
        dropped = 0
        with open(path, "rb") as lines, open(rewritten, "wb") as out:
            for line in lines:
                kept = _kept(line, from_step)
                out.write(kept)
                if not kept and _row_step(line) is not None:
                    dropped += 1
            out.flush()
            os.fsync(out.fileno())
        os.replace(rewritten, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a power loss
        finally:
            os.close(directory)
    except OSError as exc:
        raise MilesError(f"{what}: {exc.strerror or exc}; make it a file you can write") from exc
    return dropped


def _kept(line: bytes, from_step: int) -> bytes:
    """What of a line of the metrics file stays when steps ``from_step`` and later go (``b""``: nothing)."""
    step = _row_step(line)
    if step is not None and step >= from_step:
        return b""
    if line.endswith(b"\n"):
        return line  # a row of an earlier step, or a line that is no row: kept as it is
    # The last line, without its newline: a whole row gets one (the next row must not join it); the unfinished
    # line of a killed run, which no reader can parse, goes.
    return line + b"\n" if step is not None else b""


def _row_step(line: bytes) -> int | None:
    """The ``step`` of a metrics row, or ``None`` for a line that is not one."""
    try:
        row = json.loads(line)
    except ValueError:  # UnicodeDecodeError included
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None
