"""The dashboard's JSON API over real HTTP: an empty run, a running run, a finished run, unknown steps, repeated
sample indices, bad input; and the recording side: a failing dashboard never stops training, a killed run keeps
what it recorded."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from miles_core.builtin.dashboard.plugin import DashboardPlugin
from miles_core.builtin.dashboard.store import DashboardStore
from miles_core.events import EngineInfo, EngineWorker, RouterInfo, TrainerInfo
from miles_core.weight_transfer.protocol import TransferReport
from tests.dashboard.conftest import RUN_STEPS, FinishedRun, get_json

ENGINE = EngineInfo(
    cell_id="engine-0",
    server_id="engine",
    index=0,
    state="running",
    restarts=0,
    last_error=None,
    workers=(EngineWorker(name="engine-0", url="http://127.0.0.1:1", pid=1, node="127.0.0.1"),),
    weight_version=0,
)


def sample(index: int, response: str, reward: float = 0.5) -> dict:
    return {
        "index": index,
        "prompt": {"text": f"prompt {index}", "label": "7", "metadata": {}},
        "response": response,
        "reward": reward,
        "response_ids": [1, 2],
    }


def test_empty_run(tmp_path: Path, serve) -> None:
    DashboardStore(tmp_path).close()  # the database exists; nothing recorded yet
    url = serve(tmp_path)
    assert get_json(url + "api/run")[1] | {"config": None} == {
        "status": "empty",
        "run_dir": None,
        "started": None,
        "ended": None,
        "error": None,
        "num_steps": None,
        "start_step": None,
        "steps_recorded": 0,
        "last_step": None,
        "config": None,
    }
    assert get_json(url + "api/topology") == (200, {"engines": [], "routers": [], "trainer": None})
    assert get_json(url + "api/metrics") == (200, {"series": {}})
    assert get_json(url + "api/phases") == (200, {"phases": []})
    assert get_json(url + "api/steps") == (200, {"steps": []})
    assert get_json(url + "api/weight_updates") == (200, {"weight_updates": []})
    assert get_json(url + "api/steps/0") == (404, {"error": "step 0 is not recorded (steps recorded: none yet)"})


def test_running_run(recording_run, serve) -> None:
    """Events are stored under the step the terminal and metrics.jsonl show (rollout_id + 1); the eval before
    training is step 0; an eval within a step is recorded once."""
    run_dir, hooks = recording_run
    hooks.register_trainer(trainer=TrainerInfo(backend="torch", implementation="llama/transformers", ranks=("driver",)))
    hooks.register_router(router=RouterInfo(name="router", url="http://127.0.0.1:2", pid=2))
    failed = dataclasses.replace(ENGINE, cell_id="engine-1", state="failed")
    hooks.register_engines(engines=[ENGINE, failed])
    hooks.on_eval(step=0, metrics={"eval/reward_mean": 0.125}, started=99.0, ended=100.0)  # before training
    hooks.on_phase(rollout_id=0, step=1, phase="rollout", started=100.0, ended=101.5)
    hooks.on_samples(rollout_id=0, step=1, samples=[sample(0, "77"), sample(1, "12", reward=0.0)])
    hooks.on_phase(rollout_id=0, step=1, phase="train", started=101.5, ended=102.0)
    hooks.before_weight_update(version=1, protocol=None)
    hooks.after_weight_update(version=1, protocol=None, report=TransferReport("tensor", 1, 2_000_000, 0.001, 1))
    hooks.on_phase(rollout_id=0, step=1, phase="eval", started=102.0, ended=102.25)
    hooks.on_eval(step=1, metrics={"eval/reward_mean": 0.5}, started=102.0, ended=102.25)
    hooks.on_metrics(
        rollout_id=0,
        step=1,
        metrics={"rollout/reward_mean": 0.25, "train/loss": float("nan"), "bad": "x", "eval/reward_mean": 0.5},
    )
    hooks.on_phase(rollout_id=1, step=2, phase="rollout", started=103.0, ended=104.0)  # step 2: no samples yet
    url = serve(run_dir)

    status, run = get_json(url + "api/run")
    assert (status, run["status"], run["steps_recorded"], run["last_step"], run["num_steps"]) == (
        200,
        "running",
        3,
        2,
        4,
    )
    assert run["config"]["run"]["output_dir"] == str(run_dir)
    topology = get_json(url + "api/topology")[1]
    assert [(e["cell_id"], e["state"], e["weight_version"]) for e in topology["engines"]] == [
        ("engine-0", "running", 1),
        ("engine-1", "failed", 0),
    ]  # the failed engine did not get version 1
    assert topology["routers"] == [{"name": "router", "url": "http://127.0.0.1:2", "pid": 2}]
    assert topology["trainer"]["ranks"] == ["driver"]
    assert get_json(url + "api/metrics")[1]["series"] == {
        "bad": [[1, None]],
        "eval/reward_mean": [[0, 0.125], [1, 0.5]],
        "rollout/reward_mean": [[1, 0.25]],
        "train/loss": [[1, None]],
    }
    assert [(p["step"], p["phase"], p["seconds"]) for p in get_json(url + "api/phases")[1]["phases"]] == [
        (0, "eval", 1.0),
        (1, "rollout", 1.5),
        (1, "train", 0.5),
        (1, "eval", 0.25),  # once, though both on_phase and on_eval reported it
        (2, "rollout", 1.0),
    ]
    update = get_json(url + "api/weight_updates")[1]["weight_updates"][0]
    assert (update["version"], update["gb_per_s"], update["num_bytes"]) == (1, 2.0, 2_000_000)
    assert get_json(url + "api/steps")[1]["steps"] == [
        {"step": 0, "num_samples": 0, "reward_mean": None},
        {"step": 1, "num_samples": 2, "reward_mean": 0.25},
        {"step": 2, "num_samples": 0, "reward_mean": None},
    ]
    assert get_json(url + "api/steps/0")[1]["metrics"] == {"eval/reward_mean": 0.125}
    # A step with no samples yet: an empty list, not an error.
    assert get_json(url + "api/steps/2/samples")[1] | {"samples": None} == {
        "step": 2,
        "total": 0,
        "offset": 0,
        "limit": 100,
        "samples": None,
    }
    assert get_json(url + "api/steps/2/samples")[1]["samples"] == []
    hooks.register_engines(engines=[])  # the engines stop: they keep their description, marked stopped
    assert [e["state"] for e in get_json(url + "api/topology")[1]["engines"]] == ["stopped", "stopped"]


@pytest.mark.slow
def test_finished_run(finished_run: FinishedRun, serve) -> None:
    assert finished_run.live_run["status"] == "running"  # what `miles train --dashboard` served during the run
    assert finished_run.live_url.startswith("http://127.0.0.1:")
    assert "serves it again" in finished_run.stdout  # the live server stopped with the run, saying how to reopen
    url = serve(finished_run.run_dir)
    run = get_json(url + "api/run")[1]
    assert (run["status"], run["steps_recorded"], run["last_step"], run["error"]) == (
        "finished",
        RUN_STEPS + 1,
        RUN_STEPS,
        None,
    )
    assert run["ended"] > run["started"]
    series = get_json(url + "api/metrics")[1]["series"]
    for name in (
        "rollout/reward_mean",
        "train/loss",
        "train/kl",
        "train/entropy",
        "time/step",
        "time/rollout",
        "weight_transfer/gb_per_s",
    ):
        assert [step for step, _ in series[name]] == list(range(1, RUN_STEPS + 1)), name
    assert [step for step, _ in series["eval/reward_mean"]] == [0, RUN_STEPS]  # before training, and at the end
    assert all(value > 0 for _, value in series["weight_transfer/gb_per_s"])
    topology = get_json(url + "api/topology")[1]
    assert [(e["cell_id"], e["state"], e["weight_version"]) for e in topology["engines"]] == [
        ("engine-0", "stopped", RUN_STEPS)
    ]
    assert topology["trainer"] == {"backend": "torch", "implementation": "llama/transformers", "ranks": ["driver"]}
    phases = get_json(url + "api/phases")[1]["phases"]
    assert [p["phase"] for p in phases if p["step"] == 0] == ["eval"]
    assert [p["phase"] for p in phases if p["step"] == 1] == ["rollout", "train", "weight_update"]
    assert [p["phase"] for p in phases if p["step"] == RUN_STEPS][-2:] == ["eval", "checkpoint"]
    assert [u["version"] for u in get_json(url + "api/weight_updates")[1]["weight_updates"]] == [1, 2, 3]
    samples = get_json(url + "api/steps/1/samples")[1]
    assert samples["total"] == 16  # 4 prompts x 4 samples
    assert [(s["sample_index"], s["occurrence"]) for s in samples["samples"]] == [(i, 0) for i in range(16)]
    one = get_json(url + "api/steps/1/samples/5/0")[1]
    assert one["response"] == samples["samples"][5]["response"]
    assert one["data"]["engine"] == "engine-0" and len(one["data"]["response_ids"]) == len(one["data"]["logprobs"])


@pytest.mark.slow
def test_one_step_numbering_in_the_terminal_metrics_jsonl_checkpoints_and_dashboard(
    finished_run: FinishedRun, serve
) -> None:
    """The terminal's step N is metrics.jsonl's step N, the checkpoint step_N and the dashboard's /api/steps/N."""
    url = serve(finished_run.run_dir)
    terminal = dict(re.findall(r"^step +(\d+) +reward (\d\.\d{3})", finished_run.stdout, flags=re.MULTILINE))
    assert sorted(map(int, terminal)) == list(range(1, RUN_STEPS + 1)), finished_run.stdout
    rows = [json.loads(line) for line in (finished_run.run_dir / "metrics.jsonl").read_text().splitlines()]
    protocols = {u["version"]: u["protocol"] for u in get_json(url + "api/weight_updates")[1]["weight_updates"]}
    for row in rows:
        recorded = get_json(url + f"api/steps/{row['step']}")[1]["metrics"]
        if "train/loss" in row:  # the protocol of the step's update, as the dashboard recorded it
            assert row["labels"] == {"weight_transfer/protocol": protocols[row["step"]]}
        for name, value in row.items():
            if name not in ("step", "time", "labels"):
                assert recorded[name] == pytest.approx(value, rel=1e-12), (row["step"], name)
        if "train/loss" in row:
            step = get_json(url + "api/steps")[1]["steps"][row["step"]]
            assert f"{step['reward_mean']:.3f}" == f"{row['rollout/reward_mean']:.3f}" == terminal[str(row["step"])]
    initial = get_json(url + "api/steps/0")[1]
    assert (initial["num_samples"], [p["phase"] for p in initial["phases"]]) == (0, ["eval"])
    assert initial["metrics"]["eval/reward_mean"] == rows[0]["eval/reward_mean"] and rows[0]["step"] == 0
    assert f"eval at step 0: reward {rows[0]['eval/reward_mean']:.3f}" in finished_run.stdout
    checkpoints = sorted(p.name for p in (finished_run.run_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step_{RUN_STEPS:06d}"]
    state = json.loads((finished_run.run_dir / "checkpoints" / checkpoints[0] / "trainer_state.json").read_text())
    assert state["step"] == RUN_STEPS == get_json(url + "api/run")[1]["last_step"]


@pytest.mark.slow
def test_unknown_steps_and_samples_are_404(finished_run: FinishedRun, serve) -> None:
    url = serve(finished_run.run_dir)
    unknown = RUN_STEPS + 1
    for path in (f"api/steps/{unknown}", f"api/steps/{unknown}/samples", "api/steps/999999/samples/0/0"):
        assert get_json(url + path) == (
            404,
            {"error": f"step {path.split('/')[2]} is not recorded (steps recorded: 0..{RUN_STEPS})"},
        )
    assert get_json(url + "api/steps/1/samples/16/0") == (
        404,
        {"error": "step 1 has no sample (16, 0) (sample_index, occurrence)"},
    )
    assert get_json(url + "api/steps/1/samples/0/1")[0] == 404
    assert get_json(url + "api/steps/0/samples/0/0")[0] == 404  # the eval before training keeps no samples


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("api/steps/-1", 400, "step must be a non-negative integer, got '-1'"),
        ("api/steps/abc/samples", 400, "step must be a non-negative integer, got 'abc'"),
        ("api/steps/1e3", 400, "step must be a non-negative integer"),
        ("api/steps/" + "9" * 5000, 400, "step must be a non-negative integer"),
        ("api/steps/0/samples?limit=0", 400, "query parameter limit must be an integer >= 1 and <= 1000, got '0'"),
        ("api/steps/0/samples?limit=100000", 400, "query parameter limit must be an integer >= 1 and <= 1000"),
        ("api/steps/0/samples?offset=-3", 400, "query parameter offset must be an integer >= 0, got '-3'"),
        ("api/steps/0/samples?offset=%00", 400, "query parameter offset must be an integer >= 0"),
        ("api/steps/0/samples/x/0", 400, "sample index must be a non-negative integer, got 'x'"),
        ("api/steps/0/samples/0/-1", 400, "occurrence must be a non-negative integer, got '-1'"),
        ("api/nothing", 404, "no API route '/api/nothing'"),
        ("static/../store.py", 404, "no such page"),
        ("static/%2e%2e/store.py", 404, "no such page"),
        ("samples/0/1", 404, "no such page"),
        ("etc/passwd", 404, "no such page"),
    ],
)
def test_bad_requests_answer_json_errors(tmp_path: Path, serve, path: str, status: int, message: str) -> None:
    store = DashboardStore(tmp_path)
    store.add_samples(step=0, samples=[sample(0, "a")])
    store.close()
    response = httpx.get(serve(tmp_path) + path, timeout=30)
    assert (response.status_code, response.headers["content-type"]) == (status, "application/json")
    assert message in response.json()["error"]


def test_repeated_sample_indices_stay_apart(recording_run, serve) -> None:
    run_dir, hooks = recording_run
    hooks.on_samples(
        rollout_id=2, step=3, samples=[sample(0, "first"), sample(0, "second"), sample(1, "other"), sample(0, "third")]
    )
    hooks.on_samples(rollout_id=2, step=3, samples=[sample(0, "resent")])  # a second call for the same step
    hooks.on_samples(rollout_id=3, step=4, samples=[sample(0, "next step")])  # occurrences count per step
    url = serve(run_dir)
    listed = get_json(url + "api/steps/3/samples")[1]["samples"]
    assert [(s["sample_index"], s["occurrence"], s["response"]) for s in listed] == [
        (0, 0, "first"),
        (0, 1, "second"),
        (0, 2, "third"),
        (0, 3, "resent"),
        (1, 0, "other"),
    ]
    for index, occurrence, response in [(0, 1, "second"), (0, 3, "resent"), (1, 0, "other")]:
        assert get_json(url + f"api/steps/3/samples/{index}/{occurrence}")[1]["response"] == response
    assert get_json(url + "api/steps/4/samples/0/0")[1]["response"] == "next step"
    page = get_json(url + "api/steps/3/samples?offset=1&limit=2")[1]
    assert (page["total"], [s["response"] for s in page["samples"]]) == (5, ["second", "third"])


def record_step(hooks, step: int, response: str) -> None:
    """What a training step records: its phases, samples, weight update and metrics."""
    hooks.on_phase(rollout_id=step - 1, step=step, phase="rollout", started=float(step), ended=step + 0.5)
    hooks.on_samples(rollout_id=step - 1, step=step, samples=[sample(0, response), sample(1, response)])
    hooks.before_weight_update(version=step, protocol=None)
    hooks.after_weight_update(version=step, protocol=None, report=TransferReport("tensor", step, 8, 0.001, 1))
    hooks.on_metrics(rollout_id=step - 1, step=step, metrics={"train/loss": float(step)})


@pytest.mark.parametrize("from_step", [3, 0])
def test_a_resumed_run_drops_the_steps_it_runs_again(recording_run, serve, from_step: int) -> None:
    """``on_run_resume``: the steps from ``from_step`` on (the interrupted run's, after its checkpoint; every step,
    the eval before training too, when there was no checkpoint) are deleted, so the rerun records each once."""
    run_dir, hooks = recording_run
    hooks.on_eval(step=0, metrics={"eval/reward_mean": 0.0}, started=0.0, ended=1.0)
    for step in range(1, 5):
        record_step(hooks, step, "abandoned" if step >= from_step else "kept")
    hooks.on_phase(rollout_id=4, step=5, phase="rollout", started=5.0, ended=5.5)  # a step cut short
    hooks.on_run_resume(run_dir=run_dir, from_step=from_step)
    if from_step == 0:
        hooks.on_eval(step=0, metrics={"eval/reward_mean": 0.0}, started=0.0, ended=1.0)
    for step in range(max(from_step, 1), 6):
        record_step(hooks, step, "again")
    url = serve(run_dir)
    assert [(s["step"], s["num_samples"]) for s in get_json(url + "api/steps")[1]["steps"]] == [(0, 0)] + [
        (step, 2) for step in range(1, 6)
    ]
    assert [u["version"] for u in get_json(url + "api/weight_updates")[1]["weight_updates"]] == [1, 2, 3, 4, 5]
    phases = [(p["step"], p["phase"]) for p in get_json(url + "api/phases")[1]["phases"]]
    assert phases == [(0, "eval")] + [(step, "rollout") for step in range(1, 6)]
    assert get_json(url + "api/metrics")[1]["series"]["train/loss"] == [[step, float(step)] for step in range(1, 6)]
    for step in range(1, 6):
        samples = get_json(url + f"api/steps/{step}/samples")[1]["samples"]
        expected = "again" if step >= from_step else "kept"
        assert [(s["sample_index"], s["occurrence"], s["response"]) for s in samples] == [
            (0, 0, expected),
            (1, 0, expected),
        ]


def test_a_failing_dashboard_never_stops_training(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    plugin = DashboardPlugin()
    plugin.store = DashboardStore(tmp_path)
    plugin.store.close()  # every write now raises sqlite3.ProgrammingError
    with caplog.at_level(logging.WARNING, logger="miles.dashboard"):
        for step in range(5):
            plugin.on_phase(step=step, phase="rollout", started=0.0, ended=1.0)
            plugin.on_samples(step=step, samples=[object()])
        plugin.on_run_end(status="finished", error=None)
    warnings = [r.getMessage() for r in caplog.records]
    assert len([w for w in warnings if w.startswith("dashboard: on_phase failed: ProgrammingError")]) == 1
    assert len([w for w in warnings if w.startswith("dashboard: on_samples failed")]) == 1  # rate-limited
    assert all(w.endswith("training goes on") for w in warnings)
    assert plugin.warnings.held_back == {"on_phase": 4, "on_samples": 4}


def test_a_killed_run_keeps_what_it_recorded(tmp_path: Path, serve) -> None:
    script = (
        "import os, signal; from miles_core.builtin.dashboard.store import DashboardStore; "
        f"s = DashboardStore({str(tmp_path)!r}); "
        f"s.run_started(run_dir={str(tmp_path)!r}, start_step=0, num_steps=9, config={{}}); "
        "s.add_metrics(step=0, metrics={'train/loss': 1.5}); os.kill(os.getpid(), signal.SIGKILL)"
    )
    assert subprocess.run([sys.executable, "-c", script], check=False).returncode == -9
    url = serve(tmp_path)
    assert get_json(url + "api/run")[1]["status"] == "interrupted"  # recorded as running; its process is gone
    assert get_json(url + "api/metrics")[1]["series"] == {"train/loss": [[0, 1.5]]}
