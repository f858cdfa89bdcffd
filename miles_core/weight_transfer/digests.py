"""Weight digests, the checksum both ends of a transfer compute: a SHA-256 per tensor (over its name, dtype, shape
and bytes), combined in name order, so that each process digests the tensors it holds and only the digests travel.
Equal checksums mean identical weights."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    """A SHA-256 over one tensor's name, dtype, shape and bytes (what a process holding it contributes to
    :func:`checksum` without sending it anywhere)."""
    data = tensor.detach().contiguous().cpu()
    digest = hashlib.sha256(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
    digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def combine_digests(digests: Mapping[str, str]) -> str:
    """The :func:`checksum` of tensors from their :func:`tensor_digest` by name (computed where each tensor is)."""
    combined = hashlib.sha256()
    for name in sorted(digests):
        combined.update(f"{name}={digests[name]};".encode())
    return combined.hexdigest()


def checksum(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A SHA-256 over every tensor's :func:`tensor_digest`, in name order: equal iff the weights are identical, and
    combinable from digests computed in several processes (:func:`combine_digests`)."""
    return combine_digests({name: tensor_digest(name, tensor) for name, tensor in tensors})
