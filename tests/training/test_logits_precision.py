"""``--train-logits-dtype``: policy logprobs and entropy in float32 (the logits upcast, the default) or in the model's
dtype. Tolerances come from the unit roundoff of each dtype: bfloat16 keeps 8 significant bits (``u = 2**-8``),
float32 24 (``u = 2**-24``)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import transformers

from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.sections import TrainSection
from miles_core.testkit.tiny_models import tiny_llama_config
from miles_core.training.batch import TrainBatch, TrainSample
from miles_core.training.losses import entropy, logits_dtype, token_logprobs
from tests.conftest import config_json
from tests.test_config_cli import show_error

BF16_UNIT_ROUNDOFF = torch.finfo(torch.bfloat16).eps / 2  # 2**-8: 8 significant bits
FLOAT32_UNIT_ROUNDOFF = torch.finfo(torch.float32).eps / 2  # 2**-24
VOCAB = 512


def bf16_logits() -> tuple[torch.Tensor, torch.Tensor]:
    """A bfloat16 model's logits ``[4, 32, VOCAB]`` (values of a few units, as a trained head gives) and targets."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 32, VOCAB, generator=generator) * 4).to(torch.bfloat16)
    return logits, torch.randint(0, VOCAB, (4, 32), generator=generator)


def float64_reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact (float64) logprobs of the targets and the log-sum-exp per position."""
    exact = logits.double()
    logprobs = torch.log_softmax(exact, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logprobs, torch.logsumexp(exact, dim=-1)


def float32_bound(logits: torch.Tensor, logprobs: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """First-order bound on a float32 log-softmax's error at bf16 inputs: each ``x - max`` rounded once (at most
    the logits' range), ``exp`` and the running sum of ``V`` terms (at most ``V`` roundings, the worst case of a
    recursive sum), the ``log`` of that sum and the final difference, each ``u`` times its magnitude."""
    exact = logits.double()
    largest = exact.max(dim=-1).values
    spread = largest - exact.min(dim=-1).values
    terms = VOCAB + 2 + 2 * spread + (lse - largest).abs() + logprobs.abs()
    return FLOAT32_UNIT_ROUNDOFF * terms * 1.01  # 1 % for the second-order terms


def test_model_dtype_logprobs_differ_from_float32_by_bf16_rounding_at_most() -> None:
    """In bfloat16, a logprob ``x - lse`` is at worst rounded twice: the log-sum-exp (error ``u * |lse|``) and the
    difference (``u * |logprob|``); the float32 result adds its own, far smaller, error."""
    logits, targets = bf16_logits()
    in_float32 = token_logprobs(logits, targets)
    in_model_dtype = token_logprobs(logits, targets, dtype=logits_dtype("model"))
    assert in_float32.dtype == torch.float32 and in_model_dtype.dtype == torch.bfloat16
    assert entropy(logits).dtype == torch.float32 and entropy(logits, dtype=None).dtype == torch.bfloat16
    reference, lse = float64_reference(logits, targets)
    u = BF16_UNIT_ROUNDOFF
    bound = u * (lse.abs() + reference.abs()) * (1 + u) + float32_bound(logits, reference, lse)
    difference = (in_model_dtype.double() - in_float32.double()).abs()
    assert (difference <= bound).all(), f"worst excess {(difference - bound).max().item():.3g}"
    assert difference.max() > 0  # the model-dtype path really rounds to bf16


def test_float32_logprobs_equal_a_float64_reference_within_float32_rounding() -> None:
    logits, targets = bf16_logits()
    reference, lse = float64_reference(logits, targets)
    error = (token_logprobs(logits, targets).double() - reference).abs()
    assert (error <= float32_bound(logits, reference, lse)).all(), f"largest error {error.max().item():.3g}"
    assert float32_bound(logits, reference, lse).max() < BF16_UNIT_ROUNDOFF * 0.1  # and far below bf16's


def training_batch() -> TrainBatch:
    generator = torch.Generator().manual_seed(1)
    samples = []
    for index in range(6):
        response = torch.randint(3, 64, (3,), generator=generator).tolist()
        samples.append(TrainSample([2, 5 + index], response, [-2.0, -2.5, -3.0], float(index % 3 - 1), 0.0))
    return TrainBatch(samples)


def step(dtype: torch.dtype, **settings: Any) -> tuple[dict[str, float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config()).to(dtype)
    trainer = TorchTrainer(model, TrainSection(lr=1e-2, **settings))
    metrics = trainer.train_step(training_batch())
    return metrics, [param.detach().clone() for param in trainer.model.parameters()]


def test_model_dtype_of_a_float32_model_is_the_float32_step_exactly() -> None:
    default_metrics, default_weights = step(torch.float32)
    model_metrics, model_weights = step(torch.float32, logits_dtype="model")
    assert model_metrics == default_metrics
    assert all(torch.equal(a, b) for a, b in zip(default_weights, model_weights, strict=True))


def test_a_bf16_model_s_entropy_in_its_own_dtype_is_within_bf16_rounding_of_float32() -> None:
    """The tiny model's logits are near 0, so every logprob is near ``-log V`` and the entropy near ``L = log V``.
    Each logprob carries at most ``2 u L`` (two roundings, above); the entropy ``-sum p * logprob`` carries that
    through ``p = exp(logprob)`` and the product (``2 u L * (1 + L)``) plus three roundings of each term and the
    final one (``4 u L``). ``L`` is taken one unit larger for logits that are not exactly 0."""
    float32_metrics, _ = step(torch.bfloat16)
    model_metrics, _ = step(torch.bfloat16, logits_dtype="model")
    big_l = math.log(tiny_llama_config().vocab_size) + 1
    u = BF16_UNIT_ROUNDOFF
    difference = abs(model_metrics["entropy"] - float32_metrics["entropy"])
    assert 0 < difference <= 2 * u * big_l * (1 + big_l) + 4 * u * big_l


def test_the_logits_dtype_flag() -> None:
    assert config_json("--train-logits-dtype", "model")["train"]["logits_dtype"] == "model"
    assert config_json()["train"]["logits_dtype"] == "float32"
    error = show_error("--train-logits-dtype", "bf16")
    assert "train.logits_dtype = 'bf16': Input should be 'float32' or 'model'" in error
    with pytest.raises(ValueError, match=r"allowed are \['float32', 'model'\]"):
        logits_dtype("bfloat16")
