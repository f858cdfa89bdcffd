"""``StagingLayout``: which tensor lies at which byte offset of a staging buffer, with which dtype and shape.

A staging buffer is a flat uint8 buffer (a shared-memory file that a trainer and an engine both map) holding named
tensors one after the other. The sender builds the layout from its tensors (:meth:`StagingLayout.of`), copies them
in and sends the layout to the engine as one JSON object (:meth:`StagingLayout.to_wire`); the engine checks it
(:meth:`StagingLayout.from_wire`) and reads the tensors as views of the buffer (:meth:`StagingLayout.views`). The
``tensor`` protocol and the ``rdt`` plugin both lay their buffers out with it.

Wire form (a plain JSON object)::

    {"alignment": 64, "size": 1024,
     "tensors": [{"name": "model.norm.weight", "dtype": "float32", "shape": [64], "offset": 0, "nbytes": 256}, ...]}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from miles_core.errors import MilesError

MAX_STAGED_TENSORS = 1 << 20  # far more than any model has; bounds the work one request can ask for
MAX_STAGING_BYTES = 1 << 48  # 256 TiB: beyond any machine's memory
MAX_DIMS = 32
MAX_NAME_CHARS = 1024
MAX_ALIGNMENT = 1 << 16
# The dtypes a staged tensor may have: fixed, so that a wire value never names an arbitrary attribute of torch.
STAGING_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint64",
        "uint32",
        "uint16",
        "uint8",
        "bool",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_ELEMENT_SIZES = {name: dtype.itemsize for name, dtype in STAGING_DTYPES.items()}
_WIRE_KEYS = ("alignment", "size", "tensors")
_ENTRY_KEYS = ("name", "dtype", "shape", "offset", "nbytes")


class StagingLayoutError(MilesError):
    """A staging layout that is malformed, or that does not fit its buffer; nothing was read or written."""


class StagingOverflowError(StagingLayoutError):
    """A tensor that does not fit into the buffer's capacity (``needed``: the bytes it would take)."""

    def __init__(self, message: str, *, needed: int) -> None:
        super().__init__(message)
        self.needed = needed


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` as ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def _align_up(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


@dataclasses.dataclass(frozen=True)
class StagedTensor:
    """Where one tensor lies in a staging buffer: bytes ``offset .. offset + nbytes``."""

    name: str
    dtype: str  # a key of STAGING_DTYPES: "float32", "bfloat16", ...
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class StagingLayout:
    """The tensors of a staging buffer (in buffer order), the bytes they need (``size``: where the last one ends)
    and the ``alignment`` of every offset (each offset is also a multiple of its dtype's element size). Checked at
    construction: a layout that exists is one whose views are well defined."""

    tensors: tuple[StagedTensor, ...]
    size: int
    alignment: int = 64

    def __post_init__(self) -> None:
        _check_layout(self)

    @classmethod
    def of(
        cls,
        tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        alignment: int = 64,
        start: int = 0,
        capacity: int | None = None,
        dtypes: Mapping[str, torch.dtype] | None = None,
    ) -> StagingLayout:
        """Lay ``tensors`` out one after the other from byte ``start``, each offset a multiple of ``alignment`` and
        of the tensor's element size; a tensor ending beyond ``capacity`` bytes is a :class:`StagingOverflowError`.
        ``dtypes``: the tensors staged in another dtype than their own (copying into the view casts)."""
        entries, offset = [], start
        for name, tensor in tensors:
            dtype = (dtypes or {}).get(name, tensor.dtype)
            offset = _align_up(offset, max(alignment, dtype.itemsize))
            nbytes = tensor.numel() * dtype.itemsize
            if capacity is not None and offset + nbytes > capacity:
                raise StagingOverflowError(
                    f"{name} ({dtype_name(dtype)}, shape {tuple(tensor.shape)}, {nbytes} bytes) does not fit "
                    f"the {capacity}-byte staging buffer at offset {offset}",
                    needed=offset + nbytes,
                )
            entries.append(StagedTensor(name, dtype_name(dtype), tuple(tensor.shape), offset, nbytes))
            offset += nbytes
        return cls(tuple(entries), size=offset if entries else start, alignment=alignment)

    @classmethod
    def concat(cls, layouts: Sequence[StagingLayout], *, alignment: int | None = None) -> StagingLayout:
        """One layout holding the tensors of ``layouts`` (laid out apart, e.g. one after the other with ``start``);
        ``alignment``: the finest of theirs unless given."""
        if alignment is None:
            alignment = min((layout.alignment for layout in layouts), default=64)
        tensors = tuple(entry for layout in layouts for entry in layout.tensors)
        return cls(tensors, size=max((layout.size for layout in layouts), default=0), alignment=alignment)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors, by name in buffer order, as views into the flat uint8 ``buffer`` (no copy)."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            shape = tuple(buffer.shape)
            raise StagingLayoutError(f"a staging buffer is a 1-d uint8 tensor, got {buffer.dtype} of shape {shape}")
        if self.size > buffer.numel():
            raise StagingLayoutError(
                f"the layout needs {self.size} bytes (its last tensor ends there) and the staging buffer has "
                f"{buffer.numel()}"
            )
        return {
            e.name: buffer[e.offset : e.offset + e.nbytes].view(STAGING_DTYPES[e.dtype]).view(e.shape)
            for e in self.tensors
        }

    def to_wire(self) -> dict[str, Any]:
        """The JSON object that carries the layout in a request body."""
        return {
            "alignment": self.alignment,
            "size": self.size,
            "tensors": [
                {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "offset": e.offset, "nbytes": e.nbytes}
                for e in self.tensors
            ],
        }

    @classmethod
    def from_wire(cls, value: object) -> StagingLayout:
        """The layout that a request's ``layout`` field carries, checked strictly: exact keys, integers that are
        integers, known dtypes, byte counts that match the shapes, offsets aligned, within ``size`` and not
        overlapping, distinct names, bounded counts. Anything else is a :class:`StagingLayoutError` that names the
        field (``layout.tensors[3].offset``)."""
        wire = _object(value, "layout", _WIRE_KEYS)
        alignment = _integer(wire["alignment"], "layout.alignment", low=1, high=MAX_ALIGNMENT)
        size = _integer(wire["size"], "layout.size", low=0, high=MAX_STAGING_BYTES)
        rows = wire["tensors"]
        if not isinstance(rows, list):
            raise StagingLayoutError(f"layout.tensors must be a list of tensor entries, got {type(rows).__name__}")
        if len(rows) > MAX_STAGED_TENSORS:
            raise StagingLayoutError(f"layout.tensors has {len(rows)} entries: at most {MAX_STAGED_TENSORS}")
        entries = tuple(_entry(row, f"layout.tensors[{i}]") for i, row in enumerate(rows))
        return cls(entries, size=size, alignment=alignment)  # __post_init__ checks how the entries fit together


def _object(value: object, field: str, keys: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise StagingLayoutError(f"{field} must be an object with {', '.join(keys)}, got {type(value).__name__}")
    missing = [key for key in keys if key not in value]
    unknown = [str(key)[:80] for key in value if key not in keys]
    if missing or unknown:
        problems = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unknown {', '.join(unknown[:5])}"] if unknown else []
        )
        raise StagingLayoutError(f"{field}: {'; '.join(problems)} (an entry has exactly {', '.join(keys)})")
    return value


def _integer(value: object, field: str, *, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise StagingLayoutError(f"{field} must be an integer, got {value!r:.80}")
    if not low <= value <= high:
        raise StagingLayoutError(f"{field} must be from {low} to {high}, got {value}")
    return value


def _entry(row: object, field: str) -> StagedTensor:
    entry = _object(row, field, _ENTRY_KEYS)
    name, dtype, shape = entry["name"], entry["dtype"], entry["shape"]
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS:
        raise StagingLayoutError(f"{field}.name must be a string of 1 to {MAX_NAME_CHARS} characters, got {name!r:.80}")
    if not isinstance(dtype, str):
        raise StagingLayoutError(f"{field}.dtype must be a string, got {dtype!r:.80}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise StagingLayoutError(f"{field}.shape must be a list of at most {MAX_DIMS} sizes, got {shape!r:.80}")
    dims = tuple(_integer(dim, f"{field}.shape[{i}]", low=0, high=MAX_STAGING_BYTES) for i, dim in enumerate(shape))
    offset = _integer(entry["offset"], f"{field}.offset", low=0, high=MAX_STAGING_BYTES)
    nbytes = _integer(entry["nbytes"], f"{field}.nbytes", low=0, high=MAX_STAGING_BYTES)
    return StagedTensor(name, dtype, dims, offset, nbytes)


def _check_layout(layout: StagingLayout) -> None:
    """Every invariant a layout must hold, each failure naming the entry (``layout.tensors[i]``) and the rule."""
    field = "layout"
    alignment = layout.alignment
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1) or alignment > MAX_ALIGNMENT:
        raise StagingLayoutError(f"{field}.alignment must be a power of two up to {MAX_ALIGNMENT}, got {alignment!r}")
    if not isinstance(layout.size, int) or not 0 <= layout.size <= MAX_STAGING_BYTES:
        raise StagingLayoutError(f"{field}.size must be from 0 to {MAX_STAGING_BYTES} bytes, got {layout.size!r}")
    if len(layout.tensors) > MAX_STAGED_TENSORS:
        raise StagingLayoutError(f"{field}.tensors has {len(layout.tensors)} entries: at most {MAX_STAGED_TENSORS}")
    seen: set[str] = set()
    for index, entry in enumerate(layout.tensors):
        if entry.name in seen:
            raise StagingLayoutError(f"{_where(index, entry)}: the name is given twice: each tensor is staged once")
        seen.add(entry.name)
        problem = _entry_problem(entry, size=layout.size, alignment=alignment)
        if problem:
            raise StagingLayoutError(f"{_where(index, entry)}: {problem}")
    _check_disjoint(layout.tensors)


def _check_disjoint(tensors: Sequence[StagedTensor]) -> None:
    """No two tensors share a byte (empty tensors occupy none)."""
    ordered = sorted((i for i, e in enumerate(tensors) if e.nbytes), key=lambda i: tensors[i].offset)
    last = None  # the index of the tensor that ends last among those before
    for index in ordered:
        entry = tensors[index]
        if last is not None and tensors[last].offset + tensors[last].nbytes > entry.offset:
            other = tensors[last]
            raise StagingLayoutError(
                f"{_where(index, entry)} at offset {entry.offset} overlaps {_where(last, other)}, bytes "
                f"{other.offset}..{other.offset + other.nbytes}"
            )
        if last is None or entry.offset + entry.nbytes > tensors[last].offset + tensors[last].nbytes:
            last = index


def _where(index: int, entry: StagedTensor) -> str:
    return f"layout.tensors[{index}] ({entry.name[:80]!r})"


def _entry_problem(entry: StagedTensor, *, size: int, alignment: int) -> str | None:
    """What is wrong with one entry on its own, or ``None`` (messages are built only for a bad entry)."""
    if entry.dtype not in STAGING_DTYPES:
        return f"unknown dtype {entry.dtype!r:.80}: use one of {', '.join(STAGING_DTYPES)}"
    element_size = _ELEMENT_SIZES[entry.dtype]
    expected = math.prod(entry.shape) * element_size
    if entry.nbytes != expected:
        return f"nbytes {entry.nbytes} does not match shape {entry.shape} of {entry.dtype} ({expected} bytes)"
    step = max(alignment, element_size)
    if entry.offset < 0 or entry.offset % step:
        return (
            f"offset {entry.offset} is not a multiple of {step} (the alignment, and {entry.dtype}'s "
            f"{element_size} bytes)"
        )
    if entry.offset + entry.nbytes > size:
        return f"bytes {entry.offset}..{entry.offset + entry.nbytes} lie beyond the layout's size {size}"
    return None


def map_staging_file(path: str | Path, size: int) -> torch.Tensor:
    """A file in shared memory as a uint8 tensor (both sides map the same pages: no copy through the kernel)."""
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
