"""The ``transformers`` implementation of the Llama, Qwen2 and Qwen3 families."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from miles_core.models.causal_lm import CausalLM
from miles_core.models.hf_checkpoint import checkpoint_named_tensors, load_causal_lm


class TransformersCausalLM(CausalLM):
    """Wraps ``transformers.AutoModelForCausalLM``; the HF names are those of the checkpoint files (the module's own
    parameter names, but for a family held in memory in another layout, such as fused MoE experts)."""

    def __init__(self, model: transformers.PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32) -> TransformersCausalLM:
        return cls(load_causal_lm(path, dtype=dtype, attn_implementation="eager"))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # no KV cache: a training forward never decodes on from it, and filling one costs a copy per layer
        return self.model(input_ids=input_ids, use_cache=False).logits

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights as ``save_pretrained`` names them (a tied ``lm_head.weight`` is the embedding)."""
        return dict(checkpoint_named_tensors(self.model))
