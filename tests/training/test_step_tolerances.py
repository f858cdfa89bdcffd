"""Why cross-trainer weight checks step with SGD: a rounding-level gradient difference, as two BLAS kernels produce,
moves AdamW's first step by a large fraction of ``lr`` but SGD's by only ``lr`` times that difference."""

from __future__ import annotations

import pytest
import torch

from tests.numerics import FLOAT32_UNIT_ROUNDOFF, assert_same_sgd_step, assert_within_first_adam_step

LR = 1e-3


def one_step(optimizer_name: str, initial: torch.Tensor, gradient: torch.Tensor, lr: float) -> torch.Tensor:
    weight = torch.nn.Parameter(initial.clone())
    optimizer = torch.optim.AdamW([weight], lr=lr, weight_decay=0.0, betas=(0.9, 0.99))
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD([weight], lr=lr)
    weight.grad = gradient.clone()
    optimizer.step()
    return weight.detach()


@pytest.fixture
def gradients() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight, its gradient (some elements near zero, from cancellation) and the same gradient as another kernel
    computes it: a difference of a few units of float32 rounding of the gradient's scale."""
    generator = torch.Generator().manual_seed(0)
    initial = torch.randn(64, 64, generator=generator) * 0.1
    gradient = torch.randn(64, 64, generator=generator) * 1e-3
    gradient[:4] = torch.randn(4, 64, generator=generator) * 1e-9  # cancellations leave rounding-level gradients
    scale = gradient.abs().max()
    other_kernel = gradient + torch.randn(64, 64, generator=generator) * 8 * FLOAT32_UNIT_ROUNDOFF * scale
    return initial, gradient, other_kernel


def test_rounding_level_gradient_differences_move_adam_steps_by_a_fraction_of_lr(gradients) -> None:
    initial, gradient, other_kernel = gradients
    adam_difference = (one_step("adamw", initial, gradient, LR) - one_step("adamw", initial, other_kernel, LR)).abs()
    assert adam_difference.max().item() > 0.05 * LR  # the old bound: it held only where kernels happened to agree


def test_the_sgd_step_check_accepts_rounding_level_differences(gradients) -> None:
    initial, gradient, other_kernel = gradients
    name = "weight"
    reference = {name: one_step("sgd", initial, gradient, lr=0.1)}
    assert_same_sgd_step({name: initial}, reference, {name: one_step("sgd", initial, other_kernel, lr=0.1)})


@pytest.mark.parametrize("defect", ["scaled gradient", "one wrong element", "transposed shard"])
def test_the_sgd_step_check_catches_a_wrong_gradient(gradients, defect: str) -> None:
    initial, gradient, _ = gradients
    wrong = {"scaled gradient": gradient * 1.01, "transposed shard": gradient.t().contiguous()}.get(defect)
    if wrong is None:
        wrong = gradient.clone()
        wrong[10, 10] += gradient.abs().max() * 0.01
    reference = {"weight": one_step("sgd", initial, gradient, lr=0.1)}
    with pytest.raises(AssertionError, match="steps differ"):
        assert_same_sgd_step({"weight": initial}, reference, {"weight": one_step("sgd", initial, wrong, lr=0.1)})


def test_the_adam_check_holds_for_any_gradient_and_catches_a_doubled_step(gradients) -> None:
    initial, gradient, other_kernel = gradients
    for candidate in (gradient, other_kernel, gradient * 1e6):
        assert_within_first_adam_step({"w": initial}, {"w": one_step("adamw", initial, candidate, LR)}, lr=LR)
    with pytest.raises(AssertionError, match="> lr"):
        assert_within_first_adam_step({"w": initial}, {"w": one_step("adamw", initial, gradient, 2 * LR)}, lr=LR)
