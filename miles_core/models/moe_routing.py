"""Routing capture and replay on transformers Mixture-of-Experts models (Qwen3-MoE's ``Qwen3MoeTopKRouter``,
DeepSeek-V3's ``DeepseekV3TopkRouter``).

:class:`RoutingCapture` records the experts each token was routed to (the local engine reports them);
:func:`replay_routing` makes a forward route each token to given experts (the torch trainer's routing replay): the
router's top-k choice is replaced by the recorded ids while the routing weights are still computed from the current
router logits at those experts exactly as the router computes them for its own choice (so gradients reach the router
as usual): Qwen3-MoE's softmax over all experts, renormalised over the chosen ones with ``norm_topk_prob``;
DeepSeek-V3's sigmoid scores (the selection bias and the group limit only choose, so a recorded choice skips them),
renormalised with ``norm_topk_prob`` and scaled by ``routed_scaling_factor``. Both work by
forward hooks on each sparse layer's ``mlp.gate``; the routed-experts layout is
:mod:`miles_core.engines.routed_experts`'s.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from miles_core.engines.routed_experts import RoutedExpertsError, RoutingShape, check_replayable
from miles_core.errors import MilesError


def _softmax_weights(router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE's routing weights at ``indices`` (as ``Qwen3MoeTopKRouter.forward``)."""
    weights = torch.softmax(logits, dtype=torch.float, dim=-1).gather(-1, indices)
    return weights / weights.sum(dim=-1, keepdim=True) if router.norm_topk_prob else weights


def _sigmoid_weights(router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's routing weights at ``indices`` (as ``DeepseekV3TopkRouter.forward``)."""
    weights = logits.sigmoid().gather(1, indices)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


ROUTING_WEIGHTS: dict[type[torch.nn.Module], Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    Qwen3MoeTopKRouter: _softmax_weights,
    DeepseekV3TopkRouter: _sigmoid_weights,
}
"""Each supported router class (its output ``(router_logits, routing_weights, selected_experts)``) and how it weighs
chosen experts from its logits."""
ROUTER_CLASSES: tuple[type[torch.nn.Module], ...] = tuple(ROUTING_WEIGHTS)
_GATE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")


def moe_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Each sparse layer's router by its decoder-layer index (``...layers.I.mlp.gate``); empty for a dense model. A
    router of another kind is a :class:`MilesError` naming it: its routing cannot be captured or replayed."""
    routers: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        match = _GATE_NAME.search(name)
        if match is None:
            continue
        if not isinstance(module, ROUTER_CLASSES):
            if "Router" in type(module).__name__ or hasattr(module, "top_k"):
                known = ", ".join(cls.__name__ for cls in ROUTER_CLASSES)
                raise MilesError(
                    f"routing capture and replay support the routers {known}; {name} is a "
                    f"{type(module).__name__}: turn --train-routing-replay off for this model"
                )
            continue
        routers[int(match.group(1))] = module
    return routers


class RoutingCapture:
    """Hooks that keep the experts every router of ``model`` chose in its latest forward (references, no copy);
    :meth:`experts` assembles them. Remove the hooks with :meth:`close`."""

    def __init__(self, model: torch.nn.Module, shape: RoutingShape) -> None:
        self.shape = shape
        self.routers = moe_routers(model)
        self.latest: dict[int, torch.Tensor] = {}
        self._handles = [
            router.register_forward_hook(self._hook(layer)) for layer, router in sorted(self.routers.items())
        ]

    def _hook(self, layer: int):
        def keep(module: torch.nn.Module, args: tuple, output: tuple) -> None:
            self.latest[layer] = output[2].detach()

        return keep

    def experts(self, rows: int, columns: int) -> torch.Tensor:
        """The latest forward's choice as ``[rows, columns, layers, top_k]`` int32 on the CPU (a dense layer's ids
        are zeros), for a forward of ``rows x columns`` tokens."""
        out = torch.zeros((rows, columns, self.shape.num_layers, self.shape.top_k), dtype=torch.int32)
        for layer in self.routers:
            chosen = self.latest.get(layer)
            if chosen is None or chosen.shape[0] != rows * columns:
                raise MilesError(f"layer {layer}'s router saw no forward of {rows}x{columns} tokens to capture")
            out[:, :, layer] = chosen.reshape(rows, columns, -1).to("cpu", torch.int32)
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, experts: torch.Tensor) -> Iterator[None]:
    """Within the block, every forward of ``model`` over ``[B, T]`` tokens routes token ``(b, t)`` of each sparse
    layer ``l`` to ``experts[b, t, l]`` (``[B, T, layers, top_k]``), the weights from the current router logits;
    a token whose ids are :data:`NOT_ROUTED` (-1) routes by its own top-k. Ids out of the model's range, or a
    shape that does not fit the model or the forward, are a :class:`RoutedExpertsError`."""
    routers = moe_routers(model)
    if not routers:
        raise RoutedExpertsError("routing replay needs a Mixture-of-Experts model: this one has no router")
    top_k, num_experts = next(iter(routers.values())).top_k, next(iter(routers.values())).num_experts
    check_replayable(experts, last_layer=max(routers), top_k=top_k, num_experts=num_experts)
    handles = [router.register_forward_hook(_replay_hook(experts[:, :, layer])) for layer, router in routers.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _replay_hook(target: torch.Tensor):
    """A router's forward hook that swaps its choice for ``target`` (``[B, T, top_k]``, -1: keep its own)."""

    def replay(router: torch.nn.Module, args: tuple, output: tuple) -> tuple:
        logits, _, chosen = output
        wanted = target.reshape(-1, target.shape[-1]).to(chosen.device)
        if wanted.shape[0] != chosen.shape[0]:
            raise RoutedExpertsError(
                f"routed experts for {wanted.shape[0]} tokens, the forward has {chosen.shape[0]}: give one row per "
                "token of the batch"
            )
        recorded = (wanted >= 0).all(-1, keepdim=True)
        indices = torch.where(recorded, wanted.to(chosen.dtype), chosen)
        weights = ROUTING_WEIGHTS[type(router)](router, logits, indices)
        return logits, weights.to(logits.dtype), indices

    return replay
