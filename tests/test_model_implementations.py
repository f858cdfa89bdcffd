"""Two implementations of the ``llama`` family load one HF checkpoint, export the same names and agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from miles_core.builtin.core_plugin import check_model_implementation
from miles_core.errors import MilesError
from miles_core.plugin_manager import MilesPluginManager


def save_tiny_checkpoint(path: Path, *, tie: bool, model_type: str = "llama") -> Path:
    """A random tiny HF checkpoint; every weight (norms included) is perturbed so no layout error hides."""
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[model_type]
    config = config_class(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie,
    )  # fmt: skip
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
