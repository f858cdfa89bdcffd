"""The optimizer every trainer builds from ``train.optimizer``, so the torch and Megatron trainers step alike."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

ADAM_BETAS = (0.9, 0.99)


def build_optimizer(parameters: Iterable[torch.nn.Parameter], settings: Any) -> torch.optim.Optimizer:
    """``AdamW`` (the default) or plain ``SGD`` over ``parameters``, from a ``TrainSection``'s settings.

    SGD's step is linear in the gradient, so two trainers whose gradients agree to float32 rounding also agree on the
    weights after a step; AdamW's first step divides each gradient by its own magnitude, which turns a rounding-level
    difference in a near-zero gradient into a step difference of up to ``2 * lr``.
    """
    if settings.optimizer == "sgd":
        return torch.optim.SGD(parameters, lr=settings.lr, weight_decay=settings.weight_decay)
    return torch.optim.AdamW(parameters, lr=settings.lr, weight_decay=settings.weight_decay, betas=ADAM_BETAS)
