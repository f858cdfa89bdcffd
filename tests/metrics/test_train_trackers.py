"""``miles train --metrics wandb,mlflow`` as a user runs it (W&B offline, MLflow in the run directory): both trackers
hold every metric of ``metrics.jsonl`` at its step; an unreachable MLflow server stops the run at its start."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import pytest

pytest.importorskip("wandb", reason="wandb is not installed (pip install -e '.[test]')")
pytest.importorskip("mlflow", reason="mlflow-skinny is not installed (pip install -e '.[test]')")

from mlflow.tracking import MlflowClient

from miles_core.builtin.metrics.mlflow_tracker import default_tracking_uri, mlflow_key
from tests.metrics.test_trackers import inspect_wandb, same, wandb_history
from tests.test_train import QUICK, metrics, train

pytestmark = pytest.mark.slow


def wandb_env(tmp_path: Path) -> dict[str, str]:
    """W&B's settings and caches in the test's directory, never the user's."""
    home = str(tmp_path / "wandb-home")
    return {name: home for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR")}


def expected_rows(run_dir: Path) -> dict[int, dict[str, float]]:
    return {
        row["step"]: {name: float(value) for name, value in row.items() if name not in ("step", "time", "labels")}
        for row in metrics(run_dir)
    }


def test_both_trackers_record_every_metric_of_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["--num-steps", "2", "--metrics", "wandb,mlflow", "--metrics-wandb-mode", "offline"]
    labels = ["--metrics-labels", "{team: rl, smoke: ''}", "--metrics-wandb-project", "miles-ci"]
    result = train(run_dir, *QUICK, *args, *labels, env=wandb_env(tmp_path))
    rows = expected_rows(run_dir)
    assert sorted(rows) == [0, 1, 2]
    assert f"miles: MLflow run 'run' in experiment 'miles' at {default_tracking_uri(run_dir)}" in result.stdout

    history = wandb_history(run_dir)
    assert sorted(history) == sorted(rows)
    for step, row in rows.items():
        assert set(history[step]) == set(row), step
        assert all(same(history[step][name], value) for name, value in row.items()), step
    summary = json.loads(inspect_wandb(run_dir, "--summary"))
    assert (summary["name"], summary["project"], summary["exit_code"]) == ("run", "miles-ci", 0)
    assert summary["tags"] == ["team=rl", "smoke"] and summary["config"]["run"]["num_steps"] == 2

    client = MlflowClient(tracking_uri=default_tracking_uri(run_dir))
    (run,) = client.search_runs([client.get_experiment_by_name("miles").experiment_id])
    assert (run.info.run_name, run.info.status) == ("run", "FINISHED")
    assert run.data.params["run.num_steps"] == "2" and run.data.tags["team"] == "rl"
    logged = {}
    for key in run.data.metrics:
        for point in client.get_metric_history(run.info.run_id, key):
            assert (point.step, key) not in logged, (point.step, key)  # each metric once per step
            logged[(point.step, key)] = point.value
    expected = {(step, mlflow_key(name)): value for step, row in rows.items() for name, value in row.items()}
    assert set(logged) == set(expected)
    assert all(same(logged[key], value) for key, value in expected.items())  # MLflow stores a float64
    assert not math.isnan(logged[(0, "eval/reward_mean")])


def test_an_unreachable_mlflow_server_stops_the_run_at_its_start(tmp_path: Path) -> None:
    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
        result = train(tmp_path / "run", *QUICK, "--metrics", "mlflow", "--metrics-mlflow-tracking-uri", uri, ok=False)
    assert result.returncode != 0
    assert f"metrics.mlflow_tracking_uri (--metrics-mlflow-tracking-uri) = {uri}: the MLflow server does not " in (
        result.stderr
    )
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step ran
