"""What a run checks before any worker starts: the model directory's tokenizer (and that it encodes the prompts),
the reward target (resolved from the working directory), the protocol's settings; and what a reward sees and may
return. Real tokenizers, real modules on disk, the real plugin manager; no engine."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from miles_core.builtin.algorithms import Grpo
from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.build import build_config
from miles_core.config.sections import EngineSection, RolloutSection, RunSection, TrainSection
from miles_core.default.task import echo_last_prompts
from miles_core.default.tokenizer import DigitTokenizer
from miles_core.errors import ConfigError, MilesError
from miles_core.loop import make_protocol, save_checkpoint
from miles_core.models.hf_checkpoint import TOKENIZER_FILES, copy_tokenizer_files, tokenizer_files
from miles_core.plugin_manager import MilesPluginManager
from miles_core.rollout.executor import RolloutExecutor, checked_reward, decode_response
from miles_core.rollout.prompts import Prompt
from miles_core.rollout.rewards import RewardPlan, single_reward
from miles_core.rollout.samples import Sample
from miles_core.run_setup import (
    RunSetup,
    check_prompts_encode,
    default_model,
    load_prompts,
    load_reward,
    load_tokenizer,
    prepare_run,
)
from miles_core.targets import describe_callable
from miles_core.testkit.tiny_models import save_tiny_llama
from miles_core.testkit.tokenizers import save_char_tokenizer


@pytest.fixture(scope="module")
def manager() -> MilesPluginManager:
    return MilesPluginManager.load(environ={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})


def config(manager: MilesPluginManager, **overrides):
    return build_config(manager, overrides=overrides)


# -- the tokenizer of the model directory ----------------------------------------------------------------------


def test_a_model_directory_without_tokenizer_files_is_refused_naming_them(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "checkpoint", vocab_size=16)  # config + weights, as old checkpoints were
    with pytest.raises(MilesError) as error:
        load_tokenizer(model)
    message = str(error.value)
    assert f"model directory {str(model)!r} holds no tokenizer files" in message
    assert all(name in message for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def test_prompts_that_encode_to_no_ids_or_beyond_the_vocabulary_are_refused(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model", vocab_size=16)
    save_char_tokenizer(model, "abc:0123456")
    tokenizer = load_tokenizer(model)
    prompts = [Prompt("a1:"), Prompt("b2:")]
    check_prompts_encode(tokenizer, {"train": prompts, "eval": prompts}, model_path=model)  # fits: no error

    class NoIds:  # a tokenizer that knows none of the prompt's text, as a wrong or empty tokenizer does
        def encode(self, text: str) -> list[int]:
            return []

    with pytest.raises(MilesError, match=r"encodes train prompt 0 \('a1:'\) to no token ids: is it the model's"):
        check_prompts_encode(NoIds(), {"train": prompts}, model_path=model)
    with pytest.raises(MilesError, match=r"encodes eval prompt 1 \(''\) to no token ids: the prompt is empty"):
        check_prompts_encode(tokenizer, {"train": prompts, "eval": [Prompt("a"), Prompt("")]}, model_path=model)

    small = save_tiny_llama(tmp_path / "small", vocab_size=8)  # its tokenizer files belong to a larger vocabulary
    save_char_tokenizer(small, "abc:0123456")
    with pytest.raises(MilesError, match=r"prompt 0 .* to token id 12, beyond the model's vocab_size 8: the tokenizer"):
        check_prompts_encode(load_tokenizer(small), {"train": [Prompt("c5:")]}, model_path=small)


def test_the_default_model_holds_the_default_tokenizer_as_hf_files(tmp_path: Path) -> None:
    """A checkpoint of the default run is usable as ``--model``: its tokenizer loads with transformers and gives
    the ids of the built-in tokenizer."""
    model = default_model(tmp_path, seed=0)
    loaded = load_tokenizer(model)
    digits = DigitTokenizer()
    train, evaluation = echo_last_prompts(seed=0)
    for prompt in train[:50] + evaluation[:50]:
        assert loaded.encode(prompt.text) == digits.encode(prompt.text), prompt
    answer = [*digits.encode("5555", add_bos=False), digits.eos_token_id, digits.pad_token_id]
    assert decode_response(loaded, answer) == decode_response(digits, answer) == "5555"
    assert loaded.eos_token_id == digits.eos_token_id and loaded.pad_token_id == digits.pad_token_id
    check_prompts_encode(loaded, {"train": train}, model_path=model)
    for tokenizer in (loaded, digits):  # a character the default does not know: refused, not encoded as padding
        with pytest.raises(MilesError, match=r"cannot encode train prompt 1 \('7a:'\): "):
            check_prompts_encode(tokenizer, {"train": [Prompt("1:"), Prompt("7a:")]}, model_path=model)
    (model / "tokenizer.json").unlink()  # an initial model written before tokenizers were saved: rewritten
    (model / "tokenizer_config.json").unlink()
    assert load_tokenizer(default_model(tmp_path, seed=0)).encode("1:") == digits.encode("1:")


def test_copying_a_tokenizer_from_a_directory_without_one_is_an_error(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model", vocab_size=16)
    with pytest.raises(MilesError, match=r"holds no tokenizer files .*: a checkpoint needs its tokenizer"):
        copy_tokenizer_files(model, tmp_path / "out")
    save_char_tokenizer(model, "abc")
    (tmp_path / "out").mkdir()
    copied = {path.name for path in copy_tokenizer_files(model, tmp_path / "out")}
    assert copied and copied <= set(TOKENIZER_FILES)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").encode("abc") == load_tokenizer(model).encode(
        "abc"
    )


def test_every_checkpoint_of_a_run_holds_the_tokenizer_also_from_a_trainer_that_writes_none(tmp_path: Path) -> None:
    """A third-party trainer may write config + weights only: the loop adds the run model's tokenizer files."""
    model = save_tiny_llama(tmp_path / "model")
    save_char_tokenizer(model, "abc:0123456")
    setup = RunSetup(
        run_dir=tmp_path / "run",
        model_path=model,
        initial_model_path=model,
        tokenizer=None,
        train_prompts=[],
        eval_prompts=[],
        reward=None,
        token="",
    )
    bare = TorchTrainer.from_pretrained(save_tiny_llama(tmp_path / "no-tokenizer"), TrainSection())
    checkpoint = save_checkpoint(bare, setup, 7)
    assert checkpoint == tmp_path / "run" / "checkpoints" / "step_000007"
    assert load_tokenizer(checkpoint).encode("ab1:") == load_tokenizer(model).encode("ab1:") != []
    own = TorchTrainer.from_pretrained(model, TrainSection())  # writes the tokenizer itself: left as written
    assert {p.name for p in tokenizer_files(save_checkpoint(own, setup, 8))} == {p.name for p in tokenizer_files(model)}


def earlier_run(run_dir: Path) -> Path:
    """A run directory holding an earlier run: metrics and a checkpoint with its tokenizer."""
    checkpoint = save_tiny_llama(run_dir / "checkpoints" / "step_000002", vocab_size=16)
    save_char_tokenizer(checkpoint, "abc:0123456")
    (run_dir / "metrics.jsonl").write_text('{"step": 2}\n')
    return checkpoint


def test_a_refused_run_moves_no_earlier_run_aside(tmp_path: Path, manager) -> None:
    run_dir = tmp_path / "latest"
    earlier_run(run_dir)
    bare = save_tiny_llama(tmp_path / "bare")  # no tokenizer: refused
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a1:", "label": "a"}\n')
    refused = config(
        manager,
        **{
            "run.output_dir": str(run_dir),
            "model.path": str(bare),
            "rollout.prompts": str(prompts),
            "rollout.reward": "echo_last",
        },
    )
    with pytest.raises(MilesError, match="holds no tokenizer files"):
        prepare_run(refused, manager.registries)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare", "latest", "prompts.jsonl"]  # nothing moved
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 2}\n'


def test_a_checkpoint_of_the_earlier_run_in_the_same_directory_is_the_model(tmp_path: Path, manager, capsys) -> None:
    """`miles train --model runs/latest/checkpoints/step_000002` with the default --output-dir runs/latest: the
    earlier run moves aside, and the model is loaded from where it moved."""
    run_dir = tmp_path / "latest"
    earlier_run(run_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a1:", "label": "a"}\n')
    given = run_dir / "checkpoints" / "step_000002"
    setup = prepare_run(
        config(
            manager,
            **{
                "run.output_dir": str(run_dir),
                "model.path": str(given),
                "rollout.prompts": str(prompts),
                "rollout.reward": "echo_last",
            },
        ),
        manager.registries,
    )
    (archive,) = [p for p in tmp_path.iterdir() if p.name.startswith("latest-")]
    assert setup.model_path == setup.initial_model_path == archive / "checkpoints" / "step_000002"
    assert (setup.model_path / "model.safetensors").is_file() and not given.exists()
    assert setup.tokenizer.encode("a1:") == load_tokenizer(setup.model_path).encode("a1:")
    assert f"moved with the earlier run; loading it from {setup.model_path}" in capsys.readouterr().out


# -- what a reward sees and may return ---------------------------------------------------------------------------


def test_the_response_a_reward_sees_has_no_special_tokens(tmp_path: Path) -> None:
    tokenizer = save_char_tokenizer(tmp_path, "abc: 0123456")
    ids = tokenizer.encode("12", add_special_tokens=False)
    for generated in ([*ids, tokenizer.eos_token_id], [tokenizer.bos_token_id, *ids], [*ids, tokenizer.pad_token_id]):
        assert decode_response(tokenizer, generated) == "12"  # so `response == label` can match
    assert decode_response(tokenizer, tokenizer.encode(" 1 ", add_special_tokens=False)) == " 1 "  # nothing else


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, 1.0),
        (0.25, 0.25),
        (True, 1.0),
        (False, 0.0),
        (np.float32(0.5), 0.5),
        (np.int64(-2), -2.0),
        (np.bool_(True), 1.0),
        (np.array([1, 2]).sum() == 3, 1.0),
    ],
)
def test_a_reward_is_a_finite_number_or_a_bool(value, expected: float) -> None:
    assert checked_reward(value) == expected and type(checked_reward(value)) is float


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (math.nan, "returned nan, not a finite number"),
        (math.inf, "returned inf, not a finite number"),
        (-math.inf, "returned -inf, not a finite number"),
        (np.float64("nan"), "returned nan, not a finite number"),
        ("1.0", "returned '1.0' of type str, not a number"),
        (None, "returned None of type NoneType, not a number"),
        ([1.0], "returned [1.0] of type list, not a number"),
        ({"reward": 1}, "of type dict, not a number"),
        (10**400, "beyond the range of a float"),
        (complex(1, 0), "of type complex, not a number"),
        (np.array([0.5]), "of type ndarray, not a number (call .item() on it)"),
    ],
)
def test_anything_else_scores_0_counted_and_said_once_naming_the_sample_and_the_function(value, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        checked_reward(value)
    executor = scoring_executor(lambda **_: value, name="my_rewards:score")
    lines: list[str] = []
    executor.scorer.log = lines.append
    sample = Sample(index=5, prompt=Prompt("73915:" + "9" * 200, label="5"), prompt_ids=[2], response="5555")
    again = Sample(index=6, prompt=sample.prompt, prompt_ids=[2], response="5")
    asyncio.run(executor.scorer.score([sample, again], ["sample {index} of rollout 2 (step 3)"] * 2))
    assert (sample.reward, sample.reward_errors, again.reward, again.reward_errors) == (0.0, 1, 0.0, 1)
    assert len(lines) == 1  # the first of its kind, once
    message = lines[0]
    assert message.startswith("miles: reward my_rewards:score returned") and problem in message
    assert "on sample 5 of rollout 2 (step 3) (prompt '73915:999" in message and "...' (cut)" in message
    assert "response '5555'" in message and "it scores 0" in message
    assert len(message) < 600  # an excerpt of the prompt, not all of it
    stats = executor._stats([sample, again], "rollout")
    assert stats["reward/errors"] == 2.0 and stats["rollout/reward/my_rewards:score"] == 0.0
    executor.close()


def only_part(plan: RewardPlan) -> tuple[Any, str]:
    """The function and name of a plan of one reward function."""
    assert plan.dispatch_key is None and plan.default is not None and len(plan.default.parts) == 1
    part = plan.default.parts[0]
    return part.fn, part.name


def scoring_executor(reward_fn, *, name: str) -> RolloutExecutor:
    """An executor used only for scoring (no engine is needed to score given responses)."""
    return RolloutExecutor(
        run=RunSection(),
        rollout=RolloutSection(),
        train=TrainSection(),
        engine=EngineSection(),
        tokenizer=None,
        train_prompts=[],
        eval_prompts=[],
        reward=single_reward(reward_fn, name),
        controller=None,
        advantages=Grpo(),
    )


# -- the reward target ---------------------------------------------------------------------------------------


@pytest.fixture
def work_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding reward modules, not on ``sys.path``, as a user's project directory is."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", os.getcwd())])
    (tmp_path / "cwd_rewards.py").write_text(
        "def score(*, prompt, response, label, metadata):\n    return 1.0\nNOT_A_FUNCTION = 3\n"
    )
    (tmp_path / "cwd_broken.py").write_text("import not_installed_dependency_xyz\n")
    (tmp_path / "cwd_raising.py").write_text("raise RuntimeError('reward module is broken')\n")
    (tmp_path / "cwd_shapes.py").write_text(
        "def positional(prompt, response):\n    return 0.0\n"
        "async def later(**_):\n    return 0.0\n"
        "def flexible(prompt, response, label=None, **rest):\n    return 0.0\n"
    )
    package = tmp_path / "cwd_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rewards.py").write_text("class Rewards:\n    @staticmethod\n    def exact(**_):\n        return 0.0\n")
    yield tmp_path
    for name in ("cwd_rewards", "cwd_broken", "cwd_raising", "cwd_shapes", "cwd_package", "cwd_package.rewards"):
        sys.modules.pop(name, None)


def test_a_reward_module_in_the_working_directory_is_found(work_dir: Path, manager) -> None:
    path_before = list(sys.path)
    reward, name = only_part(
        load_reward(config(manager, **{"rollout.reward": "cwd_rewards:score"}), manager.registries)
    )
    assert reward(prompt="", response="", label=None, metadata={}) == 1.0 and name == "cwd_rewards:score"
    assert sys.path == path_before  # the working directory was first on the path for that lookup only
    nested, name = only_part(
        load_reward(config(manager, **{"rollout.reward": "cwd_package.rewards:Rewards.exact"}), manager.registries)
    )
    assert nested() == 0.0 and name == "cwd_package.rewards:Rewards.exact"
    flexible, _ = only_part(
        load_reward(config(manager, **{"rollout.reward": "cwd_shapes:flexible"}), manager.registries)
    )
    assert flexible(prompt="", response="", label=None, metadata={}) == 0.0  # keywords by name or **rest: fine


def test_a_registered_reward_is_named_with_its_function(manager) -> None:
    reward, name = only_part(load_reward(config(manager, **{"rollout.reward": "echo_last"}), manager.registries))
    assert name == "echo_last" and describe_callable(reward) == "miles_core.default.task:echo_last_reward"


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            "missing_module_xyz:score",
            "--reward 'missing_module_xyz:score': no module named 'missing_module_xyz' in the working directory",
        ),
        ("cwd_package.nothing:score", "no module named 'cwd_package.nothing'"),
        ("cwd_rewards:missing", "'cwd_rewards' (from "),
        ("cwd_rewards:missing", "has no attribute 'missing'; it defines: NOT_A_FUNCTION, score"),
        ("cwd_package.rewards:Rewards.nope", "'cwd_package.rewards.Rewards' (from "),
        ("cwd_rewards:NOT_A_FUNCTION", "--reward 'cwd_rewards:NOT_A_FUNCTION' is 3, not a function"),
        (
            "cwd_broken:score",
            "importing module 'cwd_broken' failed: it imports 'not_installed_dependency_xyz', which is not installed",
        ),
        ("cwd_raising:score", "importing module 'cwd_raising' failed: RuntimeError: reward module is broken"),
        (":score", "unknown reward function ':score'; available: echo_last"),
        ("cwd_rewards:", "rollout.reward (--reward) = 'cwd_rewards:': the weight '' of 'cwd_rewards' is not a number"),
        ("cwd_rewards:score:x", "unknown reward function 'cwd_rewards:score:x'"),
        ("score", "rollout.reward (--reward) = 'score': unknown reward function 'score'; available: echo_last"),
        ("../etc:passwd", "unknown reward function '../etc:passwd'"),
        (
            "cwd_shapes:positional",
            "--reward 'cwd_shapes:positional' cannot be called as fn(*, prompt, response, "
            "label, metadata): got an unexpected keyword argument 'label'",
        ),
        ("cwd_shapes:later", "--reward 'cwd_shapes:later' is an async function"),
    ],
)
def test_a_bad_reward_target_is_a_clear_error_naming_it(work_dir: Path, manager, target: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_reward(config(manager, **{"rollout.reward": target}), manager.registries)
    assert message in str(error.value), str(error.value)


# -- protocol settings -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "settings", "message"),
    [
        ("disk", {"keep_versions": 0}, "disk setting keep_versions = 0: expected a whole number of at least 1"),
        ("disk", {"keep_versions": "2"}, "disk setting keep_versions = '2': expected a whole number"),
        ("disk", {"keep_versions": True}, "disk setting keep_versions = True: expected a whole number of at least 1"),
        ("disk", {"work_dir": 5}, "disk setting work_dir = 5: expected a string or null"),
        ("disk", {"no_such_setting": 1}, "disk has no setting 'no_such_setting'; disk's settings: work_dir,"),
        ("broadcast", {"timeout_s": -1}, "broadcast setting timeout_s = -1: expected a number above 0"),
        ("broadcast", {"timeout_s": "soon"}, "broadcast setting timeout_s = 'soon': expected a number above 0"),
        ("broadcast", {"master_address": ""}, "broadcast setting master_address = '': expected a non-empty string"),
        ("broadcast", {"backend": "mpi"}, "broadcast setting backend = 'mpi': expected 'auto', 'gloo' or 'nccl'"),
        ("tensor", {"zero_copy": "yes"}, "tensor setting zero_copy = 'yes': expected true or false"),
        ("tensor", {"shared_memory": 1}, "tensor setting shared_memory = 1: expected true, false or null"),
    ],
)
def test_settings_a_protocol_refuses_are_a_config_error_when_the_config_is_built(
    manager, mode: str, settings: dict, message: str
) -> None:
    with pytest.raises(ConfigError) as error:
        config(manager, **{"weight_transfer.mode": mode, "weight_transfer.settings": settings})
    text = str(error.value)
    assert text.startswith(
        f"weight_transfer.settings (--weight-transfer-settings) {json.dumps(settings)} do not "
        f"fit the protocol {mode!r} (miles_core.weight_transfer."
    )
    assert message in text, text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA, so NCCL is usable")
def test_a_protocol_refusing_to_be_built_on_this_machine_is_a_config_error(manager) -> None:
    """NCCL without a CUDA device: the settings fit the model; the constructor refuses them here."""
    run_config = config(
        manager, **{"weight_transfer.mode": "broadcast", "weight_transfer.settings": {"backend": "nccl"}}
    )
    with pytest.raises(ConfigError) as error:
        make_protocol(run_config, manager.registries)
    assert str(error.value).startswith(
        'weight_transfer.settings (--weight-transfer-settings) {"backend": "nccl"} do not fit the protocol '
        "'broadcast' (miles_core.weight_transfer.broadcast:BroadcastProtocol): MilesError: weight-update group "
        "backend 'nccl' needs a CUDA device"
    )


def test_a_third_party_protocols_settings_model_is_checked_when_the_config_is_built() -> None:
    """The example protocol (an entry point of its own distribution) declares its settings model."""
    plugins = MilesPluginManager.load()
    if "sharded-disk" not in plugins.registries.weight_transfer_protocols:
        pytest.fail("the example distribution miles-example-transfer is not installed: `make setup` installs it")
    with pytest.raises(
        ConfigError,
        match=r"protocol 'sharded-disk' \(miles_example_transfer.protocol:.*\): "
        "sharded-disk setting keep_versions = 0: expected a whole number of at least 1",
    ):
        build_config(
            plugins,
            overrides={"weight_transfer.mode": "sharded-disk", "weight_transfer.settings": {"keep_versions": 0}},
        )


# -- tasks (--task) --------------------------------------------------------------------------------------------

TASK_PLUGIN = """\
from miles_core import hookimpl
from miles_core.registry import Implementation
from miles_core.rollout.prompts import Prompt


def parity_prompts(*, seed):
    prompts = [Prompt(text=f"{n}:", label=str(n % 2), metadata={"seed": seed}) for n in range(10)]
    return prompts[:8], prompts[8:]


def parity(*, prompt, response, label, metadata):
    return float(response[:1] == label)


def nothing_prompts(*, seed):
    return [], []


def raising_prompts(*, seed):
    raise OSError("the dataset server is down")


@hookimpl
def provide_tasks():
    return [
        Implementation("parity", f"{__name__}:parity_prompts"),
        Implementation("empty", f"{__name__}:nothing_prompts"),
        Implementation("raising", f"{__name__}:raising_prompts"),
    ]


@hookimpl
def provide_reward_functions():
    return [Implementation("parity", f"{__name__}:parity")]
"""


@pytest.fixture
def task_manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MilesPluginManager:
    (tmp_path / "task_plugin.py").write_text(TASK_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield MilesPluginManager.load(["task_plugin"], environ={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})
    sys.modules.pop("task_plugin", None)


def test_a_task_gives_the_prompts_and_the_reward_of_its_name(task_manager) -> None:
    run_config = config(task_manager, **{"rollout.task": "parity", "run.seed": 4})
    train, evaluation = load_prompts(run_config, task_manager.registries)
    assert [p.text for p in train] == [f"{n}:" for n in range(8)] and [p.label for p in evaluation] == ["0", "1"]
    assert train[0].metadata == {"seed": 4}
    reward, name = only_part(load_reward(run_config, task_manager.registries))
    assert name == "parity" and reward(prompt="3:", response="1", label="1", metadata={}) == 1.0
    default = config(task_manager)
    expected = echo_last_prompts(seed=default.run.seed)
    assert default.rollout.task == "echo_last" and load_prompts(default, task_manager.registries) == expected


def test_eval_prompts_given_with_a_task_replace_the_tasks_eval_prompts(task_manager, tmp_path: Path) -> None:
    """``--rollout-eval-prompts`` without ``--prompts``: the task's training prompts, the file's eval prompts (it was
    ignored silently once)."""
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text('{"prompt": "12:", "label": "2"}\n{"prompt": "13:", "label": "3"}\n')
    run_config = config(task_manager, **{"rollout.task": "parity", "rollout.eval_prompts": [str(held_out)]})
    train, evaluation = load_prompts(run_config, task_manager.registries)
    assert [p.text for p in train] == [f"{n}:" for n in range(8)]
    assert [(p.text, p.label) for p in evaluation] == [("12:", "2"), ("13:", "3")]


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("nope", "rollout.task (--task) = 'nope': unknown task 'nope'; available: echo_last, empty, parity, raising"),
    ],
)
def test_an_unknown_task_is_refused_when_the_config_is_built(task_manager, task: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        config(task_manager, **{"rollout.task": task})
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("empty", "task 'empty' (task_plugin:nothing_prompts) returned train prompts []; expected a non-empty list"),
        ("raising", "task 'raising' (task_plugin:raising_prompts) failed to make its prompts: OSError: the dataset"),
    ],
)
def test_a_task_whose_prompts_fail_is_a_clear_error(task_manager, task: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_prompts(config(task_manager, **{"rollout.task": task}), task_manager.registries)


def test_a_task_without_a_reward_of_its_name_needs_a_reward(task_manager) -> None:
    with pytest.raises(ConfigError, match=r"task 'empty' needs --reward NAME or module:function: no reward function"):
        load_reward(config(task_manager, **{"rollout.task": "empty"}), task_manager.registries)
    run_config = config(task_manager, **{"rollout.task": "empty", "rollout.reward": "parity"})
    reward, _ = only_part(load_reward(run_config, task_manager.registries))
    assert reward(prompt="", response="0", label="0", metadata={}) == 1.0


def test_the_default_task_refuses_another_model(task_manager, tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "other-model")
    with pytest.raises(ConfigError, match=r"--model needs --prompts FILE.jsonl \(or a --task made for that model\)"):
        load_prompts(config(task_manager, **{"model.path": str(model)}), task_manager.registries)
    run_config = config(task_manager, **{"model.path": str(model), "rollout.task": "parity"})
    train, _ = load_prompts(run_config, task_manager.registries)
    assert len(train) == 8


def test_an_explicit_task_runs_on_another_model(task_manager, tmp_path: Path) -> None:
    """``--model DIR --task echo_last`` names the task: it is run on that model, not refused as the default."""
    model = save_tiny_llama(tmp_path / "other-model")
    run_config = config(task_manager, **{"model.path": str(model), "rollout.task": "echo_last"})
    assert load_prompts(run_config, task_manager.registries) == echo_last_prompts(seed=run_config.run.seed)
    with pytest.raises(ConfigError, match=r"default model \(give --task echo_last to run it on this model anyway\)"):
        load_prompts(config(task_manager, **{"model.path": str(model)}), task_manager.registries)


def _prompt_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "3:", "label": "1"}\n')
    return path


def test_prompts_without_a_reward_are_scored_by_the_task_s_reward(task_manager, tmp_path: Path, capsys) -> None:
    prompts = str(_prompt_file(tmp_path))
    run_config = config(task_manager, **{"rollout.prompts": prompts, "rollout.task": "parity"})
    reward, name = only_part(load_reward(run_config, task_manager.registries))
    assert name == "parity" and reward(prompt="3:", response="1", label="1", metadata={}) == 1.0
    assert "miles: --prompts without --reward: scoring with the reward of task 'parity'" in capsys.readouterr().out
    reward, name = only_part(load_reward(config(task_manager, **{"rollout.prompts": prompts}), task_manager.registries))
    assert name == "echo_last"  # the default model and task: the default task's reward


def test_prompts_for_another_model_without_a_reward_say_which_flag_to_add(task_manager, tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "other-model")
    run_config = config(task_manager, **{"rollout.prompts": str(_prompt_file(tmp_path)), "model.path": str(model)})
    with pytest.raises(ConfigError) as error:
        load_reward(run_config, task_manager.registries)
    assert str(error.value) == (
        "--prompts needs --reward to score the responses: add --reward NAME (registered: echo_last, exact, f1, "
        "format, gsm8k, math, multiple_choice, parity, tool_lookup) or --reward module:function (a module in the "
        "working directory), or --task NAME to score them with that task's reward (the default task, "
        "'echo_last', is made for the default model)"
    )
