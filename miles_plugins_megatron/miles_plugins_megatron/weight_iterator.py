"""``MegatronHfWeightIterator``: a (possibly tensor-parallel) megatron-core ``GPTModel``'s weights as HF buckets.

Every rank of the tensor-parallel group iterates together (each gather is a collective); every rank receives the
full tensors. The embedding comes first, then each decoder layer, then the final norm and the output layer: only one
layer's gathered tensors are alive at a time beyond what the caller keeps.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from miles_core.training.weight_iterator import HfWeightIterator
from miles_plugins_megatron.conversion import megatron_to_hf, merge_shards

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


class MegatronHfWeightIterator(HfWeightIterator):
    """Gathers tensor-parallel shards, splits fused QKV (per query group) and fused gate/up, renames to HF."""

    def __init__(self, model: torch.nn.Module, hf_config: Any, *, bucket_bytes: int) -> None:
        super().__init__(bucket_bytes=bucket_bytes)
        self.model = model
        self.hf_config = hf_config

    def named_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        for group in self._parameter_groups():
            gathered = {name: gather_tensor_parallel(name, param) for name, param in group}
            yield from megatron_to_hf(gathered, self.hf_config).items()

    def _parameter_groups(self) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
        """The parameters in HF order: the embedding, each layer, then the rest."""
        head, tail, layers = [], [], {}
        for name, param in self.model.named_parameters():
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


def gather_tensor_parallel(name: str, param: torch.Tensor) -> torch.Tensor:
    """The unsharded tensor (a collective over the tensor-parallel group for sharded parameters)."""
    tensor = param.detach()
    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return merge_shards(name, shards, param.partition_dim)
