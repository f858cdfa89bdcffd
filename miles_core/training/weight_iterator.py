"""The weight-export API: an ``HfWeightIterator`` turns a trainer's parameters into buckets of HF-named tensors
of at most ``bucket_bytes`` each (a tensor larger than a bucket travels alone). Every weight-transfer protocol
consumes these buckets, so a protocol works with any trainer that provides an iterator."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator

import torch
import transformers

from miles_core.engines.weights import unique_named_tensors
from miles_core.models.hf_checkpoint import checkpoint_named_tensors
from miles_core.weight_transfer.protocol import WeightBucket


class HfWeightIterator(abc.ABC):
    """Yields buckets of ``(HF name, tensor)``; iterate once per weight update."""

    def __init__(self, *, bucket_bytes: int) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes

    @abc.abstractmethod
    def named_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Every weight under its HF name, as a CPU or device tensor (gathered from shards if sharded)."""

    def __iter__(self) -> Iterator[WeightBucket]:
        return bucketize(self.named_tensors(), self.bucket_bytes)


def bucketize(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[WeightBucket]:
    """Group named tensors into buckets of at most ``bucket_bytes`` (one oversized tensor fills a bucket alone)."""
    bucket: WeightBucket = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class ModuleHfWeightIterator(HfWeightIterator):
    """For a module whose parameter names already are HF names, or a transformers model (sent under its checkpoint
    names: a MoE's fused experts one tensor per expert, see
    :func:`~miles_core.models.hf_checkpoint.checkpoint_named_tensors`); tied weights are sent once, under their
    first name, as HF checkpoints store them."""

    def __init__(self, module: torch.nn.Module, *, bucket_bytes: int) -> None:
        super().__init__(bucket_bytes=bucket_bytes)
        self.module = module

    def named_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        named = unique_named_tensors(self.module.state_dict().items())
        if isinstance(self.module, transformers.PreTrainedModel):
            named = checkpoint_named_tensors(self.module, named)
        for name, tensor in named:
            yield name, tensor.detach()
