"""``MegatronHfWeightIterator``: a (possibly tensor- and expert-parallel) megatron-core ``GPTModel``'s weights as
HF buckets.

Every rank iterates together (each gather is a collective); every rank receives the full tensors. The embedding
comes first, then each decoder layer, then the final norm and the output layer: only one layer's gathered tensors
are alive at a time beyond what the caller keeps. An expert-parallel rank holds only its experts: each expert's
tensors are gathered from every rank of the expert-parallel group and named by their global index, so every expert
appears once under its HF name. Besides the parameters, the routers' ``expert_bias`` buffers are exported: DeepSeek-V3's
``e_score_correction_bias``, a checkpoint tensor that the loss does not train.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from miles_core import DSV4_FAMILY, HfWeightIterator
from miles_plugins_megatron.conversion import (
    global_expert_name,
    is_expert_parameter,
    megatron_to_hf,
    merge_shards,
    num_experts,
)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
ROUTER_EXPERT_BIAS = ".mlp.router.expert_bias"


class MegatronHfWeightIterator(HfWeightIterator):
    """Gathers tensor- and expert-parallel shards, splits fused QKV (per query group) and fused gate/up (per expert
    too), renames to HF."""

    def __init__(self, model: torch.nn.Module, hf_config: Any, *, bucket_bytes: int) -> None:
        super().__init__(bucket_bytes=bucket_bytes)
        self.model = model
        self.hf_config = hf_config

    def named_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        experts = num_experts(self.hf_config)
        for group in self._parameter_groups():
            gathered: dict[str, torch.Tensor] = {}
            for name, param in group:
                if is_expert_parameter(name):
                    gathered.update(gather_expert_parallel(name, param, experts=experts))
                else:
                    gathered[name] = gather_tensor_parallel(name, param)
            yield from megatron_to_hf(gathered, self.hf_config).items()

    def _parameter_groups(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The parameters in HF order: the embedding, each layer, then the rest."""
        head, tail, layers = [], [], {}
        for name, param in _exported_tensors(self.model):
            match = _LAYER.match(name)
            if match:
                layers.setdefault(int(match.group(1)), []).append((name, param))
            elif name.startswith("embedding."):
                head.append((name, param))
            else:
                tail.append((name, param))
        yield head
        for index in sorted(layers):
            yield layers[index]
        yield tail


def hf_weight_iterator(model: torch.nn.Module, hf_config: Any, *, bucket_bytes: int) -> HfWeightIterator:
    """The iterator of a rank's model: the ``miles`` DeepSeek-V4's, or a megatron-core ``GPTModel``'s."""
    if hf_config.model_type == DSV4_FAMILY:
        from miles_plugins_megatron.deepseek_v4.naming import DeepseekV4HfWeightIterator  # its model's modules

        return DeepseekV4HfWeightIterator(model, bucket_bytes=bucket_bytes)
    return MegatronHfWeightIterator(model, hf_config, bucket_bytes=bucket_bytes)


def _exported_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters, then the routers' expert bias buffers (replicated on every rank)."""
    yield from model.named_parameters()
    for name, buffer in model.named_buffers():
        if name.endswith(ROUTER_EXPERT_BIAS):
            yield name, buffer


def gather_tensor_parallel(name: str, param: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    """The unsharded tensor (a collective over the tensor-parallel group, or ``group``, for sharded parameters)."""
    tensor = param.detach()
    group = group if group is not None else parallel_state.get_tensor_model_parallel_group()
    size = dist.get_world_size(group)
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return merge_shards(name, shards, param.partition_dim)


def gather_expert_parallel(name: str, param: torch.Tensor, *, experts: int) -> dict[str, torch.Tensor]:
    """A local expert's unsharded tensor from every expert-parallel rank, each under its global expert name (of a
    layer of ``experts``; collectives over the expert tensor-parallel group, then the expert-parallel group)."""
    tensor = gather_tensor_parallel(name, param, group=parallel_state.get_expert_tensor_parallel_group())
    size = parallel_state.get_expert_model_parallel_world_size()
    local_experts = experts // size
    if size == 1:
        return {global_expert_name(name, expert_rank=0, local_experts=local_experts): tensor}
    copies = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(copies, tensor.contiguous(), group=parallel_state.get_expert_model_parallel_group())
    return {
        global_expert_name(name, expert_rank=rank, local_experts=local_experts): copy
        for rank, copy in enumerate(copies)
    }
