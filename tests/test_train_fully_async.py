"""``miles train --run-schedule fully_async`` as a user runs it: it learns with bounded staleness, partial rollouts
keep every token's weight version, an engine killed mid-stream loses no group, and a resumed run uses no group
twice. A plugin prints what the run's hooks saw; the assertions read it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_train import QUICK, metrics, train

pytestmark = pytest.mark.slow

RECORDER = """\
from miles_core import hookimpl

CONTROLLER = None


@hookimpl
def prepare_rollout(rollout_id, controller):
    global CONTROLLER
    CONTROLLER = controller


@hookimpl
def on_samples(rollout_id, step, samples):
    rows = []
    for s in samples:
        versions = [0 if v is None else v for v, _ in s.segments]
        counts = [n for _, n in s.segments]
        rows.append([s.group, versions, counts, len(s.response_ids), len(s.logprobs), s.finish_reason])
    print("SAMPLES", step, json.dumps(rows), flush=True)
    if CONTROLLER is not None and len(CONTROLLER.cells.cells) > 1:
        print("RESTARTS", step, CONTROLLER.cells.cells["engine-1"].restarts, flush=True)
"""


def recorder(tmp_path: Path) -> Path:
    plugin = tmp_path / "recorder.py"
    plugin.write_text("import json\n" + RECORDER)
    return plugin


def seen(stdout: str, tag: str = "SAMPLES") -> dict[int, list]:
    rows = [line.split(" ", 2) for line in stdout.splitlines() if line.startswith(tag + " ")]
    return {int(step): json.loads(data) for _, step, data in rows}


def test_fully_async_learns_with_staleness_bounded_as_configured(tmp_path: Path) -> None:
    """The embedded default, as the sync learning test runs it (test_train.py::test_default_run_learns)."""
    result = train(
        tmp_path / "run",
        "--no-progress",
        "--num-steps",
        "110",
        "--run-eval-every",
        "0",
        "--run-checkpoint-every",
        "0",
        "--run-schedule",
        "fully_async",
        "--rollout-max-staleness",
        "1",
        "--plugin",
        str(recorder(tmp_path)),
    )
    rows = metrics(tmp_path / "run")
    evals = [row["eval/reward_mean"] for row in rows if "eval/reward_mean" in row]
    assert evals[-1] >= evals[0] + 0.2, evals
    steps = seen(result.stdout)
    assert sorted(steps) == list(range(1, 111))
    for step, samples in steps.items():
        assert len(samples) == 16 * 8
        trainer_version = step - 1  # step N trains the weights published by step N - 1
        assert all(trainer_version - min(versions) <= 1 for _, versions, *_ in samples), step
    lags = [row["rollout/staleness_max"] for row in rows if "train/loss" in row]
    assert max(lags) <= 1 and max(lags) == 1  # it did run ahead of the trainer
    groups = [g for samples in steps.values() for g, *_ in samples[::8]]
    assert len(groups) == len(set(groups)) == 110 * 16


def test_partial_rollouts_keep_each_tokens_weight_version_and_train_with_tis(tmp_path: Path) -> None:
    result = train(
        tmp_path / "run",
        *QUICK,
        "--num-steps",
        "12",
        "--rollout-max-new-tokens",
        "24",
        "--run-schedule",
        "fully_async",
        "--rollout-partial",
        "true",
        "--rollout-mask-off-policy",
        "true",
        "--train-tis-clip",
        "2",
        "--plugin",
        str(recorder(tmp_path)),
    )
    continued = 0
    for step, samples in seen(result.stdout).items():
        assert len(samples) == 16
        for _, versions, counts, tokens, logprobs, finish in samples:
            assert sum(counts) == tokens == logprobs  # every token once, each with the logprob it was sampled with
            assert versions == sorted(set(versions)) and versions[-1] <= step - 1
            assert finish in ("stop", "length")
            continued += len(versions) > 1
    assert continued > 0  # updates landed while requests ran, and those requests continued
    rows = [row for row in metrics(tmp_path / "run") if "train/loss" in row]
    assert sum(row["rollout/continued_samples"] for row in rows) == continued
    assert all(0 < row["train/tis_weight_mean"] <= 2 for row in rows)  # truncated importance sampling ran


def test_an_engine_killed_mid_stream_loses_no_group_and_resume_counts_none_twice(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*QUICK, "--engine-num-engines", "2", "--run-schedule", "fully_async", "--run-checkpoint-every", "2"]
    kill = ["--fault-injection", "kill_engine:engine-1@step=3"]  # as step 3's rollout starts
    first = train(run_dir, *args, "--num-steps", "4", "--plugin", str(recorder(tmp_path)), *kill)
    before = seen(first.stdout)
    assert seen(first.stdout, "RESTARTS")[4] == 1  # engine-1 was killed and brought back
    assert [len(samples) for samples in before.values()] == [16] * 4
    state = json.loads((run_dir / "checkpoints" / "step_000004" / "rollout_stream.json").read_text())
    resumed = train(run_dir, *args, "--num-steps", "7", "--run-resume", "true", "--plugin", str(recorder(tmp_path)))
    after = seen(resumed.stdout)
    assert sorted(after) == [5, 6, 7]
    groups_before = {g for samples in before.values() for g, *_ in samples}
    groups_after = [g for samples in after.values() for g, *_ in samples[::4]]
    assert len(groups_after) == len(set(groups_after)) == 3 * 4
    assert not groups_before & set(groups_after)  # nothing trained on twice
    assert all(g >= state["low"] and g not in state["above"] for g in groups_after)
    assert [row["step"] for row in metrics(run_dir) if "train/loss" in row] == list(range(1, 8))
