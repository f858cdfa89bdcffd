"""Every accommodation that lets megatron-core run on a CPU, in one place; none applies when CUDA is available.

- ``torch.cuda.current_device`` answers the CPU device: megatron-core's RoPE and global memory buffer ask for it.
- The RNG tracker is initialised without ``model_parallel_cuda_manual_seed``, which asserts CUDA.
Callers also pass an explicit causal mask (the default one is created on "cuda") and build models with
``use_cpu_initialization=True`` in float32; sequence parallelism stays off (it needs TransformerEngine or Apex).
"""

from __future__ import annotations

import torch


def apply_cpu_accommodations() -> bool:
    """Patch what megatron-core needs on a CPU; returns whether anything was patched."""
    if torch.cuda.is_available():
        return False
    torch.cuda.current_device = lambda: torch.device("cpu")  # megatron-core asks for "the current device"
    from megatron.core import tensor_parallel  # deferred: megatron-core takes ~10 s to import

    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return True


def causal_mask(sequence_length: int) -> torch.Tensor:
    """Megatron's boolean mask, ``True`` where attention is blocked, shaped ``[1, 1, S, S]``."""
    return torch.triu(torch.ones(1, 1, sequence_length, sequence_length, dtype=torch.bool), diagonal=1)


def seed_model_parallel_rng(seed: int) -> None:
    """Seed megatron-core's RNG tracker (dropout and initialisation draw from it): per tensor-parallel rank with
    ``model_parallel_cuda_manual_seed`` on CUDA; on a CPU, through the accommodations above."""
    if apply_cpu_accommodations():
        return
    from megatron.core import tensor_parallel  # deferred: megatron-core takes ~10 s to import

    tensor_parallel.model_parallel_cuda_manual_seed(seed)
