"""``MilesDeepseekV4CausalLM``: the ``miles`` implementation of ``deepseek_v4`` behind the core's
:class:`~miles_core.models.causal_lm.CausalLM` interface, in one process (the torch trainer's), or on a rank of a
tensor- and expert-parallel group whose parallel state the caller initialised."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from miles_core import CausalLM
from miles_plugins_megatron.checkpoint import read_hf_config, read_hf_state
from miles_plugins_megatron.deepseek_v4.model import DeepseekV4Model, build_deepseek_v4
from miles_plugins_megatron.deepseek_v4.naming import DeepseekV4HfWeightIterator, load_hf_state
from miles_plugins_megatron.deepseek_v4.parallel import gather_from_tensor_parallel


class MilesDeepseekV4CausalLM(CausalLM):
    """Full-vocabulary logits (gathered over tensor-parallel ranks) and whole HF tensors under their checkpoint
    names, whatever this rank's shard."""

    def __init__(self, model: DeepseekV4Model) -> None:
        super().__init__()
        self.model = model
        self.hf_config = model.hf_config

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32) -> MilesDeepseekV4CausalLM:
        from miles_plugins_megatron.causal_lm import ensure_single_rank_parallel_state  # megatron-core's state

        hf_config = read_hf_config(path)
        ensure_single_rank_parallel_state()
        return cls.build(hf_config, path, dtype=dtype)

    @classmethod
    def build(cls, hf_config: Any, path: str | Path, *, dtype: torch.dtype = torch.float32) -> MilesDeepseekV4CausalLM:
        """This rank's shard of the checkpoint directory ``path`` (megatron-core's parallel state initialised)."""
        model = build_deepseek_v4(hf_config, dtype=dtype)
        load_hf_state(model, read_hf_state(path), source=f"checkpoint {str(path)!r}")
        return cls(model.eval())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return gather_from_tensor_parallel(self.model(input_ids))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor under its checkpoint name (a collective: every rank calls it)."""
        return dict(DeepseekV4HfWeightIterator(self.model, bucket_bytes=1 << 30).named_tensors())
