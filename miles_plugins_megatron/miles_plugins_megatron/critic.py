"""The Megatron trainer's critic (an estimator with a value model: ``ppo``): the policy's GPTModel, built and loaded
as the policy is (the same tensor, data and expert parallelism), with its vocabulary output layer replaced by a
scalar :class:`ValueHead` replicated on every tensor-parallel rank and zeroed (every value starts at 0), as the
torch trainer's critic is. Trained by the ranks with its own AdamW (``critic_lr``, no weight decay) and the clipped
value loss; saved and restored with each rank's optimizer state; never exported to the engines."""

from __future__ import annotations

from typing import Any

import torch


class ValueHead(torch.nn.Module):
    """In place of GPTModel's ``output_layer``: hidden states ``[s, b, h]`` to values ``[s, b, 1]`` (a weight and
    a bias, as transformers' token-classification head of the torch trainer's critic), the same on every
    tensor-parallel rank. Under sequence parallelism the sequence is gathered first, with a backward
    that keeps each rank's own part (every rank computes the same loss from the whole sequence)."""

    def __init__(self, hidden_size: int, *, dtype: torch.dtype, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(
        self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        """GPTModel's output-layer call: ``weight`` (the tied embedding) and ``runtime_gather_output`` are the
        vocabulary head's and are not used."""
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def as_value_model(model: torch.nn.Module, *, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` (a GPTModel, its weights loaded) with a zeroed :class:`ValueHead` as its output layer."""
    model.output_layer = ValueHead(
        model.config.hidden_size, dtype=dtype, sequence_parallel=bool(model.config.sequence_parallel)
    )
    model.share_embeddings_and_output_weights = False  # the head is the critic's own, not the embedding
    return model


CRITIC_ARCHITECTURE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)
"""What a ``critic_model`` checkpoint must share with the policy's: the Megatron critic is built from the policy's
config."""


def architecture_difference(policy: Any, critic: Any) -> str | None:
    """The first architecture setting in which ``critic``'s HF config differs from ``policy``'s (``None``: same)."""
    for key in CRITIC_ARCHITECTURE_KEYS:
        mine, theirs = getattr(policy, key, None), getattr(critic, key, None)
        if mine != theirs:
            return f"{key} {theirs!r} (the policy's: {mine!r})"
    return None
