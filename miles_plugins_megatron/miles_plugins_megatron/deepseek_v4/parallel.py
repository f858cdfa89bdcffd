"""The tensor- and expert-parallel pieces of the ``miles`` DeepSeek-V4: megatron-core's parallel layers and regions,
sharded parameters marked as megatron-core marks its own, and the token exchange between expert-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)

INIT_STD = 0.02
"""Initial weights of a model built without a checkpoint (every weight is loaded from one in practice)."""


@dataclass(frozen=True)
class Layout:
    """This rank's place: tensor-parallel size and rank (attention heads, vocabulary, expert MLP columns), and
    expert-parallel size and rank (which experts it holds)."""

    tp_size: int
    tp_rank: int
    ep_size: int
    ep_rank: int
    dtype: torch.dtype

    @classmethod
    def current(cls, dtype: torch.dtype = torch.float32) -> Layout:
        """The layout of megatron-core's initialised parallel state."""
        return cls(
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            ep_size=parallel_state.get_expert_model_parallel_world_size(),
            ep_rank=parallel_state.get_expert_model_parallel_rank(),
            dtype=dtype,
        )

    def megatron_config(self) -> ModelParallelConfig:
        """megatron-core's settings of the parallel layers: CPU initialisation, no sequence parallelism."""
        return ModelParallelConfig(
            tensor_model_parallel_size=self.tp_size,
            expert_model_parallel_size=self.ep_size,
            use_cpu_initialization=True,
            params_dtype=self.dtype,
            sequence_parallel=False,
        )


def init_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.init.normal_(weight, std=INIT_STD)


def column(layout: Layout, inputs: int, outputs: int) -> ColumnParallelLinear:
    """A linear layer whose outputs are split over tensor-parallel ranks (the input's gradient summed over them)."""
    return ColumnParallelLinear(
        inputs, outputs, config=layout.megatron_config(), init_method=init_weight, bias=False, gather_output=False
    )


def row(layout: Layout, inputs: int, outputs: int) -> RowParallelLinear:
    """A linear layer whose inputs are split over tensor-parallel ranks (its output summed over them)."""
    return RowParallelLinear(
        inputs,
        outputs,
        config=layout.megatron_config(),
        init_method=init_weight,
        bias=False,
        input_is_parallel=True,
        skip_bias_add=False,
    )


def sharded_parameter(tensor: torch.Tensor, *, dim: int, expert: bool = False) -> torch.nn.Parameter:
    """A parameter holding this rank's slice along ``dim`` of the whole tensor, marked as megatron-core marks its
    tensor-parallel weights (``tensor_model_parallel``, ``partition_dim``); an expert's is also ``allreduce=False``."""
    parameter = torch.nn.Parameter(tensor)
    set_tensor_model_parallel_attributes(parameter, True, dim, 1)
    if expert:
        parameter.allreduce = False
    return parameter


def split(size: int, parts: int, what: str) -> int:
    """``size / parts``, or an error naming what cannot be split."""
    if size % parts:
        raise ValueError(f"{what} ({size}) is not divisible by {parts}")
    return size // parts


def to_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged, its gradient summed over tensor-parallel ranks: for a replicated tensor that each rank uses
    only with its own heads or columns."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(x)


def from_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """The sum over tensor-parallel ranks of their partial ``x`` (the gradient passes unchanged)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x)


def gather_from_tensor_parallel(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., n/tp]`` gathered along its last dimension over tensor-parallel ranks."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(x)


def _all_gather_rows(rows: torch.Tensor, group: Any, counts: list[int]) -> torch.Tensor:
    """Every rank's ``rows`` (``counts[r]`` of them on rank ``r``), concatenated by rank."""
    padded = rows.new_zeros((max(counts), *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])


def _own_rows_of_sum(tensor: torch.Tensor, group: Any, counts: list[int]) -> torch.Tensor:
    """This rank's rows of ``tensor`` summed over the ranks."""
    summed = tensor.contiguous().clone()
    dist.all_reduce(summed, group=group)
    start = sum(counts[: dist.get_rank(group)])
    return summed[start : start + counts[dist.get_rank(group)]]


class _GatherTokens(torch.autograd.Function):
    """Forward: every expert-parallel rank's tokens, concatenated by rank. Backward: the gradient of this rank's rows
    summed over the ranks (each computed its own experts' share for every token)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, group: Any, counts: list[int]) -> torch.Tensor:
        ctx.group, ctx.counts = group, counts
        return _all_gather_rows(rows, group, counts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _own_rows_of_sum(grad, ctx.group, ctx.counts), None, None


class _ReturnTokens(torch.autograd.Function):
    """Forward: every rank's partial outputs for all ranks' tokens summed, this rank's rows kept. Backward: every
    rank's gradient rows, concatenated by rank."""

    @staticmethod
    def forward(ctx: Any, outputs: torch.Tensor, group: Any, counts: list[int]) -> torch.Tensor:
        ctx.group, ctx.counts = group, counts
        return _own_rows_of_sum(outputs, group, counts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather_rows(grad.contiguous(), ctx.group, ctx.counts), None, None


def expert_group() -> Any:
    """The expert-parallel group of this rank (ranks of one tensor-parallel rank that split the experts)."""
    return parallel_state.get_expert_model_parallel_group()


def token_counts(rows: int, group: Any, device: torch.device) -> list[int]:
    """The number of tokens of every expert-parallel rank."""
    counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, torch.tensor([rows], dtype=torch.long, device=device), group=group)
    return [int(count) for count in counts]


def gather_tokens(rows: torch.Tensor, group: Any, counts: list[int]) -> torch.Tensor:
    """All expert-parallel ranks' ``rows`` (differentiable; see :class:`_GatherTokens`)."""
    return _GatherTokens.apply(rows, group, counts)


def return_tokens(outputs: torch.Tensor, group: Any, counts: list[int]) -> torch.Tensor:
    """This rank's rows of the outputs summed over expert-parallel ranks (see :class:`_ReturnTokens`)."""
    return _ReturnTokens.apply(outputs, group, counts)
