"""The checkpoint naming contract of DeepSeek-V4: the ``miles`` model's tensors are named as transformers writes a
DeepSeek-V4 checkpoint (its ``save_pretrained`` names, which ``deepseek_v4/transformers`` exports too), in the same
layouts. A rank's tensor differs from the checkpoint's only by its shard: a tensor-parallel slice along the
parameter's ``partition_dim`` (megatron-core's mark), and, for a routed expert, its local index ``j`` standing for
global expert ``ep_rank * local_experts + j``.

:func:`load_hf_state` shards whole HF tensors into a rank's model; :class:`DeepseekV4HfWeightIterator` gathers them
back (collectives: every rank iterates together) and yields the exact HF names and layouts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from miles_core import HfWeightIterator, MilesError
from miles_plugins_megatron.deepseek_v4.model import DeepseekV4Model

_EXPERT = re.compile(r"^(model\.layers\.\d+\.ffn\.experts\.)(\d+)(\..*)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def model_tensors(model: DeepseekV4Model) -> dict[str, torch.Tensor]:
    """The rank's tensors under their local names: parameters, and the routers' buffers (``gate.bias``, the
    selection bias, and ``gate.tid2eid``, the hash table), which are checkpoint tensors that the loss does not train."""
    return {name: t for name, t in model.state_dict(keep_vars=True).items() if not name.endswith("._extra_state")}


def global_name(name: str, *, first_expert: int) -> str:
    """The checkpoint name of the local tensor ``name`` on a rank whose first expert is ``first_expert``."""
    match = _EXPERT.match(name)
    if match is None:
        return name
    return f"{match.group(1)}{first_expert + int(match.group(2))}{match.group(3)}"


def is_expert_tensor(name: str) -> bool:
    """Whether ``name`` is a routed expert's tensor (held by one expert-parallel rank only)."""
    return _EXPERT.match(name) is not None


def _shard(tensor: torch.Tensor, parameter: torch.Tensor, *, rank: int, size: int) -> torch.Tensor:
    if not getattr(parameter, "tensor_model_parallel", False) or size == 1:
        return tensor
    return tensor.chunk(size, dim=parameter.partition_dim)[rank]


def load_hf_state(model: DeepseekV4Model, state: Mapping[str, torch.Tensor], *, source: str) -> int:
    """Copy the whole HF tensors ``state`` (checkpoint names) into this rank's shard of ``model``; a missing,
    unexpected or misshapen tensor is a :class:`MilesError` naming ``source``. Returns the number of tensors set."""
    layout = model.layout
    expected = _all_checkpoint_names(model)
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise MilesError(
            f"{source} does not hold the tensors of this DeepSeek-V4 config: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]} (the checkpoint names are those transformers writes)"
        )
    first = layout.ep_rank * (model.hf_config.n_routed_experts // layout.ep_size)
    tensors = model_tensors(model)
    with torch.no_grad():
        for name, target in tensors.items():
            whole = state[global_name(name, first_expert=first)]
            shard = _shard(whole, target, rank=layout.tp_rank, size=layout.tp_size)
            if shard.shape != target.shape:
                raise MilesError(f"{source}: {name} has shape {tuple(whole.shape)}, the config needs {target.shape}")
            target.copy_(shard)
    return len(tensors)


def _all_checkpoint_names(model: DeepseekV4Model) -> set[str]:
    layout = model.layout
    local = model.hf_config.n_routed_experts // layout.ep_size
    names = set()
    for name in model_tensors(model):
        ranks = range(layout.ep_size) if is_expert_tensor(name) else [0]
        names.update(global_name(name, first_expert=rank * local) for rank in ranks)
    return names


class DeepseekV4HfWeightIterator(HfWeightIterator):
    """The ``miles`` DeepSeek-V4's weights under their HF names, whole: tensor-parallel shards gathered, every
    expert gathered from its expert-parallel rank. The embedding comes first, then each layer, then the rest, so
    only one layer's gathered tensors are alive at a time beyond what the caller keeps."""

    def __init__(self, model: DeepseekV4Model, *, bucket_bytes: int) -> None:
        super().__init__(bucket_bytes=bucket_bytes)
        self.model = model

    def named_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        layout = self.model.layout
        local = self.model.hf_config.n_routed_experts // layout.ep_size
        for group in _in_layer_order(model_tensors(self.model)):
            for name, tensor in group:
                whole = _gather_tensor_parallel(tensor, layout.tp_size)
                if not is_expert_tensor(name):
                    yield name, whole
                    continue
                for rank, copy in enumerate(_gather_expert_parallel(whole, layout.ep_size)):
                    yield global_name(name, first_expert=rank * local), copy


def _in_layer_order(tensors: Mapping[str, torch.Tensor]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    head, tail, layers = [], [], {}
    for name, tensor in tensors.items():
        match = _LAYER.match(name)
        if match:
            layers.setdefault(int(match.group(1)), []).append((name, tensor))
        elif name.startswith("model.embed_tokens."):
            head.append((name, tensor))
        else:
            tail.append((name, tensor))
    yield head
    for index in sorted(layers):
        yield layers[index]
    yield tail


def _gather_tensor_parallel(tensor: torch.Tensor, size: int) -> torch.Tensor:
    detached = tensor.detach()
    if size == 1 or not getattr(tensor, "tensor_model_parallel", False):
        return detached
    shards = [torch.empty_like(detached) for _ in range(size)]
    dist.all_gather(shards, detached.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=tensor.partition_dim)


def _gather_expert_parallel(tensor: torch.Tensor, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [tensor]
    copies = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(copies, tensor.contiguous(), group=parallel_state.get_expert_model_parallel_group())
    return copies
