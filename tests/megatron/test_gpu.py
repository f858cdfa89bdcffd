"""The Megatron trainer on GPUs: NCCL between ranks and bfloat16 parameters. Skipped, with the reason, where no
CUDA device exists (this project's CI machines have none; run ``pytest -m gpu`` on a GPU machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_core.builtin.torch_trainer import TorchTrainer
from tests.megatron.test_megatron_trainer import (
    SETTINGS,
    SGD_SETTINGS,
    hf_weights,
    launch,
    perturbed_checkpoint,
    training_batch,
)
from tests.numerics import assert_same_sgd_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL and bf16 run only on GPUs)"),
]


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_nccl_step_equals_the_torch_trainer_in_float32(tmp_path: Path, tensor_parallel: int) -> None:
    if gpus() < tensor_parallel:
        pytest.skip(f"needs {tensor_parallel} CUDA devices, found {gpus()}")
    path = perturbed_checkpoint(tmp_path / "llama", "llama", tie_word_embeddings=False)
    reference = TorchTrainer.from_pretrained(path, SGD_SETTINGS)
    initial = hf_weights(reference)
    expected = reference.train_step(training_batch())
    with launch(
        path, tmp_path, train=SGD_SETTINGS, tensor_parallel=tensor_parallel, distributed_backend="nccl"
    ) as trainer:
        metrics = trainer.train_step(training_batch())
        weights = hf_weights(trainer)
    assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-3, abs=1e-4)  # TF32/cuBLAS vs CPU kernels
    # cuBLAS may multiply in TF32 (a 10-bit mantissa, u = 2**-11): gradients agree to about 1e-3 of their scale
    assert_same_sgd_step(initial, hf_weights(reference), weights, gradient_rtol=1e-2)


def test_bfloat16_parameters_train_and_export_in_bfloat16(tmp_path: Path) -> None:
    path = perturbed_checkpoint(tmp_path / "qwen3", "qwen3", tie_word_embeddings=False, head_dim=24)
    reference = TorchTrainer.from_pretrained(path, SETTINGS).train_step(training_batch())
    with launch(
        path, tmp_path, tensor_parallel=min(2, gpus()), distributed_backend="nccl", dtype="bfloat16"
    ) as trainer:
        metrics = trainer.train_step(training_batch())
        weights = hf_weights(trainer)
    assert all(tensor.dtype == torch.bfloat16 for tensor in weights.values())
    assert metrics["loss"] == pytest.approx(reference["loss"], abs=0.05)  # bf16 logits: a few 1e-3 per token
    assert torch.isfinite(torch.tensor(metrics["grad_norm"]))
