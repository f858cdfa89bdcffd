"""Hostile input to the entry points that are not HTTP: prompt files, model directories, plugin files, the
environment, rewards, ``--run-resume``, ``miles dashboard RUN_DIR`` and Ctrl-C.

Whatever can hang or grow without bound (a FIFO, ``/dev/zero``, deep JSON) runs ``miles`` in a subprocess with a
timeout and an address-space cap; every refusal is exit status 2, a short ``miles: error:`` naming the file and
what to give instead, no traceback, and nothing created or moved.
"""

from __future__ import annotations

import asyncio
import decimal
import json
import os
import resource
import signal
import sqlite3
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import transformers

from miles_core.builtin.algorithms import Grpo
from miles_core.builtin.dashboard.store import DashboardStore, check_run_dir
from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.build import build_config
from miles_core.config.sections import EngineSection, RolloutSection, RunSection, TrainSection
from miles_core.errors import MilesError
from miles_core.models.checkpoint_dir import checkpoint_family, require_checkpoint_dir
from miles_core.plugin_manager import MilesPluginManager
from miles_core.rollout.chat_prompts import ChatRenderer
from miles_core.rollout.executor import RolloutExecutor, checked_reward
from miles_core.rollout.prompt_data import open_prompt_source
from miles_core.rollout.prompts import Prompt
from miles_core.rollout.rewards import single_reward
from miles_core.rollout.samples import Sample
from miles_core.run_setup import check_prompts_encode, latest_checkpoint, load_tokenizer, prepare_run
from miles_core.testkit.tiny_models import save_tiny_llama, tiny_llama_config
from miles_core.testkit.tokenizers import save_char_tokenizer
from tests.conftest import MILES

MEMORY_CAP = 3 << 30  # `miles train` imports torch and transformers (about 1.5 GiB of address space) before it fails
TIMEOUT_S = 180  # generous for a shared 2-core machine: a hang, not a slow start, is what it catches


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def miles(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``miles ARGS`` with the memory cap and the timeout (a hang fails the test with TimeoutExpired)."""
    return subprocess.run(
        [str(MILES), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        preexec_fn=_cap_memory,
        check=False,
    )


def refused(*args: str, cwd: Path, env: dict[str, str] | None = None, max_lines: int = 3) -> str:
    """Run ``miles ARGS`` expecting a short, clean refusal; return stderr."""
    result = miles(*args, cwd=cwd, env=env)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    error = result.stderr[result.stderr.index("miles: error: ") :]  # after `miles train`'s own lines, if any
    assert len(error.splitlines()) <= max_lines, error[:3000]
    return error


def train_refused(tmp_path: Path, *args: str) -> str:
    """``miles train ARGS`` refused before its run directory is created."""
    stderr = refused("train", "--output-dir", str(tmp_path / "run"), "--no-progress", *args, cwd=tmp_path)
    assert not (tmp_path / "run").exists()  # refused before anything was written
    return stderr


@pytest.fixture(scope="module")
def manager() -> MilesPluginManager:
    return MilesPluginManager.load(environ={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})


# -- prompt files -------------------------------------------------------------------------------------------------


def _special_path(tmp_path: Path, kind: str) -> Path:
    """A path that is not a small text file: a FIFO (no writer: reading waits forever), a device, a symlink loop."""
    if kind == "fifo":
        os.mkfifo(tmp_path / "fifo.jsonl")
        return tmp_path / "fifo.jsonl"
    if kind == "loop":
        os.symlink(tmp_path / "b.jsonl", tmp_path / "a.jsonl")
        os.symlink(tmp_path / "a.jsonl", tmp_path / "b.jsonl")
        return tmp_path / "a.jsonl"
    return Path("/dev/zero")


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("fifo", "is not a regular file (a FIFO, device or socket); give a JSONL file"),
        ("dev_zero", "prompt file '/dev/zero' is not a regular file"),
        ("loop", "Too many levels of symbolic links"),
    ],
)
def test_a_prompt_file_that_is_no_file_is_refused_without_reading_it(tmp_path: Path, kind: str, expected: str) -> None:
    path = _special_path(tmp_path, kind)
    assert expected in train_refused(tmp_path, "--prompts", str(path), "--reward", "echo_last")


HOSTILE_LINES = {
    "deep": ("[" * 100_000 + "]" * 100_000, " is nested deeper than 64 levels"),
    "nan_label": ('{"prompt": "1:", "label": NaN}', " is not valid JSON: NaN is not a JSON number"),
    "huge_int": ('{"prompt": "1:", "label": ' + "9" * 5000 + "}", " holds an integer of 5000 digits"),
    "overflow_float": ('{"prompt": "1:", "label": 1e400}', " holds the number 1e400, too large for a float"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_LINES))
def test_a_hostile_prompt_line_is_refused_naming_the_line(tmp_path: Path, name: str) -> None:
    line, expected = HOSTILE_LINES[name]
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "1:"}\n' + line + "\n")
    assert f"{path}:2{expected}" in train_refused(tmp_path, "--prompts", str(path), "--reward", "echo_last")


MALFORMED_FILES = {
    "non_utf8": (b'{"prompt": "\xff1:"}\n', "is not UTF-8 text (byte 0xff at line 1); save it as UTF-8"),
    "utf16": ('{"prompt": "1:"}\n'.encode("utf-16"), "is binary or UTF-16/UTF-32, not UTF-8 text"),
    "empty": (b"", "holds no prompts"),
    "blank_lines": (b"\n  \n\t\n", "holds no prompts"),
    "misspelt_key": (b'{"prompt": "1:", "lable": "1"}\n', ":1: unknown key 'lable'; a line has the keys prompt, label"),
    "duplicate_key": (b'{"prompt": "1:", "prompt": "2:"}\n', ":1 gives the key 'prompt' twice"),
    "empty_prompt": (b'{"prompt": ""}\n', ":1: key 'prompt' is empty"),
    "not_an_object": (b'["1:"]\n', ":1: expected an object with a 'prompt'"),
    "prompt_not_a_string": (b'{"prompt": 12}\n', ":1: key 'prompt' is int; a prompt is a string or a list of chat"),
    "metadata_a_list": (b'{"prompt": "1:", "metadata": [1]}\n', ":1: key 'metadata' must be an object, got list"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED_FILES))
def test_a_malformed_prompt_file_is_an_error_naming_it(tmp_path: Path, name: str) -> None:
    content, expected = MALFORMED_FILES[name]
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    with pytest.raises(MilesError) as error:
        read_prompts_jsonl(path, cache_dir=tmp_path / "cache")
    assert expected in str(error.value) and str(path) in str(error.value)
    assert len(str(error.value)) < 400


def test_a_large_prompt_file_with_any_json_labels_is_read(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    labels = [None, 3, 2.5, "x", [1, {"a": True}], {"k": [None]}]
    lines = [
        json.dumps({"prompt": f"{i}:", "label": labels[i % len(labels)], "metadata": {"i": i}}) for i in range(100_000)
    ]
    path.write_text("\r\n".join(lines) + "\r\n")  # Windows line ends too
    prompts = read_prompts_jsonl(path, cache_dir=tmp_path / "cache")
    assert len(prompts) == 100_000
    assert prompts[4] == Prompt("4:", label=[1, {"a": True}], metadata={"i": 4})


def read_prompts_jsonl(path: Path, *, cache_dir: Path) -> Sequence[Prompt]:
    """The prompts of a JSONL file, as ``--prompts`` reads them with the built-in tokenizer."""
    return open_prompt_source(str(path), renderer=ChatRenderer(None), cache_dir=str(cache_dir))


# -- model directories ----------------------------------------------------------------------------------------------


def _model(tmp_path: Path) -> Path:
    model = save_tiny_llama(tmp_path / "model", vocab_size=16)
    save_char_tokenizer(model, "0123456789:")
    return model


def test_a_model_directory_holding_a_fifo_is_refused_before_anything_reads_it(tmp_path: Path) -> None:
    model = _model(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1:"}\n')
    (model / "tokenizer.json").unlink()
    os.mkfifo(model / "tokenizer.json")  # transformers would wait for a writer forever
    stderr = train_refused(tmp_path, "--model", str(model), "--prompts", str(prompts), "--reward", "echo_last")
    assert f"model directory {str(model)!r} holds 'tokenizer.json', which is not a regular file" in stderr
    (model / "tokenizer.json").unlink()
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    stderr = train_refused(tmp_path, "--model", str(model), "--prompts", str(prompts), "--reward", "echo_last")
    assert "holds 'config.json', which is not a regular file" in stderr


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "is nested deeper than 64 levels"),
        (b"not json", "is not valid JSON"),
        (b'{"model_type": "llama", "vocab_size": NaN}', "NaN is not a JSON number"),
        (b'["llama"]', "holds a list, not a JSON object"),
        (b'{"model_type": "llama", "model_type": "qwen3"}', "gives the key 'model_type' twice"),
        (b"\xff\xfe{}", "is binary or UTF-16/UTF-32"),
        (b" " * ((16 << 20) + 1), "more than the 16777216 allowed"),
    ],
)
def test_a_hostile_config_json_is_an_error_naming_the_model(tmp_path: Path, content: bytes, expected: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes(content)
    with pytest.raises(MilesError) as error:
        checkpoint_family(model)
    message = str(error.value)
    assert message.startswith(f"cannot load model from {str(model)!r}: config.json of model directory")
    assert expected in message
    assert len(message) < 400


def test_a_model_path_that_is_a_file_or_a_loop_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(MilesError, match="is not a directory"):
        require_checkpoint_dir(tmp_path / "file")
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    with pytest.raises(MilesError, match="Too many levels of symbolic links"):
        require_checkpoint_dir(tmp_path / "a")


# -- plugin files and the environment -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_plugin_file_that_is_no_file_is_refused_without_reading_it(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "plugin.py" if kind == "fifo" else Path("/dev/zero")
    if kind == "fifo":
        os.mkfifo(path)
    stderr = refused("--plugin", str(path), "plugins", cwd=tmp_path)
    assert f"plugin file {str(path)!r} (from --plugin) is not a regular file (a FIFO, device or socket)" in stderr


def test_the_autoload_switch_is_read_strictly(tmp_path: Path) -> None:
    stderr = refused("plugins", cwd=tmp_path, env={"MILES_DISABLE_PLUGIN_AUTOLOAD": "disable"})
    assert "MILES_DISABLE_PLUGIN_AUTOLOAD='disable' is neither true nor false: set it to 1" in stderr
    for value in ("TRUE", " On ", "1"):
        result = miles("plugins", "--json", cwd=tmp_path, env={"MILES_DISABLE_PLUGIN_AUTOLOAD": value})
        assert result.returncode == 0, result.stderr
        sources = {plugin["source"] for plugin in json.loads(result.stdout)["plugins"]}
        assert sources == {"builtin"}, (value, sources)


# -- rewards --------------------------------------------------------------------------------------------------------


def _executor(reward_fn) -> RolloutExecutor:
    return RolloutExecutor(
        run=RunSection(),
        rollout=RolloutSection(),
        train=TrainSection(),
        engine=EngineSection(),
        tokenizer=None,
        train_prompts=[],
        eval_prompts=[],
        reward=single_reward(reward_fn, "my_rewards:score"),
        controller=None,
        advantages=Grpo(),
    )


def test_a_reward_that_changes_its_inputs_changes_no_other_sample() -> None:
    seen = []

    def greedy(*, prompt, response, label, metadata):
        seen.append((list(label), dict(metadata)))
        label.append("extra")
        metadata["count"] = metadata.get("count", 0) + 1
        return 1.0

    prompt = Prompt("1:", label=["1"], metadata={"source": "a"})
    samples = [Sample(index=i, prompt=prompt, prompt_ids=[2], response="1") for i in range(3)]
    executor = _executor(greedy)
    asyncio.run(executor.scorer.score(samples, ["sample {index}"] * 3))
    executor.close()
    assert [s.reward for s in samples] == [1.0] * 3
    assert seen == [(["1"], {"source": "a"})] * 3  # each sample scored against the file's label and metadata
    assert prompt.label == ["1"] and prompt.metadata == {"source": "a"}  # and later steps too


def test_a_decimal_or_fraction_reward_counts_and_a_signalling_nan_is_refused() -> None:
    assert checked_reward(decimal.Decimal("0.25")) == 0.25
    for value in (decimal.Decimal("sNaN"), decimal.Decimal("NaN"), decimal.Decimal("1e999999")):
        with pytest.raises(ValueError, match="not a finite number"):
            checked_reward(value)


# -- --run-resume -----------------------------------------------------------------------------------------------------


def _checkpoint(run_dir: Path, step: int) -> Path:
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    _model(path.parent / "tmp").rename(path)
    (path.parent / "tmp").rmdir()
    return path


def test_the_newest_checkpoint_is_found_by_number_and_odd_names_are_not_checkpoints(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 999_999)
    newest = _checkpoint(tmp_path, 1_000_000)  # step_1000000 sorts before step_999999 as text
    (tmp_path / "checkpoints" / "step_x9").mkdir()
    (tmp_path / "checkpoints" / "step_2000000").write_text("a file, not a checkpoint")
    (tmp_path / "checkpoints" / "step_\u0661\u0662").mkdir()  # Arabic-Indic digits: int() reads them, we do not
    assert latest_checkpoint(tmp_path) == newest


def test_resuming_from_a_corrupt_or_finished_checkpoint_is_an_error_saying_what_to_do(
    tmp_path: Path, manager: MilesPluginManager
) -> None:
    run_dir = tmp_path / "run"
    newest = _checkpoint(run_dir, 3)
    (newest / "config.json").write_text('{"model_type": "llama", "vocab_size": 1')  # killed while writing it

    def resume(num_steps: int) -> str:
        config = build_config(
            manager, overrides={"run.output_dir": str(run_dir), "run.resume": "true", "run.num_steps": str(num_steps)}
        )
        with pytest.raises(MilesError) as error:
            prepare_run(config, manager.registries)
        return str(error.value)

    message = resume(10)
    assert f"the newest checkpoint {str(newest)!r} cannot be resumed from" in message and "is not valid JSON" in message
    assert "move it out of checkpoints/ to resume from the one before it" in message
    message = resume(3)
    assert "is step 3, and run.num_steps (--num-steps) is 3: nothing is left to run" in message
    assert "give --num-steps above 3 to continue the run" in message


def test_a_resumed_run_whose_metrics_file_is_a_fifo_stops_naming_it(tmp_path: Path) -> None:
    """A resumed run rewrites ``metrics.jsonl`` before its first step: a FIFO there is an error, not a hang."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.mkfifo(run_dir / "metrics.jsonl")
    stderr = refused("train", "--output-dir", str(run_dir), "--no-progress", "--run-resume", "true", cwd=tmp_path)
    assert f"the rows of the steps that run again cannot be dropped from {str(run_dir / 'metrics.jsonl')!r}" in stderr
    assert "it is not a regular file (a directory, FIFO or device); move it aside" in stderr
    assert not (run_dir / "checkpoints").exists()  # no step ran


# -- miles dashboard RUN_DIR ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["run#1", "run?mode=ro", "run%41", "run ü"])
def test_a_run_directory_with_uri_characters_in_its_name_is_served(tmp_path: Path, name: str) -> None:
    run_dir = tmp_path / name
    DashboardStore(run_dir).close()
    assert check_run_dir(run_dir) == run_dir / "dashboard.sqlite"
    assert sorted(path.name for path in tmp_path.iterdir()) == [name]  # no stray database beside it


def test_a_database_of_a_newer_schema_or_a_fifo_says_what_to_do(tmp_path: Path) -> None:
    newer = tmp_path / "newer"
    DashboardStore(newer).close()
    with sqlite3.connect(newer / "dashboard.sqlite") as db:
        db.execute("UPDATE meta SET value = '7' WHERE key = 'schema_version'")
    stderr = refused("dashboard", str(newer), cwd=tmp_path)
    assert "has dashboard schema version 7; this miles reads version 1: a newer miles recorded it: upgrade" in stderr
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "dashboard.sqlite")
    assert "is not a regular file (a directory, FIFO or device)" in refused("dashboard", str(fifo), cwd=tmp_path)


# -- Ctrl-C -----------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_stops_a_run_cleanly_and_says_where_it_is(tmp_path: Path) -> None:
    """SIGINT during ``miles train`` (as Ctrl-C sends it): exit 130, no traceback, no worker left, and the run
    directory named. The run is in a session of its own, so that its leftovers can be found by process group."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [str(MILES), "train", "--num-steps", "500", "--no-progress", "--output-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )
    try:
        for line in proc.stdout:
            if line.startswith("step    2"):
                break
        os.kill(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = [pid for pid in _group_members(proc.pid) if pid != proc.pid]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    assert f"miles: interrupted; the run is in {run_dir}, with no checkpoint yet" in stderr
    assert left == []


def _default_sigint() -> None:
    """Ctrl-C's default action in the child: a shell that starts pytest in the background (``make test &``) ignores
    SIGINT, the child would inherit that, and Python installs no KeyboardInterrupt handler for an ignored signal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    members.append(int(entry.name))
            except ProcessLookupError:
                continue
    return members


@pytest.mark.parametrize("damage", ["state_not_json", "state_step_a_string", "optimizer_missing"])
def test_a_damaged_checkpoint_is_an_error_naming_it_when_the_trainer_resumes(tmp_path: Path, damage: str) -> None:
    def trainer() -> TorchTrainer:
        torch.manual_seed(0)
        return TorchTrainer(transformers.AutoModelForCausalLM.from_config(tiny_llama_config()), TrainSection())

    directory = trainer().save_checkpoint(tmp_path / "step_000001")
    state = directory / "trainer_state.json"
    if damage == "state_not_json":
        state.write_text('{"step": 1')
    elif damage == "state_step_a_string":
        state.write_text('{"step": "1"}')
    else:
        (directory / "optimizer.pt").unlink()
    with pytest.raises(MilesError) as error:
        trainer().load_checkpoint(directory)
    message = str(error.value)
    assert message.startswith(f"cannot resume from the checkpoint {str(directory)!r}: ")
    assert message.endswith("move it aside to resume from the one before it") and len(message) < 600


def test_a_prompt_longer_than_the_context_is_refused_before_any_worker_starts(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model", vocab_size=16, max_position_embeddings=16)
    save_char_tokenizer(model, "0123456789:")
    tokenizer = load_tokenizer(model)
    fits = "1" * (16 - 8 - (len(tokenizer.encode("1")) - 1))  # room left for 8 new tokens, whatever it adds (bos)
    check_prompts_encode(tokenizer, {"train": [Prompt(fits)]}, model_path=model, max_new_tokens=8)
    for text in (fits + "1", "1" * 1_000_000):
        with pytest.raises(MilesError) as error:
            check_prompts_encode(tokenizer, {"train": [Prompt(fits), Prompt(text)]}, model_path=model, max_new_tokens=8)
        message = str(error.value)
        assert "train prompt 1 (" in message and "with rollout.max_new_tokens (--rollout-max-new-tokens) 8" in message
        assert "more than the model's context length 16: shorten the prompt" in message and len(message) < 600


@pytest.mark.parametrize("base", ["/models/qwen3-0.6b", None])
def test_a_lora_adapter_given_as_the_model_is_named_as_one_before_anything_starts(tmp_path: Path, base) -> None:
    """peft's adapter directory (``adapter_config.json``, no ``config.json``) as ``--model``: a one-line error that
    says it is an adapter without its base (and which base it records), before the run directory exists."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    recorded = {"peft_type": "LORA", "r": 8} | ({"base_model_name_or_path": base} if base else {})
    (adapter / "adapter_config.json").write_text(json.dumps(recorded))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    stderr = train_refused(tmp_path, "--model", str(adapter))
    assert f"model directory {str(adapter)!r} holds a LoRA adapter (adapter_config.json" in stderr
    assert "without its base model: give the base model as --model" in stderr
    assert (f"of the base model {base!r}" in stderr) == (base is not None)
