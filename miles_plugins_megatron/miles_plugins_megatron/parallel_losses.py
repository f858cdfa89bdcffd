"""Token logprobs and entropy from vocabulary-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds the logits of a contiguous slice of the vocabulary. The softmax normaliser, the
target's logit and the expected logit are reduced across the tensor-parallel group (three all-reduces of
``[B, T]`` tensors, never ``[B, T, V]``). The reductions use Megatron's ``reduce_from_tensor_model_parallel_region``,
whose backward is the identity: every rank computes the same loss from the reduced values, so each rank's gradient
for its own slice is already complete.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


def vocab_parallel_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    dtype: torch.dtype | None = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log p(target)`` and the entropy per position, from this rank's logits ``[B, T, V/tp]`` and the targets
    ``[B, T]`` (global token ids). Equal to :func:`miles_core.training.losses.token_logprobs` and
    :func:`~miles_core.training.losses.entropy` on the gathered logits; the math in ``dtype`` (float32 by default;
    ``None``: the logits' own dtype, whose all-reduces then carry that dtype's rounding too)."""
    if dtype is not None:
        logits = logits.to(dtype)
    if temperature != 1.0:
        logits = logits / temperature
    local_vocab = logits.shape[-1]
    first_token = parallel_state.get_tensor_model_parallel_rank() * local_vocab
    with torch.no_grad():  # the shift only keeps exp() finite; it cancels out of every result
        shift = logits.max(dim=-1, keepdim=True).values
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    shifted = logits - shift
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    log_normaliser = sum_exp.log()
    local_targets = targets - first_token
    owned = (local_targets >= 0) & (local_targets < local_vocab)
    picked = shifted.gather(-1, local_targets.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = reduce_from_tensor_model_parallel_region(picked * owned)
    expected_logit = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1)) / sum_exp
    return target_logit - log_normaliser, log_normaliser - expected_logit
