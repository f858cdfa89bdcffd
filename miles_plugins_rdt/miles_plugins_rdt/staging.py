"""The staging bucket of an engine rank, and how tensors are laid into it.

Each engine rank owns one fixed-size uint8 buffer, registered once with the transport. A chunk of HF-named tensors
is laid into it as a :class:`~miles_core.weight_transfer.staging_layout.StagingLayout` at offsets aligned to each
tensor's dtype (a view of a uint8 buffer as ``float32`` needs an offset that is a multiple of 4); a tensor that
cannot fit is an error that names it and says which setting to raise. A staging bucket holds one whole version of
the weights (the engine then serves straight from it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence

import torch

from miles_core import MilesError, StagedTensor, StagingLayout, StagingOverflowError


def nbytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def align_up(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def bucket_layout(tensors: Sequence[tuple[str, torch.Tensor]], *, capacity: int, start: int = 0) -> StagingLayout:
    """:meth:`StagingLayout.of` for a chunk laid into a staging bucket of ``capacity`` bytes from ``start``, each
    offset aligned to its dtype alone; a tensor that does not fit says which rdt setting to raise."""
    try:
        return StagingLayout.of(tensors, alignment=1, start=start, capacity=capacity)
    except StagingOverflowError as exc:
        raise StagingOverflowError(
            f"{exc}; raise the rdt setting staging_bucket_mb (--weight-transfer-settings) to at least "
            f"{align_up(exc.needed, 1 << 20) >> 20} MiB: one staging bucket holds a whole version of the weights",
            needed=exc.needed,
        ) from None


def in_waves(
    buckets: Iterable[Iterable[tuple[str, torch.Tensor]]], min_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The buckets' named tensors, contiguous and on the CPU, regrouped into waves of whole buckets that hold at least
    ``min_bytes`` each (the last one may hold less; ``0``: each bucket is a wave). Each wave comes as soon as the
    buckets it needs have been yielded."""
    wave, nbytes = [], 0
    for bucket in buckets:
        tensors = [(name, tensor.detach().contiguous().cpu()) for name, tensor in bucket]
        wave.extend(tensors)
        nbytes += sum(nbytes_of(tensor) for _, tensor in tensors)
        if wave and nbytes >= min_bytes:
            yield wave
            wave, nbytes = [], 0
    if wave:
        yield wave


@dataclasses.dataclass(frozen=True)
class Piece:
    """A byte range of one tensor of a chunk and where it lands in the staging bucket."""

    tensor: int  # the tensor's index in the chunk
    start: int  # the first byte of the range within the tensor
    nbytes: int
    offset: int  # where the range lands in the staging bucket


LANE_GRANULE = 1 << 16


def split_into_lanes(slots: Sequence[StagedTensor], lanes: int, *, granule: int = LANE_GRANULE) -> list[list[Piece]]:
    """Cut a chunk's bytes (its tensors one after the other, as ``slots`` lays them out) into ``lanes`` runs of
    about equal size, each cut on a multiple of ``granule`` bytes of the chunk; a lane may get no piece."""
    if lanes < 1:
        raise MilesError(f"rdt needs at least one receive lane, got {lanes}")
    total = sum(slot.nbytes for slot in slots)
    bounds = [min(total, align_up(total * lane // lanes, granule)) for lane in range(lanes)] + [total]
    pieces: list[list[Piece]] = [[] for _ in range(lanes)]
    position = 0  # where this tensor's bytes begin in the chunk
    for index, slot in enumerate(slots):
        for lane in range(lanes):
            low, high = max(position, bounds[lane]), min(position + slot.nbytes, bounds[lane + 1])
            if low < high:
                pieces[lane].append(Piece(index, low - position, high - low, slot.offset + low - position))
        position += slot.nbytes
    return pieces


def byte_range(tensor: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """Bytes ``start .. start + nbytes`` of a contiguous tensor, as a uint8 view (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)[start : start + nbytes]


def plan_routes(num_sources: int, engines: Sequence[str]) -> dict[str, int]:
    """Which trainer rank feeds which engine rank: engines spread round-robin over the sending ranks."""
    if num_sources < 1:
        raise MilesError(f"rdt needs at least one sending trainer rank, got {num_sources}")
    return {engine: index % num_sources for index, engine in enumerate(engines)}
