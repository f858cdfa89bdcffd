"""``miles train --update-weight-transfer-mode rdt`` on the embedded default (engines hosted by Ray): every version
reaches the engine with its checksum agreeing, and nothing of NIXL's is left behind. Outside tests/rdt, so that
package's Ray cluster and engines are gone before this run starts its own. That runs learn over rdt is shown across
hosts (tests/cluster/test_learning_across_hosts.py): what the weights do to learning does not depend on the protocol
that carried them once every checksum agrees, so this run is a few steps, not the 110 of the learning test."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_core.engines.staging import weight_staging_dir
from tests.cluster.test_learning_across_hosts import weight_updates
from tests.test_train import metrics, train

pytestmark = pytest.mark.slow


def test_the_default_run_over_rdt_delivers_every_version_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """Five steps of the default run, weights moved by rdt (NIXL), each update's checksum verified on the engine."""
    steps = 5
    train(
        tmp_path,
        "--no-progress",
        "--num-steps",
        str(steps),
        "--run-eval-every",
        "0",
        "--run-checkpoint-every",
        "0",
        "--update-weight-transfer-mode",
        "rdt",
        "--weight-transfer-verify-checksum",
        "true",
        "--run-worker-provider",
        "ray",
    )
    rows = [row for row in metrics(tmp_path) if "train/loss" in row]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert all(row["weight_transfer/gb_per_s"] > 0 for row in rows)
    updates, _ = weight_updates(tmp_path)
    assert updates == [(version, 1, 1, "rdt") for version in range(1, steps + 1)]
    assert not list(Path("/dev/shm").glob("miles-rdt-*")), "send buffers left in /dev/shm"
    assert not list(weight_staging_dir().glob("miles-rdt-*")), "staging buckets left in the staging directory"
