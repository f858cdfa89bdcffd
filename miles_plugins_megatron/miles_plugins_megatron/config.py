"""The ``megatron`` config section: how the Megatron trainer's ranks are laid out."""

from __future__ import annotations

import pydantic

from miles_core import Section

MAX_RANKS = 1024
"""The most ranks one parallel dimension may have (each rank is a process)."""
MAX_THREADS = 1024
"""The most CPU threads (or reserved CPUs) of one rank: more than the largest machine's cores."""


class MegatronSection(Section):
    """Parallel layout of the ``megatron`` training backend (``--megatron-tensor-parallel 2`` and so on).

    The trainer runs ``tensor_parallel * pipeline_parallel * data_parallel`` ranks as workers. Expert parallelism
    adds no ranks: as in megatron-core, ``expert_parallel`` data-parallel ranks share a MoE layer's experts, each
    holding ``experts / expert_parallel`` of them.
    """

    tensor_parallel: int = pydantic.Field(
        default=1, ge=1, le=MAX_RANKS, description="Tensor-parallel size (at most 1024 ranks, each a process)."
    )
    pipeline_parallel: int = pydantic.Field(
        default=1, ge=1, le=1, description="Pipeline-parallel size (only 1 in this version: no pipeline schedule)."
    )
    data_parallel: int = pydantic.Field(
        default=1, ge=1, le=MAX_RANKS, description="Data-parallel size (batch split, grads summed; at most 1024)."
    )
    expert_parallel: int = pydantic.Field(
        default=1,
        ge=1,
        le=MAX_RANKS,
        description="Expert-parallel size of a MoE model (at most 1024): each group of this many data-parallel "
        "ranks splits the experts of every MoE layer (must divide data_parallel and the experts).",
    )
    distributed_backend: str | None = pydantic.Field(
        default=None,
        pattern="^(gloo|nccl)$",
        description="torch.distributed backend; default: nccl with CUDA, else gloo.",
    )
    threads_per_rank: int | None = pydantic.Field(
        default=None,
        ge=1,
        le=MAX_THREADS,
        description="torch CPU threads per rank, at most 1024; default: the CPUs divided among the ranks.",
    )
    dtype: str = pydantic.Field(default="float32", pattern="^(float32|bfloat16)$", description="Parameter dtype.")
    cpus_per_rank: float = pydantic.Field(
        default=1.0, ge=0, le=MAX_THREADS, description="CPUs a worker provider reserves per rank (at most 1024)."
    )
    startup_timeout_s: float = pydantic.Field(default=300.0, gt=0, description="Time allowed for every rank to load.")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    @pydantic.model_validator(mode="after")
    def _experts_within_data_parallel(self) -> MegatronSection:
        if self.data_parallel % self.expert_parallel:
            raise ValueError(
                f"expert_parallel (--megatron-expert-parallel {self.expert_parallel}) must divide data_parallel "
                f"(--megatron-data-parallel {self.data_parallel}): megatron-core places the expert-parallel ranks "
                "inside the data-parallel ones"
            )
        return self
