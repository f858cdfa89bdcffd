"""The TensorBoard exporter when a run resumes: TensorBoard's reader sees each step once, the resumed run's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard is not installed (pip install -e '.[test]')",
)

from miles_core.builtin.metrics.tensorboard import TensorBoardExporter  # noqa: E402


def write(log_dir: Path, steps: range, *, offset: float, resume_from: int | None = None) -> None:
    exporter = TensorBoardExporter(log_dir=log_dir)
    exporter.start(start_step=steps[0])
    if resume_from is not None:
        exporter.resume(resume_from)
    for step in steps:
        exporter.metrics(step, {"train/loss": offset + step})
    exporter.close()


@pytest.mark.parametrize("from_step", [3, 0])
def test_a_resumed_run_s_event_file_purges_the_steps_it_writes_again(tmp_path: Path, from_step: int) -> None:
    """Steps 0-4 written, then a resumed run from ``from_step`` (3: after checkpoint 2; 0: no checkpoint) writes
    to step 5: the reader keeps the earlier steps of the first file and the rerun's of the second, each once."""
    write(tmp_path, range(5), offset=0.0)
    # Event files are read in the order of their names, which start with the second they were opened in: a resumed
    # run opens its file later than the interrupted one did, so this one must too.
    time.sleep(1.05 - time.time() % 1)
    write(tmp_path, range(from_step, 6), offset=100.0, resume_from=from_step)
    accumulator = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    assert len(list(tmp_path.iterdir())) == 2
    assert [(event.step, event.value) for event in accumulator.Scalars("train/loss")] == [
        (step, (100.0 if step >= from_step else 0.0) + step) for step in range(6)
    ]
