"""LoRA in the torch trainer (peft): the settings and their refusals, a frozen base, the adapter in peft's format, the
merged weights, and resume of the adapter with its optimizer."""

from __future__ import annotations

from pathlib import Path

import peft
import pydantic
import pytest
import torch
import transformers

from miles_core.builtin.torch_trainer import ADAPTER_DIR, TorchTrainer
from miles_core.config.sections import TrainSection
from miles_core.engines.weights import unique_named_tensors
from miles_core.errors import ConfigError, MilesError
from miles_core.testkit.tiny_models import save_tiny_llama, tiny_llama_config
from miles_core.training.lora import adapter_digest, adapter_tensors, check_target_modules
from miles_core.weight_transfer.digests import checksum
from tests.training.test_torch_trainer import batch

LORA = dict(lora_rank=4, lora_alpha=8.0, lr=1e-2)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return save_tiny_llama(tmp_path / "model", seed=3)


def lora_trainer(model_dir: Path, **settings: object) -> TorchTrainer:
    return TorchTrainer.from_pretrained(model_dir, TrainSection(**{**LORA, **settings}))


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"lora_rank": 0}, "greater than or equal to 1"),
        ({"lora_rank": -2}, "greater than or equal to 1"),
        ({"lora_alpha": 16.0}, "lora_alpha set without lora_rank"),
        ({"lora_rank": 4, "lora_dropout": 1.0}, "less than 1"),
        ({"lora_rank": 4, "lora_alpha": 0}, "greater than 0"),
        ({"lora_rank": 4, "lora_target_modules": []}, "at least 1 item"),
    ],
)
def test_bad_lora_settings_are_refused(settings: dict, match: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=match):
        TrainSection(**settings)


def test_lora_settings_survive_a_dump_and_validation_again() -> None:
    """The Megatron ranks validate the driver's dumped section again: every field set, LoRA off stays valid."""
    for section in (TrainSection(), TrainSection(lora_rank=4, lora_target_modules="q_proj, v_proj")):
        again = TrainSection.model_validate(section.model_dump())
        assert again == section
    assert TrainSection(lora_rank=4, lora_target_modules="q_proj, v_proj").lora_target_modules == ["q_proj", "v_proj"]


def test_a_target_module_matching_no_layer_is_refused_naming_the_layers() -> None:
    config = tiny_llama_config()
    check_target_modules(config, ("q_proj", "down_proj"))  # both exist
    check_target_modules(config, ("all-linear",))
    with pytest.raises(ConfigError, match=r"'query_key_value' matches no linear layer .*q_proj") as raised:
        check_target_modules(config, ("q_proj", "query_key_value"))
    assert "\n" not in str(raised.value)
    with pytest.raises(ConfigError, match="is a preset; give it alone"):
        check_target_modules(config, ("all-linear", "q_proj"))


def test_only_the_adapter_trains_and_the_base_never_changes(model_dir: Path, tmp_path: Path) -> None:
    trainer = lora_trainer(model_dir)
    trained = trainer.trained_parameters()
    assert trained and all(".lora_" in name for name, p in trainer.model.named_parameters() if p.requires_grad)
    assert {id(p) for group in trainer.optimizer.param_groups for p in group["params"]} == {id(p) for p in trained}
    base_before = checksum(transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items())
    adapter_before = adapter_digest(trainer.adapter_tensors())
    for seed in (1, 2, 3):
        trainer.train_step(batch(seed))
    saved = trainer.save_checkpoint(tmp_path / "step_000003")  # a LoRA checkpoint holds the base as it is now
    assert checksum(transformers.AutoModelForCausalLM.from_pretrained(saved).state_dict().items()) == base_before
    assert adapter_digest(trainer.adapter_tensors()) != adapter_before


def test_the_saved_adapter_loads_with_peft_and_gives_the_trainer_s_logprobs(model_dir: Path, tmp_path: Path) -> None:
    trainer = lora_trainer(model_dir)
    for seed in (1, 2):
        trainer.train_step(batch(seed))
    digest = trainer.save_adapter(tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert adapter_digest(adapter_tensors(loaded)) == digest
    ids = torch.tensor([[2, 7, 9, 11, 13]])
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(ids)
        actual = loaded(input_ids=ids).logits
    # the same float32 operations on the same numbers in the same order: equal to the last bit
    assert torch.equal(actual, expected)
    with torch.no_grad(), loaded.disable_adapter():
        assert not torch.equal(loaded(input_ids=ids).logits, expected)  # the adapter changes what is served


def test_merged_weights_are_peft_s_merge(model_dir: Path) -> None:
    """The weights sent to engines without adapters: base + (alpha / rank) B A, as peft's merge computes them."""
    trainer = lora_trainer(model_dir)
    trainer.train_step(batch(1))
    merged = dict(trainer.weight_iterator(1 << 30).named_tensors())
    reference = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(model_dir), _saved(trainer, model_dir.parent / "a")
    ).merge_and_unload()
    expected = dict(unique_named_tensors(reference.state_dict().items()))  # tied tensors sent once
    assert sorted(merged) == sorted(expected)
    for name, tensor in merged.items():
        # one float32 addition of the same delta on both sides
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=4 * 2.0**-24 * tensor.abs().max().item())


def _saved(trainer: TorchTrainer, directory: Path) -> Path:
    trainer.save_adapter(directory)
    return directory


def test_resume_continues_the_adapter_and_its_optimizer(model_dir: Path, tmp_path: Path) -> None:
    original = lora_trainer(model_dir)
    original.train_step(batch(1))
    checkpoint = original.save_checkpoint(tmp_path / "step_000001")
    assert (checkpoint / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    assert (checkpoint / "model.safetensors").is_file()  # the unchanged base: the directory is a --model
    resumed = lora_trainer(checkpoint)  # a resumed run builds its trainer from the checkpoint's base
    assert resumed.load_checkpoint(checkpoint)["step"] == 1
    assert adapter_digest(resumed.adapter_tensors()) == adapter_digest(original.adapter_tensors())
    moments = [state["exp_avg"] for state in resumed.optimizer.state.values()]
    # Adam's moments came back, one per adapter tensor (A's are zero after a first step: B starts at zero)
    assert len(moments) == len(resumed.trained_parameters()) and any(m.abs().sum() > 0 for m in moments)
    original.train_step(batch(2))
    resumed.train_step(batch(2))
    for name, tensor in original.adapter_tensors().items():
        # the same adapter, moments and batch give the same step (a fresh optimizer would step by about lr)
        torch.testing.assert_close(resumed.adapter_tensors()[name], tensor, msg=name)


def test_resume_refuses_an_adapter_of_another_rank(model_dir: Path, tmp_path: Path) -> None:
    checkpoint = lora_trainer(model_dir).save_checkpoint(tmp_path / "step_000001")
    with pytest.raises(Exception, match="cannot resume from the checkpoint"):
        lora_trainer(checkpoint, lora_rank=8).load_checkpoint(checkpoint)


def test_an_adapter_on_a_tied_head_is_not_merged_silently(tmp_path: Path) -> None:
    """A tied head's merged weight would be the embedding's (a checkpoint stores it once): refused, saying why."""
    model_dir = save_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    trainer = lora_trainer(model_dir, lora_target_modules=["q_proj", "lm_head"])
    trainer.train_step(batch(1))
    with pytest.raises(MilesError, match="adapter of lm_head cannot be merged: its weight is tied"):
        dict(trainer.weight_iterator(1 << 30).named_tensors())
    assert trainer.save_adapter(tmp_path / "adapter")  # the adapter itself is sent and saved as it is
