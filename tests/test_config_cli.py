"""Config sources, validation and errors, through ``miles config show`` as a user runs it."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from miles_core.config import build_config
from miles_core.errors import ConfigError
from miles_core.plugin_manager import MilesPluginManager
from tests.conftest import config_json, run_miles


def show_error(*args: str) -> str:
    """Run ``miles config show`` expecting failure; return stderr."""
    result = run_miles("config", "show", *args)
    assert result.returncode == 2, result.stdout
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    return result.stderr


def test_defaults_then_file_then_flags(tmp_path: Path) -> None:
    defaults = config_json()
    assert defaults["rollout"]["batch_size"] == 16 and defaults["run"]["seed"] == 1234
    config_file = tmp_path / "run.yaml"
    config_file.write_text("rollout:\n  batch_size: 4\n  temperature: 0.5\nrun:\n  seed: 7\n")
    from_file = config_json("--config", str(config_file))
    assert from_file["rollout"] == {**defaults["rollout"], "batch_size": 4, "temperature": 0.5}
    assert from_file["run"]["seed"] == 7
    both = config_json("--config", str(config_file), "--rollout-batch-size", "2", "--seed", "9")
    assert both["rollout"]["batch_size"] == 2 and both["rollout"]["temperature"] == 0.5 and both["run"]["seed"] == 9


def test_train_settings_from_flags() -> None:
    train = config_json("--train-reset-optimizer-states", "true")["train"]
    assert train["reset_optimizer_states"] is True and config_json()["train"]["reset_optimizer_states"] is False


def test_yaml_output_round_trips(tmp_path: Path) -> None:
    result = run_miles("config", "show", "--rollout-top-k", "5")
    assert result.returncode == 0, result.stderr
    saved = tmp_path / "saved.yaml"
    saved.write_text(result.stdout)
    assert config_json("--config", str(saved)) == config_json("--rollout-top-k", "5")


def test_model_impl_flags() -> None:
    config = config_json("--model-impl", "llama=minimal", "--model-impl", "qwen3=transformers")
    assert config["model"]["implementations"] == {"llama": "minimal", "qwen3": "transformers"}


def test_malformed_yaml_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  batch_size: 4\n  temperature: [0.5\n")
    stderr = show_error("--config", str(bad))
    assert f"config file '{bad}' is not valid YAML at line 4" in stderr


def test_yaml_that_is_not_a_mapping(tmp_path: Path) -> None:
    bad = tmp_path / "list.yaml"
    bad.write_text("- rollout\n- run\n")
    assert "must hold a mapping of sections" in show_error("--config", str(bad))


def test_missing_config_file(tmp_path: Path) -> None:
    assert "cannot read config file" in show_error("--config", str(tmp_path / "nope.yaml"))


def test_unknown_section_and_key_suggest_the_closest(tmp_path: Path) -> None:
    config_file = tmp_path / "typo.yaml"
    config_file.write_text("rolout:\n  batch_size: 4\nrollout:\n  bath_size: 4\n")
    stderr = show_error("--config", str(config_file))
    assert "rolout: unknown key; allowed sections: run, model, rollout, train, engine, weight_transfer" in stderr
    assert "did you mean 'rollout'?" in stderr
    assert "rollout.bath_size: unknown key; allowed keys of 'rollout': batch_size" in stderr
    assert "did you mean 'batch_size'?" in stderr


def test_unknown_flag_suggests_the_closest() -> None:
    stderr = show_error("--rollout-bath-size", "3")
    assert "unrecognized arguments: --rollout-bath-size 3" in stderr
    assert "did you mean --rollout-batch-size" in stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--rollout-batch-size", "many"], "rollout.batch_size = 'many': Input should be a valid integer"),
        (["--weight-transfer-verify-checksum", "maybe"], "weight_transfer.verify_checksum = 'maybe': Input should be"),
        (["--rollout-top-p", "1.5"], "rollout.top_p = '1.5': Input should be less than or equal to 1"),
        (["--rollout-group-size", "0"], "rollout.group_size = '0': Input should be greater than or equal to 1"),
        (["--rollout-temperature", "-0.1"], "rollout.temperature = '-0.1': Input should be greater than or equal"),
        (["--model-implementations", "[a, b]"], "model.implementations = ['a', 'b']: Input should be a valid dict"),
        (["--train-reset-optimizer-states", "maybe"], "train.reset_optimizer_states = 'maybe': Input should be"),
    ],
)
def test_wrong_types_and_out_of_range_values(args: list[str], expected: str) -> None:
    assert expected in show_error(*args)


def test_every_problem_is_reported_with_allowed_values(tmp_path: Path) -> None:
    config_file = tmp_path / "many.yaml"
    config_file.write_text("rollout:\n  top_p: 0\n  max_new_tokens: 0\n")
    stderr = show_error("--config", str(config_file))
    assert "invalid config (2 problems)" in stderr
    assert "rollout.top_p = 0: Input should be greater than 0 (allowed: gt 0.0, le 1.0)" in stderr
    assert "rollout.max_new_tokens = 0: Input should be greater than 0 (allowed: gt 0)" in stderr


def test_unknown_protocol_lists_available_ones() -> None:
    stderr = show_error("--update-weight-transfer-mode", "carrier-pigeon")
    assert "weight_transfer.mode (--update-weight-transfer-mode) = 'carrier-pigeon'" in stderr
    assert (
        "unknown weight transfer protocol 'carrier-pigeon'; available: auto, broadcast, disk, rdt, sharded-disk, tensor"
        in stderr
    )


def test_first_party_protocol_name_says_which_package(tmp_path: Path) -> None:
    stderr = show_error("--plugin", "no:rdt", "--update-weight-transfer-mode", "rdt")
    assert "(miles-plugins-rdt is installed but provides no 'rdt' here: an older version, or blocked)" in stderr
    stderr = run_miles(
        "config", "show", "--update-weight-transfer-mode", "rdt", env={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"}
    ).stderr
    assert "unknown weight transfer protocol 'rdt'; available: auto, broadcast, disk, tensor (" in stderr


def test_unknown_model_implementation_lists_installed_ones() -> None:
    stderr = show_error("--model-impl", "llama=fast")
    assert "model.implementations.llama = 'fast' (--model-impl llama=fast)" in stderr
    assert "installed for llama: megatron, minimal, transformers" in stderr


def test_dsv4_impl_that_is_not_installed_lists_the_ones_that_are() -> None:
    stderr = show_error("--dsv4-impl", "megatron")
    assert "model.implementations.deepseek_v4 = 'megatron' (--dsv4-impl megatron)" in stderr
    assert "installed for deepseek_v4: miles, transformers;" in stderr  # the megatron plugin's and the core's
    assert "llama/minimal" in stderr


@pytest.mark.parametrize("value", ["llama", "=minimal", "llama="])
def test_model_impl_needs_family_equals_name(value: str) -> None:
    assert f"--model-impl expects KEY=VALUE, got {value!r}" in show_error("--model-impl", value)


def test_bad_family_name() -> None:
    assert "model.implementations.Llama-3" in show_error("--model-impl", "Llama-3=minimal")


def test_config_is_frozen_and_validated_at_construction() -> None:
    manager = MilesPluginManager.load()
    config = build_config(manager, overrides={"rollout.batch_size": "3"})
    assert config.rollout.batch_size == 3
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config.rollout.batch_size = 5  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"rollout\.batch_size = 0"):
        build_config(manager, overrides={"rollout.batch_size": 0})
    with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
        type(config.rollout)(unknown=1)


SECTION_PLUGIN = """\
import pydantic
from miles_core import ConfigError, hookimpl
from miles_core.config import ConfigFlag, Section

class CurriculumSection(Section):
    stages: int = pydantic.Field(default=1, ge=1)
    warmup_steps: int = pydantic.Field(default=0, ge=0)

@hookimpl
def config_sections():
    return {"curriculum": CurriculumSection}

@hookimpl
def config_flags():
    return [ConfigFlag(flag="--stages", path="curriculum.stages", help="curriculum stages")]

@hookimpl
def validate_config(config, registries):
    if config.curriculum.warmup_steps >= config.run.num_steps:
        raise ConfigError(
            f"curriculum.warmup_steps = {config.curriculum.warmup_steps} must be below run.num_steps = "
            f"{config.run.num_steps}"
        )
"""


def test_plugin_contributes_a_section_flags_and_cross_section_validation(tmp_path: Path) -> None:
    plugin = tmp_path / "curriculum_plugin.py"
    plugin.write_text(SECTION_PLUGIN)
    config = config_json("--plugin", str(plugin), "--stages", "3", "--curriculum-warmup-steps", "5")
    assert config["curriculum"] == {"stages": 3, "warmup_steps": 5}
    stderr = show_error("--plugin", str(plugin), "--curriculum-warmup-steps", "50", "--run-num-steps", "10")
    assert "curriculum.warmup_steps = 50 must be below run.num_steps = 10" in stderr
    assert "curriculum.stages = '0'" in show_error("--plugin", str(plugin), "--stages", "0")


def test_missing_first_party_protocol_names_the_package_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles_core import registry

    monkeypatch.setattr(registry, "_is_installed", lambda distribution: False)
    message = registry.unknown_name_message("weight_transfer_protocols", "rdt", ["disk", "tensor"])
    assert message == (
        "unknown weight transfer protocol 'rdt'; available: disk, tensor; "
        "'rdt' is provided by miles-plugins-rdt: pip install miles-plugins-rdt"
    )
