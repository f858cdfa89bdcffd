"""``miles train --update-weight-transfer-mode rdt`` on the embedded default learns (engines hosted by Ray). Outside
tests/rdt, so that package's Ray cluster and engines are gone before this run starts its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_core.engines.staging import weight_staging_dir
from tests.test_train import metrics, train

pytestmark = pytest.mark.slow


def test_default_run_learns_over_rdt(tmp_path: Path) -> None:
    """The same shortened default run and learning threshold as the core's test, weights moved by rdt (NIXL)."""
    train(
        tmp_path,
        "--no-progress",
        "--num-steps",
        "110",
        "--run-eval-every",
        "0",
        "--run-checkpoint-every",
        "0",
        "--update-weight-transfer-mode",
        "rdt",
        "--run-worker-provider",
        "ray",
    )
    rows = metrics(tmp_path)
    evals = [row["eval/reward_mean"] for row in rows if "eval/reward_mean" in row]
    assert evals[-1] >= evals[0] + 0.2, evals
    steps = [row for row in rows if "train/loss" in row]
    assert len(steps) == 110 and all(row["weight_transfer/gb_per_s"] > 0 for row in steps)
    assert not list(Path("/dev/shm").glob("miles-rdt-*")), "send buffers left in /dev/shm"
    assert not list(weight_staging_dir().glob("miles-rdt-*")), "staging buckets left in the staging directory"
