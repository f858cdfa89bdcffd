"""The interface every model implementation offers."""

from __future__ import annotations

import abc
from pathlib import Path

import torch


class CausalLM(torch.nn.Module, abc.ABC):
    """A causal language model that loads and exports HF checkpoint names.

    Implementations of one family (for example ``llama/transformers`` and ``llama/minimal``) must load the same
    checkpoint directory (``config.json`` + safetensors) and return the same tensors from :meth:`hf_state_dict`.
    """

    @classmethod
    @abc.abstractmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32) -> CausalLM:
        """Load a checkpoint directory."""

    @abc.abstractmethod
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` for ``input_ids`` ``[batch, seq]``."""

    @abc.abstractmethod
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under their HF checkpoint names."""
