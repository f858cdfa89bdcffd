"""Resetting an optimizer's moment estimates (``--train-reset-optimizer-states``), dispatched on each leaf
optimizer's class.

A trainer's optimizer may be a plain torch optimizer or a tree of them: a chain (megatron-core's
``ChainedOptimizer`` holds ``.chained_optimizers``; a list or tuple counts as one too) or a wrapper holding the
optimizer that really steps as ``.optimizer`` (megatron-core's mixed-precision and distributed optimizers, whose
inner torch optimizer steps fp32 master copies of the weights). :func:`reset_optimizer_states` walks that tree and
resets each leaf with the handler registered for its class (:func:`reset_leaf_optimizer`, a
:func:`functools.singledispatch`, so a subclass uses its nearest registered base's handler). Only the leaves'
``state`` is touched: parameters, master parameters and ``param_groups`` (learning rates) stay as they are.

A reset leaves each leaf as a freshly built optimizer would be before its first step: Adam's and AdamW's moments
are zeros and their step count 0 (in place, so the memory stays allocated and every reference to it stays valid);
SGD's momentum buffer is dropped, since its first step initialises the buffer to the gradient itself (zeros would
instead give ``(1 - dampening) * gradient``). An optimizer class without a handler is an error naming it and the
known ones: silently keeping stale moments would be worse than stopping. :func:`register_optimizer_reset` adds a
handler.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from miles_core.errors import MilesError

MAX_DEPTH = 32
"""Nesting beyond this is refused: real optimizer trees are two or three levels deep."""

ADAM_STATE_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
SGD_STATE_KEYS = frozenset({"momentum_buffer"})


class OptimizerResetError(MilesError):
    """An optimizer (or something in its state) that :func:`reset_optimizer_states` does not know how to reset."""


def reset_optimizer_states(optimizer: Any) -> int:
    """Reset the moment estimates of every leaf optimizer under ``optimizer``; returns how many leaves were reset.

    Every leaf's class is checked before any leaf is reset, so an unknown optimizer class changes nothing (a known
    class whose state holds a key its handler does not reset is refused when its turn comes).
    """
    leaves = list(leaf_optimizers(optimizer))
    for leaf in leaves:
        _require_handler(leaf)
    for leaf in leaves:
        reset_leaf_optimizer(leaf)
    return len(leaves)


def leaf_optimizers(optimizer: Any) -> Iterator[Any]:
    """The leaf optimizers of a tree of chains and wrappers, depth first, each once.

    A leaf is an object whose class has a reset handler, or any ``torch.optim.Optimizer``; a chain holds
    ``.chained_optimizers`` or is a list or tuple; a wrapper holds ``.optimizer``. Anything else is yielded as a leaf
    (which :func:`reset_leaf_optimizer` refuses). A leaf reached twice (two wrappers of one optimizer) is yielded
    once; a chain or wrapper that contains itself, or nesting deeper than :data:`MAX_DEPTH`, is an
    :class:`OptimizerResetError`.
    """
    yield from _leaves(optimizer, ancestors=[], seen=set())


def _leaves(node: Any, *, ancestors: list[Any], seen: set[int]) -> Iterator[Any]:
    if any(node is ancestor for ancestor in ancestors):
        raise OptimizerResetError(
            f"the optimizer contains itself (an object of class {_qualname(type(node))} inside its own chain or "
            "wrapper): pass the trainer's optimizer, a tree of chains and wrappers of torch optimizers"
        )
    if len(ancestors) > MAX_DEPTH:
        raise OptimizerResetError(
            f"the optimizer is nested more than {MAX_DEPTH} levels deep (at an object of class "
            f"{_qualname(type(node))}): pass the trainer's optimizer, a tree of chains and wrappers of torch optimizers"
        )
    if id(node) in seen:
        return
    seen.add(id(node))
    inner = [*ancestors, node]
    if _has_handler(node) or isinstance(node, torch.optim.Optimizer):
        yield node
    elif hasattr(node, "chained_optimizers") or isinstance(node, list | tuple):
        for child in node if isinstance(node, list | tuple) else node.chained_optimizers:
            yield from _leaves(child, ancestors=inner, seen=seen)
    elif hasattr(node, "optimizer"):
        yield from _leaves(node.optimizer, ancestors=inner, seen=seen)
    else:
        yield node  # no handler: reported with the known classes


@functools.singledispatch
def reset_leaf_optimizer(optimizer: Any) -> None:
    """Reset one leaf optimizer's state in place (dispatched on its class; this fallback is the error)."""
    known = ", ".join(known_optimizer_classes())
    raise OptimizerResetError(
        f"cannot reset the state of an optimizer of class {_qualname(type(optimizer))}: the known classes are "
        f"{known}; register a handler with miles_core.training.optimizer_reset.register_optimizer_reset, or run "
        "without --train-reset-optimizer-states"
    )


def register_optimizer_reset(cls: type, handler: Callable[[Any], None]) -> None:
    """Reset leaf optimizers of ``cls`` (and its subclasses without a handler of their own) with
    ``handler(optimizer)``, which must leave the optimizer as a fresh one before its first step and touch no
    parameter."""
    reset_leaf_optimizer.register(cls, handler)


def known_optimizer_classes() -> list[str]:
    """The qualified names of the classes with a reset handler, sorted."""
    return sorted(_qualname(cls) for cls in reset_leaf_optimizer.registry if cls is not object)


def _reset_adam(optimizer: torch.optim.Optimizer) -> None:
    """Adam and AdamW: first and second moments (and AMSGrad's maximum) to zeros, the step count to 0."""
    for state in _states(optimizer, ADAM_STATE_KEYS):
        with torch.no_grad():
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key in state:
                    state[key].zero_()
        if "step" in state:
            step = state["step"]
            if isinstance(step, torch.Tensor):
                step.zero_()
            else:
                state["step"] = 0


def _reset_sgd(optimizer: torch.optim.Optimizer) -> None:
    """SGD: the momentum buffer dropped (SGD's first step starts it from the gradient)."""
    for state in _states(optimizer, SGD_STATE_KEYS):
        state.pop("momentum_buffer", None)


def _states(optimizer: torch.optim.Optimizer, known_keys: frozenset[str]) -> list[dict[str, Any]]:
    """The optimizer's per-parameter states, refused whole if one holds a key the handler does not reset (a
    subclass's extra moment would otherwise survive the reset)."""
    states = list(optimizer.state.values())
    for state in states:
        unknown = sorted(set(state) - known_keys)
        if unknown:
            raise OptimizerResetError(
                f"the state of the {_qualname(type(optimizer))} optimizer holds {unknown}, which the reset of "
                f"{sorted(known_keys)} does not know: register a handler for its class with "
                "miles_core.training.optimizer_reset.register_optimizer_reset"
            )
    return states


def _has_handler(node: Any) -> bool:
    return reset_leaf_optimizer.dispatch(type(node)) is not reset_leaf_optimizer.dispatch(object)


def _require_handler(leaf: Any) -> None:
    if not _has_handler(leaf):
        reset_leaf_optimizer(leaf)  # the fallback: raises, naming the class and the known ones


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


register_optimizer_reset(torch.optim.Adam, _reset_adam)
register_optimizer_reset(torch.optim.AdamW, _reset_adam)
register_optimizer_reset(torch.optim.SGD, _reset_sgd)
