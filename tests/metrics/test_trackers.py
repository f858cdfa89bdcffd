"""The experiment trackers (W&B offline, MLflow on a local SQLite store) driven with the calls the loop makes, read
back with each library's own reader: ``wandb leet inspect --json`` and ``MlflowClient``."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("wandb", reason="wandb is not installed (pip install -e '.[test]')")
pytest.importorskip("mlflow", reason="mlflow-skinny is not installed (pip install -e '.[test]')")

from mlflow.tracking import MlflowClient

from miles_core.builtin.metrics.mlflow_tracker import (
    MAX_PARAM_VALUE,
    TRUNCATED,
    MlflowExporter,
    default_tracking_uri,
    mlflow_key,
)
from miles_core.builtin.metrics.plugin import MetricsPlugin
from miles_core.builtin.metrics.wandb_tracker import WandbExporter
from miles_core.config import build_config
from miles_core.errors import MilesError
from miles_core.plugin_manager import MilesPluginManager

WANDB = Path(sys.executable).with_name("wandb")
CONFIG = {"run": {"seed": 3, "output_dir": "runs/x"}, "rollout": {"prompts": "p" * 7000, "extra": None}}
LABELS = {"team": "rl", "baseline": ""}


@pytest.fixture(autouse=True)
def _wandb_offline_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B's settings and caches in the test's directory, never the user's; no network."""
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")


def feed(exporter: object, *, status: str = "finished") -> None:
    """What the loop feeds an exporter over an eval before training and two steps (the second with an eval)."""
    exporter.start(start_step=0)
    exporter.eval(0, {"eval/reward_mean": 0.25, "eval/pass@4": 0.5}, 1.0)
    exporter.metrics(1, {"train/loss": 1.5, "rollout/reward_mean": 0.1, "note": "text is skipped"})
    exporter.eval(2, {"eval/reward_mean": 0.75, "eval/pass@4": 1.0}, 1.0)
    exporter.metrics(2, {"train/loss": math.nan, "rollout/reward_mean": 0.3, "eval/reward_mean": 0.75})
    exporter.close(status=status)


EXPECTED = {
    0: {"eval/reward_mean": 0.25, "eval/pass@4": 0.5},
    1: {"train/loss": 1.5, "rollout/reward_mean": 0.1},
    2: {"eval/reward_mean": 0.75, "eval/pass@4": 1.0, "train/loss": math.nan, "rollout/reward_mean": 0.3},
}


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


# -- W&B -------------------------------------------------------------------------------------------------------


def inspect_wandb(directory: Path, *args: str) -> str:
    run_file = next((directory / "wandb").glob("offline-run-*/run-*.wandb"))
    result = subprocess.run(
        [str(WANDB), "leet", "inspect", "--json", *args, str(run_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return result.stdout


def wandb_history(directory: Path) -> dict[int, dict[str, float]]:
    """Every history row of the offline run: step -> its metrics (W&B writes NaN as the string ``"NaN"``)."""
    rows = [json.loads(line) for line in inspect_wandb(directory).splitlines() if line.strip()]
    return {
        row["history"]["step"].get("num", 0): {
            name: float(value) for name, value in row["history"]["item"].items() if not name.startswith("_")
        }
        for row in rows
        if row["type"] == "history"
    }


def make_wandb(directory: Path) -> WandbExporter:
    return WandbExporter(
        project="miles-test", name="run-a", directory=directory, config=CONFIG, labels=LABELS, mode="offline"
    )


def test_wandb_offline_records_every_step_with_config_and_labels(tmp_path: Path) -> None:
    feed(make_wandb(tmp_path))
    history = wandb_history(tmp_path)
    assert sorted(history) == sorted(EXPECTED)
    for step, expected in EXPECTED.items():
        assert set(history[step]) == set(expected), step
        assert all(same(history[step][name], value) for name, value in expected.items()), (step, history[step])
    summary = json.loads(inspect_wandb(tmp_path, "--summary"))
    assert (summary["name"], summary["project"], summary["exit_code"]) == ("run-a", "miles-test", 0)
    assert summary["tags"] == ["team=rl", "baseline"]
    assert summary["config"]["run"] == CONFIG["run"] and summary["config"]["rollout"]["prompts"] == "p" * 7000


def test_a_stopped_run_is_finished_with_a_failing_exit_code(tmp_path: Path) -> None:
    exporter = make_wandb(tmp_path)
    exporter.start(start_step=3)
    exporter.resume(3)
    exporter.metrics(3, {"train/loss": 2.0})
    exporter.close(status="stopped")
    summary = json.loads(inspect_wandb(tmp_path, "--summary"))
    assert summary["exit_code"] == 1 and summary["config"]["miles_resumed_from_step"] == 3
    assert wandb_history(tmp_path) == {3: {"train/loss": 2.0}}


# -- MLflow ----------------------------------------------------------------------------------------------------


def make_mlflow(tmp_path: Path, uri: str | None = None) -> MlflowExporter:
    return MlflowExporter(
        tracking_uri=uri or default_tracking_uri(tmp_path),
        experiment="miles-test",
        name="run-a",
        config=CONFIG,
        labels=LABELS,
        artifact_dir=tmp_path / "mlartifacts",
    )


def test_mlflow_records_every_step_params_and_tags(tmp_path: Path) -> None:
    exporter = make_mlflow(tmp_path)
    feed(exporter)
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    (run,) = client.search_runs([client.get_experiment_by_name("miles-test").experiment_id])
    history = {}
    for key in run.data.metrics:
        for point in client.get_metric_history(run.info.run_id, key):
            history.setdefault(point.step, {})[key] = point.value
    assert sorted(history) == sorted(EXPECTED)
    for step, expected in EXPECTED.items():  # each metric once per step: the repeated eval ones too
        assert set(history[step]) == {mlflow_key(name) for name in expected}, step
        assert all(same(history[step][mlflow_key(name)], value) for name, value in expected.items())
    assert "eval/pass_at_4" in run.data.metrics
    assert run.data.params["run.seed"] == "3" and run.data.params["rollout.extra"] == "None"
    prompts = run.data.params["rollout.prompts"]
    assert len(prompts) == MAX_PARAM_VALUE and prompts.endswith(TRUNCATED) and prompts.startswith("p" * 5000)
    assert {key: run.data.tags[key] for key in LABELS} == LABELS
    assert (run.info.run_name, run.info.status) == ("run-a", "FINISHED")


def test_mlflow_marks_a_failed_and_a_resumed_run(tmp_path: Path) -> None:
    exporter = make_mlflow(tmp_path)
    exporter.start(start_step=4)
    exporter.resume(4)
    exporter.close(status="failed")
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    (run,) = client.search_runs([client.get_experiment_by_name("miles-test").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["miles.resumed_from_step"] == "4"


def test_an_unreachable_mlflow_server_is_an_error_within_seconds(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port that nothing listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
        exporter = make_mlflow(tmp_path, uri)
        started = time.monotonic()
        with pytest.raises(MilesError, match="the MLflow server does not answer"):
            exporter.start(start_step=0)
    assert time.monotonic() - started < 60  # not MLflow's retries with backoff (minutes)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("eval/pass@4", "eval/pass_at_4"),
        ("a b/c-d.e:f", "a b/c-d.e_f"),
        ("/x/", "x"),
        ("é", "_"),
        ("", "_"),
        ("a//b/./c/../d", "a/b/c/d"),
        ("..", "_"),
        ("x" * 249 + "/y", "x" * 249),
    ],
)
def test_mlflow_keys_keep_only_what_mlflow_allows(name: str, key: str) -> None:
    assert mlflow_key(name) == key
    assert len(mlflow_key("x" * 300)) == 250
    validation = pytest.importorskip("mlflow.utils.validation")
    assert validation.validate_param_and_metric_name(key) and not validation.path_not_unique(key)  # MLflow's checks


# -- the plugin's part -------------------------------------------------------------------------------------------


class Recorder:
    """An exporter that records how it was closed."""

    def __init__(self) -> None:
        self.closed: list[str] = []

    def close(self, status: str = "finished") -> None:
        self.closed.append(status)


@pytest.mark.parametrize(
    ("status", "error", "closed"),
    [
        ("finished", None, "finished"),
        ("failed", "MilesError: no engine is running", "failed"),
        ("failed", "KeyboardInterrupt: stopped by SIGTERM", "stopped"),
    ],
)
def test_a_stop_reaches_the_trackers_as_stopped(status: str, error: str | None, closed: str) -> None:
    plugin, recorder = MetricsPlugin(), Recorder()
    plugin.exporters = {"wandb": recorder}
    plugin.on_run_end(status=status, error=error)
    assert recorder.closed == [closed] and plugin.exporters == {}


def test_a_tracker_that_cannot_start_closes_the_exporters_started_before_it(tmp_path: Path) -> None:
    manager = MilesPluginManager.load()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = build_config(manager, overrides={"metrics.mlflow_tracking_uri": uri})
        plugin, recorder = MetricsPlugin(), Recorder()
        plugin.exporters = {"tensorboard": recorder}
        with pytest.raises(MilesError, match="the MLflow server does not answer"):
            plugin._start_tracker("mlflow", config, tmp_path, 0)
    assert recorder.closed == ["failed"] and plugin.exporters == {}
