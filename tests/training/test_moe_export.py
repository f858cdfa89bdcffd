"""MoE weights leave the torch trainer under the HF checkpoint names (one tensor per expert), the names
``save_pretrained`` writes and SGLang loads, though transformers 5 holds the experts fused in memory: the weight
iterator, the checkpoints and the engines' checksums all use them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.sections import TrainSection
from miles_core.engines.weights import load_named_tensors, unique_named_tensors
from miles_core.models.hf_checkpoint import checkpoint_named_tensors
from miles_core.testkit.tiny_models import save_tiny_qwen3_moe, tiny_llama_config, tiny_qwen3_moe_config
from miles_core.training.batch import TrainBatch, TrainSample
from miles_core.training.weight_iterator import ModuleHfWeightIterator
from miles_core.weight_transfer.digests import checksum

CONFIGS = {
    "moe-untied": lambda: tiny_qwen3_moe_config(),
    "moe-tied": lambda: tiny_qwen3_moe_config(tie_word_embeddings=True),
    "moe-dense-first-layer": lambda: tiny_qwen3_moe_config(mlp_only_layers=[0]),
    "llama-tied": lambda: tiny_llama_config(tie_word_embeddings=True),
}


def saved(model: transformers.PreTrainedModel, directory: Path) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes for ``model``."""
    model.save_pretrained(directory)
    return load_file(str(directory / "model.safetensors"))


def exported(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    return dict(checkpoint_named_tensors(model, unique_named_tensors(model.state_dict().items())))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_checkpoint_names_are_those_save_pretrained_writes(tmp_path: Path, name: str) -> None:
    torch.manual_seed(0)
    created = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]())
    on_disk = saved(created, tmp_path / "created")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "created")  # carries its conversions
    for model in (created, loaded):
        ours = exported(model)
        assert sorted(ours) == sorted(on_disk)
        assert all(torch.equal(ours[key], tensor) for key, tensor in on_disk.items())
    if name.startswith("moe"):
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in on_disk
        assert not any(key.endswith("gate_up_proj") for key in on_disk)


def test_a_model_without_conversions_is_passed_on_without_copies() -> None:
    model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    state = model.state_dict()
    assert [(key, tensor.data_ptr()) for key, tensor in checkpoint_named_tensors(model)] == [
        (key, tensor.data_ptr()) for key, tensor in state.items()
    ]


def moe_batch() -> TrainBatch:
    generator = torch.Generator().manual_seed(4)
    samples = []
    for index in range(4):
        response = torch.randint(3, 64, (3,), generator=generator).tolist()
        samples.append(TrainSample([2, 5 + index], response, [-2.0, -2.5, -3.0], float(index % 2) - 0.5, 0.0))
    return TrainBatch(samples)


def test_the_torch_trainer_sends_and_saves_every_expert_by_its_checkpoint_name(tmp_path: Path) -> None:
    """After a step, the iterator's tensors are what ``save_pretrained`` would write, the checkpoint holds them, a
    model loaded from it gives the trainer's logits and resumes exactly, and an engine's model that takes the sent
    tensors serves weights of the same checksum."""
    model_dir = save_tiny_qwen3_moe(tmp_path / "model", seed=3)
    trainer = TorchTrainer.from_pretrained(model_dir, TrainSection(lr=0.05, optimizer="sgd"), seed=0)
    trainer.train_step(moe_batch())
    sent = [(key, tensor) for bucket in trainer.weight_iterator(16 << 10) for key, tensor in bucket]
    on_disk = saved(trainer.model.model, tmp_path / "reference")
    assert sorted(key for key, _ in sent) == sorted(on_disk)
    assert all(torch.equal(tensor, on_disk[key]) for key, tensor in sent)

    checkpoint = trainer.save_checkpoint(tmp_path / "step-1")
    written = load_file(str(checkpoint / "model.safetensors"))
    assert sorted(written) == sorted(on_disk) and all(torch.equal(written[k], t) for k, t in on_disk.items())
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, trainer.model(ids))  # the same weights, the same kernels
    resumed = TorchTrainer.from_pretrained(model_dir, TrainSection(lr=0.05, optimizer="sgd"), seed=0)
    resumed.load_checkpoint(checkpoint)
    assert checksum(resumed.weight_iterator(1 << 30).named_tensors()) == checksum(sent)

    engine_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()  # as a local engine loads
    load_named_tensors(engine_model, dict(sent))
    assert checksum(ModuleHfWeightIterator(engine_model, bucket_bytes=1).named_tensors()) == checksum(sent)
    with torch.no_grad():
        assert torch.equal(engine_model(ids).logits, trainer.model(ids))
