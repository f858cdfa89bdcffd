"""Routing replay (R3) on megatron-core's MoE layers: each ``TopKRouter`` routes every token to the experts the
engine recorded for it, the probabilities still computed from the current router logits at those experts.

megatron-core 0.16 has a hook for this: ``TopKRouter.router_replay`` (set when ``moe_enable_routing_replay`` is on)
is asked for the top-k of every forward (``RouterReplay.get_replay_topk``). Its own ``RouterReplay`` keeps one
global list of instances and replays every token; :class:`RecordedRouting` takes its place on each router of one
model, and lets tokens without recorded routing (:data:`NOT_ROUTED`: padding, the last token) take their own top-k.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

import torch

from miles_core import RoutedExpertsError, check_replayable

_ROUTER_NAME = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.mlp\.router$")


class RecordedRouting:
    """Stands in for megatron-core's ``RouterReplay`` on one router: with ``target`` set (``[tokens, top_k]`` in the
    router's token order, sequence-major), each token with recorded ids takes them, the others their own top-k."""

    def __init__(self) -> None:
        self.target: torch.Tensor | None = None

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``RouterReplay.get_replay_topk``: the top-k values of ``scores`` and their expert ids."""
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return values, indices
        target = self.target.to(scores.device)
        if target.shape != indices.shape:
            raise RoutedExpertsError(
                f"routed experts for {list(target.shape)} [tokens, top_k], the router has {list(indices.shape)}"
            )
        indices = torch.where((target >= 0).all(-1, keepdim=True), target.to(indices.dtype), indices)
        return scores.gather(1, indices), indices


def routers_by_layer(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Each MoE layer's ``TopKRouter`` by its decoder-layer index (``decoder.layers.I.mlp.router``)."""
    return {
        int(match.group(1)): module
        for name, module in model.named_modules()
        if (match := _ROUTER_NAME.search(name)) is not None
    }


def _this_ranks_sequence_shard(model: torch.nn.Module, experts: torch.Tensor) -> torch.Tensor:
    """Under sequence parallelism each tensor-parallel rank's routers see only its slice of the sequence."""
    if not getattr(model.config, "sequence_parallel", False):
        return experts
    from megatron.core import parallel_state

    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    if experts.shape[1] % size:
        raise RoutedExpertsError(f"{experts.shape[1]} tokens do not split over {size} sequence-parallel ranks")
    return experts.chunk(size, dim=1)[rank]


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, experts: torch.Tensor | None) -> Iterator[None]:
    """Within the block, ``model``'s forwards over ``[B, T]`` tokens route token ``(b, t)`` of MoE layer ``l`` to
    ``experts[b, t, l]`` (``[B, T, layers, top_k]``, :data:`NOT_ROUTED` to route by itself); ``None``: no replay.
    Ids that are not experts of the model, or a shape that does not fit it, are a :class:`RoutedExpertsError`."""
    if experts is None:
        yield
        return
    routers = routers_by_layer(model)
    if not routers:
        raise RoutedExpertsError("routing replay needs a Mixture-of-Experts model: this one has no TopKRouter")
    router = next(iter(routers.values()))
    top_k, num_experts = router.topk, router.config.num_moe_experts
    check_replayable(experts, last_layer=max(routers), top_k=top_k, num_experts=num_experts)
    experts = _this_ranks_sequence_shard(model, experts)
    saved = {layer: router.router_replay for layer, router in routers.items()}
    try:
        for layer, router in routers.items():
            replay = RecordedRouting()
            replay.target = experts[:, :, layer].transpose(0, 1).reshape(-1, top_k)  # megatron's [S, B] order
            router.router_replay = replay
        yield
    finally:
        for layer, router in routers.items():
            router.router_replay = saved[layer]
