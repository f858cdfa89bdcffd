"""Two implementations of the ``llama`` family load one HF checkpoint, export the same names and agree."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from miles_core.builtin.core_plugin import check_model_implementation
from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.cli.config_args import ConfigArguments
from miles_core.config.build import build_config
from miles_core.engines.weights import unique_named_tensors
from miles_core.errors import ConfigError, MilesError
from miles_core.plugin_manager import MilesPluginManager
from tests.conftest import config_json, plugins_json, run_miles, with_pythonpath


def save_tiny_checkpoint(path: Path, *, tie: bool, model_type: str = "llama") -> Path:
    """A random tiny HF checkpoint; every weight (norms included) is perturbed so no layout error hides."""
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[model_type]
    config = config_class(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def registries():
    return MilesPluginManager.load().registries


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_minimal_and_transformers_llama_agree(tmp_path: Path, registries, tie: bool) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", tie=tie)
    reference = check_model_implementation(registries, "llama", "transformers").load().from_pretrained(checkpoint)
    minimal = check_model_implementation(registries, "llama", "minimal").load().from_pretrained(checkpoint)
    assert type(minimal).__name__ == "MinimalLlama"

    reference_state, minimal_state = reference.hf_state_dict(), minimal.hf_state_dict()
    assert sorted(reference_state) == sorted(minimal_state)
    for name, tensor in reference_state.items():
        torch.testing.assert_close(minimal_state[name], tensor, rtol=0, atol=0, msg=name)

    input_ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, actual = reference(input_ids), minimal(input_ids)
    assert expected.shape == (3, 11, 97)
    assert (expected - actual).abs().max().item() < 1e-5


def test_minimal_llama_refuses_another_family(tmp_path: Path, registries) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / "qwen", tie=False, model_type="qwen2")
    minimal = check_model_implementation(registries, "llama", "minimal").load()
    with pytest.raises(MilesError, match="has model_type 'qwen2'"):
        minimal.from_pretrained(checkpoint)


def test_minimal_llama_refuses_mismatched_checkpoint(tmp_path: Path, registries) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", tie=False)
    config = json.loads((checkpoint / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (checkpoint / "config.json").write_text(json.dumps(config))
    minimal = check_model_implementation(registries, "llama", "minimal").load()
    with pytest.raises(MilesError, match=r"does not match its config: missing \['model.layers.2"):
        minimal.from_pretrained(checkpoint)


def test_transformers_impl_needs_a_checkpoint_directory(tmp_path: Path, registries) -> None:
    implementation = check_model_implementation(registries, "llama", "transformers").load()
    with pytest.raises(MilesError, match=r"has no config\.json"):
        implementation.from_pretrained(tmp_path)


# -- the transformers implementation serves every family; an implementation for another family is refused -------

TINY_CONFIGS = {
    "qwen3_moe": dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    ),
    "deepseek_v4": dict(
        vocab_size=97,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        q_lora_rank=16,
        o_lora_rank=16,
        num_experts_per_tok=2,
        n_routed_experts=4,
        n_shared_experts=1,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        max_position_embeddings=64,
    ),
}


def save_tiny_family(path: Path, family: str) -> Path:
    """A random tiny HF checkpoint of ``family``, one the core never listed by name."""
    config = transformers.CONFIG_MAPPING[family](**TINY_CONFIGS[family])
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def torch_trainer_for(manager: MilesPluginManager, checkpoint: Path, run_dir: Path, *flags: str):
    """The torch trainer that ``miles train --model CHECKPOINT FLAGS`` builds (config from the same flags)."""
    arguments = ConfigArguments(manager)
    parser = argparse.ArgumentParser()
    arguments.add_to(parser)
    overrides = arguments.overrides(parser.parse_args(["--model", str(checkpoint), "--train-kl-coef", "0", *flags]))
    config = build_config(manager, overrides=overrides)
    return TorchTrainer.for_run(
        config,
        model_path=checkpoint,
        initial_model_path=checkpoint,
        run_dir=run_dir,
        token="test",
        registries=manager.registries,
    )


def test_transformers_is_accepted_for_any_family_on_the_command_line() -> None:
    config = config_json(
        "--dsv4-impl", "transformers", "--model-impl", "qwen3_moe=transformers", "--model-impl", "mistral=transformers"
    )
    assert config["model"]["implementations"] == {
        "deepseek_v4": "transformers",
        "qwen3_moe": "transformers",
        "mistral": "transformers",
    }


def test_miles_plugins_lists_transformers_for_any_family() -> None:
    """``*/transformers`` serves every family; DeepSeek-V4's is listed by name too, beside its other implementation
    (``deepseek_v4/miles``, miles-plugins-megatron)."""
    provided = ["*/transformers", "deepseek_v4/transformers"]
    assert plugins_json()["core"]["provides"]["model_implementations"] == provided
    result = run_miles("plugins")
    assert result.returncode == 0, result.stderr
    core = next(row for row in result.stdout.splitlines() if row.startswith("core "))
    assert "model_implementations: transformers: any family transformers can load, deepseek_v4/transformers;" in core


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_torch_trainer_trains_any_family_with_transformers(tmp_path: Path, family: str) -> None:
    checkpoint = save_tiny_family(tmp_path / family, family)
    flag = ["--dsv4-impl", "transformers"] if family == "deepseek_v4" else ["--model-impl", f"{family}=transformers"]
    trainer = torch_trainer_for(MilesPluginManager.load(), checkpoint, tmp_path / "run", *flag)
    assert trainer.implementation == f"{family}/transformers"
    assert trainer.model.model.config.model_type == family
    # exported under the checkpoint's own names (MoE experts one by one, as on disk), not transformers' in-memory ones
    expected = load_file(str(checkpoint / "model.safetensors"))
    actual = dict(unique_named_tensors(trainer.model.hf_state_dict().items()))
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=0, msg=name)  # the same bytes, loaded twice


@pytest.mark.parametrize(
    "flags",
    [
        ("--model-impl", "qwen3=transformers"),
        ("--dsv4-impl", "transformers"),
        ("--model-impl", "qwen3_moe=transformers", "--model-impl", "qwen3=transformers"),
    ],
    ids=["qwen3", "dsv4", "one-matching-one-not"],
)
def test_an_implementation_for_another_family_is_refused(tmp_path: Path, flags: tuple[str, ...]) -> None:
    checkpoint = save_tiny_family(tmp_path / "moe", "qwen3_moe")
    with pytest.raises(ConfigError) as refused:
        torch_trainer_for(MilesPluginManager.load(), checkpoint, tmp_path / "run", *flags)
    message = str(refused.value)
    assert f"but the checkpoint {str(checkpoint)!r} is of model family 'qwen3_moe'" in message
    assert "so it would be ignored; choose the implementation of this model with --model-impl qwen3_moe=NAME" in message
    other = "'deepseek_v4' (--dsv4-impl transformers)" if "--dsv4-impl" in flags else "'qwen3' (--model-impl qwen3="
    assert f"model.implementations is set for {other}" in message


def test_miles_train_refuses_another_family_before_moving_the_earlier_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    result = run_miles("train", "--output-dir", str(run_dir), "--num-steps", "1", "--model-impl", "qwen2=transformers")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert (
        "model.implementations is set for 'qwen2' (--model-impl qwen2=transformers), but the default model "
        "(a tiny Llama) is of model family 'llama'"
    ) in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing moved aside
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_an_unknown_implementation_lists_those_installed_for_that_family(registries) -> None:
    with pytest.raises(ConfigError) as refused:
        check_model_implementation(registries, "qwen3_moe", "nope")
    assert "no such implementation of model family 'qwen3_moe'; installed for qwen3_moe: megatron, transformers;" in (
        str(refused.value)
    )


def test_a_family_implementation_shadowing_one_for_every_family_is_a_duplicate(plugin_dir: Path) -> None:
    (plugin_dir / "shadow.py").write_text(
        "from miles_core import hookimpl, model_implementation\n\n"
        "@hookimpl\ndef provide_model_implementations():\n"
        "    return [model_implementation('llama', 'transformers', 'os:getcwd')]\n"
    )
    result = run_miles("plugins", "--plugin", "shadow", env=with_pythonpath(plugin_dir))
    assert result.returncode == 2
    assert (
        "model implementations: 'transformers' is provided twice for family 'llama', by plugin 'core' "
        "('*/transformers', every family) and by plugin 'shadow' ('llama/transformers')"
    ) in result.stderr
