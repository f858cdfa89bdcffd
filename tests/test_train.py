"""``miles train`` as a user runs it: the default run learns, resume, schedules, faults, real inputs, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_core.builtin.dashboard.api import DashboardApi
from miles_core.builtin.dashboard.store import db_path
from miles_core.models.hf_checkpoint import TOKENIZER_FILES, tokenizer_files
from miles_core.testkit.tiny_models import save_tiny_llama
from miles_core.testkit.tokenizers import save_char_tokenizer
from tests.conftest import run_miles

pytestmark = pytest.mark.slow
QUICK = ["--no-progress", "--rollout-batch-size", "4", "--rollout-group-size", "4", "--run-eval-every", "0"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(
    run_dir: Path, *args: str, env: dict | None = None, ok: bool = True, cwd: Path | None = None, timeout_s: float = 300
):
    result = run_miles("train", "--output-dir", str(run_dir), *args, env=env, cwd=cwd, timeout_s=timeout_s)
    if ok:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_default_run_learns(tmp_path: Path) -> None:
    """A shortened embedded default run (the full one is `miles train`): held-out reward rises."""
    result = train(
        tmp_path, "--no-progress", "--num-steps", "110", "--run-eval-every", "0", "--run-checkpoint-every", "0"
    )
    assert "miles: torch trainer, model llama/transformers" in result.stdout
    rows = metrics(tmp_path)
    evals = [row["eval/reward_mean"] for row in rows if "eval/reward_mean" in row]
    assert len(evals) == 2  # at the start and at the end
    assert evals[-1] >= evals[0] + 0.2, evals
    assert [row["step"] for row in rows if "train/loss" in row] == list(range(1, 111))
    assert (tmp_path / "checkpoints" / "step_000110" / "model.safetensors").is_file()
    assert all(row["weight_transfer/gb_per_s"] > 0 for row in rows if "train/loss" in row)


def test_model_impl_chooses_what_the_torch_trainer_trains(tmp_path: Path) -> None:
    result = train(tmp_path, *QUICK, "--num-steps", "2", "--model-impl", "llama=minimal")
    assert "miles: torch trainer, model llama/minimal" in result.stdout
    assert [row["step"] for row in metrics(tmp_path) if "train/loss" in row] == [1, 2]


CTRL_C_IN_STEP_4 = """\
import os
import signal

from miles_core import hookimpl

# As Ctrl-C would: a parent that ignores SIGINT (a test runner's worker) passes that on to the run
signal.signal(signal.SIGINT, signal.default_int_handler)


@hookimpl
def on_phase(step, phase):
    if (step, phase) == (4, "train"):  # step 3 is recorded whole, step 4 in part (its rollout and train phases)
        os.kill(os.getpid(), signal.SIGINT)
"""

NOT_COMPARED = ("step", "time", "labels", "weight_transfer/gb_per_s", "weight_transfer/seconds")
"""What differs between two runs of the same steps: wall-clock times and transfer speeds (``time/*`` too)."""

SAME_NUMBERS = {"rel": 1.3e-6, "abs": 1e-5}
"""How close a resumed run's numbers are to an uninterrupted run's. It loads the checkpoint's float32 weights and
Adam moments bit for bit, each step's prompts and sampling seeds depend on the step alone, and the same kernels run
on the same numbers; only the engine's continuous batches may group (and pad) requests differently, which can change
the float32 rounding of the rollout logprobs that the loss takes. Adam's update is a ratio of its moments, so the
two steps after the checkpoint (3 and 4) carry such a difference on at its own relative size: float32's bound, as
``torch.testing.assert_close`` has it and test_torch_trainer's resume test uses it. The tokens (and so the rewards)
are the same: a differently drawn token would need a seeded draw within that rounding of a probability boundary
(about 1e-7 a token). On the development machine the numbers are equal."""


def compared(values: dict) -> dict:
    return {k: v for k, v in values.items() if k not in NOT_COMPARED and not k.startswith("time/")}


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_an_interrupted_run_resumed_records_what_an_uninterrupted_run_does(tmp_path: Path) -> None:
    """Ctrl-C in step 4 (checkpoint 2 the newest), then ``--run-resume true`` with ``--num-steps`` raised from 4 to
    5: the run continues at step 3, and its metrics.jsonl, dashboard and TensorBoard scalars hold each step once,
    equal to those of a run never interrupted; what the interrupted run recorded after step 2 is gone."""
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="tensorboard is not installed (pip install -e '.[test]')",
    )
    args = [*QUICK, "--run-checkpoint-every", "2", "--metrics", "tensorboard"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(whole, *args, "--num-steps", "5")
    plugin = tmp_path / "ctrl_c.py"
    plugin.write_text(CTRL_C_IN_STEP_4)
    interrupted = train(resumed, *args, "--num-steps", "4", "--plugin", str(plugin), ok=False)
    assert interrupted.returncode == 130, interrupted.stderr[-3000:]
    assert checkpoints(resumed) == ["step_000002"]
    abandoned = dashboard(resumed)  # what the resumed run must drop: all of step 3, part of step 4
    assert [row["step"] for row in metrics(resumed)] == [0, 1, 2, 3]
    assert {(p["step"], p["phase"]) for p in abandoned["phases"]} >= {(3, "weight_update"), (4, "train")}
    assert abandoned["weight_updates"] == [1, 2, 3] and ("train/loss", 3) in dict(scalars(event_accumulator, resumed))

    result = train(resumed, *args, "--num-steps", "5", "--run-resume", "true")
    assert (
        "miles: --run-resume true: the earlier run's records of steps 3 and later (1 row of metrics.jsonl) are "
        "dropped: those steps run again" in result.stdout
    )
    assert "step    3" in result.stdout and "step    5" in result.stdout and "step    2" not in result.stdout
    assert checkpoints(resumed) == checkpoints(whole) == ["step_000002", "step_000004", "step_000005"]
    assert json.loads((resumed / "checkpoints" / "step_000005" / "trainer_state.json").read_text())["step"] == 5

    rows, expected_rows = metrics(resumed), metrics(whole)
    assert [row["step"] for row in rows] == [row["step"] for row in expected_rows] == [0, 1, 2, 3, 4, 5]
    for row, expected in zip(rows, expected_rows, strict=True):
        assert row.keys() == expected.keys() and row.get("labels") == expected.get("labels"), row["step"]
        assert compared(row) == pytest.approx(compared(expected), **SAME_NUMBERS), row["step"]

    records, expected_records = dashboard(resumed), dashboard(whole)
    assert records["weight_updates"] == expected_records["weight_updates"] == [1, 2, 3, 4, 5]
    assert sorted(records["phases"], key=str) == sorted(expected_records["phases"], key=str)
    assert [(s["step"], s["num_samples"]) for s in records["steps"]] == [(0, 0)] + [(k, 16) for k in range(1, 6)]
    assert records["steps"] == expected_records["steps"]  # rewards: the same tokens, the same numbers
    series, expected_series = (
        {(name, step): value for name, points in compared(r["series"]).items() for step, value in points}
        for r in (records, expected_records)
    )
    assert series == pytest.approx(expected_series, **SAME_NUMBERS)

    events, expected_events = scalars(event_accumulator, resumed), scalars(event_accumulator, whole)
    keys = [key for key, _ in events]
    assert keys == [key for key, _ in expected_events] and len(keys) == len(set(keys))  # each (tag, step) once
    assert [step for tag, step in keys if tag == "train/loss"] == [1, 2, 3, 4, 5]
    values, expected_values = (
        {key: value for key, value in e if compared({key[0]: 0})} for e in (events, expected_events)
    )
    assert values == pytest.approx(expected_values, **SAME_NUMBERS)


def dashboard(run_dir: Path) -> dict:
    """What the dashboard's API answers about a run: its steps, phases, weight versions and metric series."""
    api = DashboardApi(db_path(run_dir))
    answers = {path: api.answer(f"/api/{path}", {}) for path in ("steps", "phases", "weight_updates", "metrics")}
    assert {status for status, _ in answers.values()} == {200}
    return {
        "steps": answers["steps"][1]["steps"],
        "phases": [{"step": p["step"], "phase": p["phase"]} for p in answers["phases"][1]["phases"]],
        "weight_updates": [update["version"] for update in answers["weight_updates"][1]["weight_updates"]],
        "series": answers["metrics"][1]["series"],
    }


def scalars(event_accumulator, run_dir: Path) -> list[tuple[tuple[str, int], float]]:
    """The run's TensorBoard scalars as TensorBoard reads them (a restart's purged steps left out), by tag and step."""
    accumulator = event_accumulator.EventAccumulator(
        str(run_dir / "tensorboard"), size_guidance={event_accumulator.SCALARS: 0}
    )
    accumulator.Reload()
    return [
        ((tag, event.step), event.value)
        for tag in sorted(accumulator.Tags()["scalars"])
        for event in accumulator.Scalars(tag)
    ]


FAULTS = """\
import contextlib

from miles_core import hookimpl

CONTROLLER = None


@hookimpl
def prepare_rollout(rollout_id, controller):
    global CONTROLLER
    CONTROLLER = controller


PHASES = {}
REGISTRATIONS = []
WRAPPED = []
REPORTS = []


@hookimpl
def weight_update_wrapper(version, protocol):
    @contextlib.contextmanager
    def around():
        yield
        WRAPPED.append(version)  # reached only when the transfer (and its re-sync) succeeded

    return around()


@hookimpl
def after_weight_update(version, protocol, report):
    REPORTS.append((version, report.checksum_ok))


@hookimpl
def on_phase(rollout_id, phase, started, ended):
    assert ended >= started
    PHASES.setdefault(rollout_id, []).append(phase)


@hookimpl
def register_engines(engines):
    REGISTRATIONS.append(sorted(engine.cell_id for engine in engines))


@hookimpl
def on_metrics(rollout_id, metrics):
    print(f"SAMPLES {rollout_id} {int(metrics['rollout/samples'])}", flush=True)
    print(f"PHASES {rollout_id} {' '.join(PHASES[rollout_id])}", flush=True)
    print(f"REGISTRATIONS {len(REGISTRATIONS)}", flush=True)
    print(f"UPDATES {WRAPPED} {REPORTS}", flush=True)
    restarts = {cell_id: cell.restarts for cell_id, cell in CONTROLLER.cells.cells.items()}
    print(f"RESTARTS {rollout_id} {restarts['engine-0']} {restarts['engine-1']}", flush=True)
    print(f"DRIVER_COPY {len(CONTROLLER.published)} {CONTROLLER.published_by_holders}", flush=True)
"""


@pytest.mark.parametrize("mode", ["sharded-disk", "broadcast", "tensor"])
def test_engines_die_mid_rollout_and_mid_update_without_losing_samples(tmp_path: Path, mode: str) -> None:
    """With ``sharded-disk`` (the example plugin's protocol, which sends from the driver) the driver sends and keeps
    a copy for restarted engines; with ``broadcast`` and ``tensor`` the trainer's holder (here the driver's in-process
    one) sends its share, the driver keeps no copy, and a restarted engine gets the published version from what the
    holder kept (its copy, broadcast again; its staged file)."""
    plugin = tmp_path / "faults.py"
    plugin.write_text(FAULTS)
    result = train(
        tmp_path / "run",
        *QUICK,
        "--num-steps",
        "6",
        "--engine-num-engines",
        "2",
        "--run-schedule",
        "one_step_off",
        "--weight-transfer-verify-checksum",
        "true",
        "--weight-transfer-mode",
        mode,
        "--plugin",
        str(plugin),
        # engine-1 dies as step 3's rollout starts (its requests fail mid-rollout), engine-0 as step 4's update does
        "--fault-injection",
        "kill_engine:engine-1@step=3,kill_engine:engine-0@weight_update=4",
    )
    for line in [
        "miles: fault injection: killing engine-1 as step 3's rollout starts",
        "miles: fault injection: killing engine-0 as step 4's weight update starts",
        "miles: engine-1 restarted in",  # the terminal says so, not only the dashboard
        "miles: engine-0 restarted in",
    ]:
        assert line in result.stderr, result.stderr[-3000:]
    samples = [line.split() for line in result.stdout.splitlines() if line.startswith("SAMPLES")]
    assert [(int(step), int(count)) for _, step, count in samples] == [(step, 16) for step in range(6)]
    restarts = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("RESTARTS")]
    assert restarts[-1] == ["5", "1", "1"]  # both engines were killed once and brought back
    phases = [line.split()[2:] for line in result.stdout.splitlines() if line.startswith("PHASES")]
    assert phases[0] == ["rollout", "train", "weight_update"] and phases[-1][-2:] == ["eval", "checkpoint"]
    registrations = [line for line in result.stdout.splitlines() if line.startswith("REGISTRATIONS")]
    assert registrations[-1] == "REGISTRATIONS 3"  # at start, then after each of the two recoveries
    updates = [line for line in result.stdout.splitlines() if line.startswith("UPDATES")][-1]
    expected_reports = [(version, True) for version in range(1, 7)]  # checksums verified on every update
    assert updates == f"UPDATES {list(range(1, 7))} {expected_reports}"
    copy = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("DRIVER_COPY")][-1]
    from_driver = mode == "sharded-disk"
    assert (int(copy[0]) > 0 and copy[1] == "False") if from_driver else (copy == ["0", "True"]), copy
    assert "step    6" in result.stdout


REWARDS = """\
def first_char_reward(*, prompt, response, label, metadata):
    return float(response[:1] == label)

def broken_reward(*, prompt, response, label, metadata):
    raise KeyError("score")
"""


@pytest.fixture
def real_model(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A tiny HF checkpoint with its own tokenizer, a prompt file and a reward module."""
    model_dir = save_tiny_llama(tmp_path / "model", vocab_size=16)
    save_char_tokenizer(model_dir, "abc:0123456")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{c}{d}:", "label": c}) + "\n" for c in "abc" for d in "0123"))
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    return model_dir, prompts, tmp_path


def test_real_use_model_prompts_and_reward(real_model, tmp_path: Path) -> None:
    model_dir, prompts, module_dir = real_model
    train(
        tmp_path / "run",
        *QUICK,
        "--num-steps",
        "3",
        "--model",
        str(model_dir),
        "--prompts",
        str(prompts),
        "--reward",
        "my_rewards:first_char_reward",
        "--update-weight-transfer-mode",
        "broadcast",
        cwd=module_dir,
    )
    rows = metrics(tmp_path / "run")
    assert [row["step"] for row in rows if "train/loss" in row] == [1, 2, 3]


def test_a_reward_that_keeps_raising_stops_the_run_naming_the_sample_and_function(real_model, tmp_path: Path) -> None:
    """A raising reward scores 0 and is counted; ``--rollout-reward-max-consecutive-failures`` in a row stop the
    run, naming the reward and its last error (the first one was printed)."""
    model_dir, prompts, module_dir = real_model
    result = train(
        tmp_path / "run",
        *QUICK,
        "--num-steps",
        "2",
        "--model",
        str(model_dir),
        "--prompts",
        str(prompts),
        "--reward",
        "my_rewards:broken_reward",
        "--rollout-reward-max-consecutive-failures",
        "3",
        cwd=module_dir,
        ok=False,
    )
    assert result.returncode == 2
    # The eval before training scores first: its sample 0 is the file's first prompt.
    first = "miles: reward my_rewards:broken_reward raised KeyError: 'score' on eval sample 0 at step 0 (prompt 'a0:'"
    assert first in result.stdout and "it scores 0" in result.stdout
    assert "reward my_rewards:broken_reward failed 3 times in a row" in result.stderr
    assert "the last: reward my_rewards:broken_reward raised KeyError: 'score' on eval sample 2" in result.stderr
    assert "Traceback" not in result.stderr


WORKING_DIRECTORY_REWARDS = """\
import json


def exact(*, prompt, response, label, metadata):
    with open("responses.jsonl", "a") as out:  # the working directory: what the reward saw, for the test
        out.write(json.dumps(response) + "\\n")
    return response[:1] == label  # a bool: the usual exact-match reward


def not_a_number(*, prompt, response, label, metadata):
    return float("nan")
"""


def test_a_checkpoint_is_a_model_and_a_reward_from_the_working_directory_sees_plain_text(tmp_path: Path) -> None:
    """A new user's path: train, then train on from a checkpoint (its tokenizer is in it) with a reward module
    next to the prompts (not on PYTHONPATH); the reward sees responses without special tokens."""
    first = tmp_path / "first"
    train(first, *QUICK, "--num-steps", "2")
    checkpoint = first / "checkpoints" / "step_000002"
    assert {p.name for p in tokenizer_files(checkpoint)} == {"tokenizer.json", "tokenizer_config.json"}
    work = tmp_path / "work"
    work.mkdir()
    (work / "cwd_rewards.py").write_text(WORKING_DIRECTORY_REWARDS)
    (work / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{n}:", "label": str(n)[-1]}) + "\n" for n in range(73910, 73918))
    )
    result = run_miles(
        "train",
        "--output-dir",
        str(tmp_path / "second"),
        *QUICK,
        "--num-steps",
        "2",
        "--model",
        str(checkpoint),
        "--prompts",
        "prompts.jsonl",
        "--reward",
        "cwd_rewards:exact",
        cwd=work,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [row["step"] for row in metrics(tmp_path / "second") if "train/loss" in row] == [1, 2]
    responses = [json.loads(line) for line in (work / "responses.jsonl").read_text().splitlines()]
    assert len(responses) == 2 * 16 + 2 * 8  # two steps of 4 x 4 samples, two evals of the 8 prompts
    assert not [r for r in responses if any(token in r for token in ("<eos>", "<pad>", "<bos>"))]
    assert any(len(r) < 8 for r in responses)  # some stopped at <eos> (max_new_tokens 8), which they do not show


def test_a_reward_that_is_not_a_finite_number_stops_the_run_naming_sample_and_function(tmp_path: Path) -> None:
    (tmp_path / "cwd_rewards.py").write_text(WORKING_DIRECTORY_REWARDS)
    result = run_miles(
        "train",
        "--output-dir",
        str(tmp_path / "run"),
        *QUICK,
        "--num-steps",
        "2",
        "--reward",
        "cwd_rewards:not_a_number",
        "--rollout-reward-max-consecutive-failures",
        "2",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert (
        "reward cwd_rewards:not_a_number failed 2 times in a row (--rollout-reward-max-consecutive-failures); the "
        "last: reward cwd_rewards:not_a_number returned nan, not a finite number (a reward is a finite int or float, "
        "or a bool) on eval sample 1 at step 0 (prompt '"
    ) in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing_model", "No such file or directory (expected an HF checkpoint directory)"),
        ("corrupt_model", "cannot load"),
        ("bad_jsonl", "prompts.jsonl:2 is not valid JSON"),
        ("no_reward", "--prompts needs --reward"),
        ("unknown_reward_module", "--reward 'no_such_module:fn': no module named 'no_such_module' in the working"),
        ("model_without_tokenizer", "holds no tokenizer files (one of tokenizer.json, tokenizer_config.json"),
    ],
)
def test_bad_input_is_a_clear_error(real_model, tmp_path: Path, setup: str, message: str) -> None:
    model_dir, prompts, _ = real_model
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--reward", "example.keyword"]
    if setup == "missing_model":
        args[1] = str(tmp_path / "nowhere")
    elif setup == "corrupt_model":
        (model_dir / "config.json").write_text("{not json")
    elif setup == "bad_jsonl":
        prompts.write_text('{"prompt": "a1:", "label": "a"}\n{"prompt": oops}\n')
    elif setup == "no_reward":
        args = args[:4]
    elif setup == "unknown_reward_module":
        args[5] = "no_such_module:fn"
    elif setup == "model_without_tokenizer":  # a checkpoint as trainers wrote them before they saved tokenizers
        for name in TOKENIZER_FILES:
            (model_dir / name).unlink(missing_ok=True)
    result = train(tmp_path / "run", *QUICK, "--num-steps", "1", *args, ok=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
    assert "Traceback" not in result.stderr


FAILING_ENGINE = """\
import sys

from miles_core import hookimpl
from miles_core.builtin.local_engine.backend import LocalEngineBackend
from miles_core.registry import Implementation
from miles_core.workers.specs import CommandWorkerSpec


class HalfFailingBackend(LocalEngineBackend):
    def engine_specs(self, config, *, cell_id, model_path):
        if cell_id != "engine-1":
            return super().engine_specs(config, cell_id=cell_id, model_path=model_path)
        # It fails after engine-0 is up, so engine-0 must be stopped by the run, not by a cancelled start.
        argv = [sys.executable, "-c", "import sys, time; time.sleep(20); print('engine-1: out of memory'); sys.exit(3)"]
        return [CommandWorkerSpec(name=cell_id, argv=argv, ports=["port"], health_url="http://{host}:{port}/health")]


@hookimpl
def provide_engine_backends():
    return [Implementation("half-failing", f"{__name__}:HalfFailingBackend")]
"""


def test_an_engine_that_fails_to_start_stops_the_run_and_leaves_no_engine_behind(tmp_path: Path) -> None:
    import psutil

    plugin = tmp_path / "failing_engine.py"
    plugin.write_text(FAILING_ENGINE)
    run_dir = tmp_path / "run"
    result = train(
        run_dir,
        *QUICK,
        "--num-steps",
        "2",
        "--engine-num-engines",
        "2",
        "--engine",
        "half-failing",
        "--plugin",
        str(plugin),
        ok=False,
    )
    assert result.returncode == 2
    assert "worker engine-1 exited while starting" in result.stderr and "engine-1: out of memory" in result.stderr
    leftovers = [p.pid for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []
