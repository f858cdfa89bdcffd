"""Tolerances for comparing two trainers' steps, derived from float32 rounding rather than from one machine's output.

Two float32 computations of one gradient that sum in different orders (tensor-parallel shards, the data-parallel
all-reduce, micro-batches, another BLAS kernel on another CPU) differ by at most about ``n * u * sum|terms|`` per
reduction, with ``u = 2**-24`` and ``n`` a few hundred terms in these tiny models. What that does to the weights
depends on the optimizer:

- SGD's step ``w - lr * g`` is linear in the gradient: the steps differ by ``lr`` times the gradient difference, plus
  one rounding of each ``w`` to float32. That is what :func:`assert_same_sgd_step` checks, tightly.
- AdamW's first step is ``lr * g / (|g| + eps)``: every element moves by at most ``lr``, but the sign and size of a
  near-zero gradient's step follow its rounding error, so two correct trainers may differ by up to ``2 * lr`` in such
  elements (seen: ``0.1 * lr`` on an Intel MKL machine). :func:`assert_within_first_adam_step` checks only what Adam
  guarantees.
"""

from __future__ import annotations

import torch

FLOAT32_UNIT_ROUNDOFF = 2.0**-24

GRADIENT_RTOL = 1e-4
"""Gradient agreement relative to a tensor's largest gradient: ``n * u`` is about 1e-5 for reductions of a few hundred
terms; 10x more for the chained reductions of two layers and the clipping factor (the global norm)."""


def assert_same_sgd_step(
    initial: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    actual: dict[str, torch.Tensor],
    *,
    gradient_rtol: float = GRADIENT_RTOL,
) -> None:
    """Weights after one SGD step from ``initial`` agree with ``reference``'s: step difference within
    ``gradient_rtol`` of the largest step of the tensor, plus the float32 rounding of each weight."""
    assert sorted(actual) == sorted(reference) == sorted(initial)
    for name, start in initial.items():
        expected_step, step = reference[name] - start, actual[name] - start
        rounding = 4 * FLOAT32_UNIT_ROUNDOFF * start.abs().max().item()  # each trainer rounds w once, then w - start
        bound = gradient_rtol * expected_step.abs().max().item() + rounding
        difference = (step - expected_step).abs().max().item()
        assert difference <= bound, f"{name}: steps differ by {difference:.3g}, more than {bound:.3g}"
        assert expected_step.abs().max().item() > 100 * rounding, f"{name}: the step is too small to compare"


def assert_within_first_adam_step(
    initial: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], *, lr: float
) -> None:
    """After one bias-corrected AdamW step (no weight decay), no element moved by more than ``lr``, and some moved."""
    for name, start in initial.items():
        moved = (actual[name] - start).abs()
        rounding = 2 * FLOAT32_UNIT_ROUNDOFF * start.abs().max().item()
        assert moved.max().item() <= lr * (1 + 1e-6) + rounding, f"{name}: moved {moved.max().item():.3g} > lr"
        assert moved.max().item() > 0.5 * lr, f"{name}: did not move"


def served_logprob_tolerance(dtype: torch.dtype, *, num_layers: int, largest_logit: float) -> float:
    """How far an engine computing in ``dtype`` may serve a token's logprob from the float32 trainer's.

    The engine rounds every weight and every activation to ``dtype`` (unit roundoff ``u = eps / 2``). Each layer
    does about four rounded products and sums (attention and MLP, each a projection in and out) on a residual stream
    that it adds to, so the logits carry a relative error of about ``4 * (num_layers + 1) * u`` (the embedding and
    the head count as one more layer), i.e. an absolute error of that times the largest logit. A logprob is a logit
    minus the log-sum-exp of all logits, each off by at most that much: twice the logit error bounds it.
    """
    unit_roundoff = torch.finfo(dtype).eps / 2
    return 2 * 4 * (num_layers + 1) * unit_roundoff * max(1.0, largest_logit)
