"""The ``transformers`` implementation of the Llama, Qwen2 and Qwen3 families."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from miles_core.errors import MilesError
from miles_core.models.causal_lm import CausalLM


class TransformersCausalLM(CausalLM):
    """Wraps ``transformers.AutoModelForCausalLM``; the HF names are the module's own parameter names."""

    def __init__(self, model: transformers.PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32) -> TransformersCausalLM:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise MilesError(f"model directory {str(path)!r} has no config.json (expected an HF checkpoint directory)")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, attn_implementation="eager"
        )
        return cls(model)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())
