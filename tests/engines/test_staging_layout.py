"""``StagingLayout``: built from tensors, read back from a real buffer, carried as one JSON object, and every malformed
wire value refused with a message that names the field."""

from __future__ import annotations

import copy
import json
import mmap
from pathlib import Path

import pytest
import torch

import miles_core
from miles_core.weight_transfer.staging_layout import (
    MAX_STAGED_TENSORS,
    StagedTensor,
    StagingLayout,
    StagingLayoutError,
    StagingOverflowError,
    map_staging_file,
)

TENSORS = [
    ("a.bf16", torch.randn(3).to(torch.bfloat16)),
    ("b.f32", torch.randn(2, 3)),
    ("c.i8", torch.tensor([1, 2, 3], dtype=torch.int8)),
    ("d.i64", torch.arange(5)),
    ("e.empty", torch.zeros(0, 4)),
    ("f.bool", torch.tensor([True, False])),
]


def filled(layout: StagingLayout, tensors: list[tuple[str, torch.Tensor]], buffer: torch.Tensor) -> None:
    for target, (_, tensor) in zip(layout.views(buffer).values(), tensors, strict=True):
        target.copy_(tensor)


def test_offsets_follow_the_alignment_and_each_dtype() -> None:
    aligned = StagingLayout.of(TENSORS)
    assert [e.offset for e in aligned.tensors] == [0, 64, 128, 192, 256, 256]
    assert aligned.size == 258 and aligned.alignment == 64
    packed = StagingLayout.of(TENSORS, alignment=1)
    assert [e.offset for e in packed.tensors] == [0, 8, 32, 40, 80, 80]  # 6 -> 8 (f32), 35 -> 40 (i64)
    assert [e.nbytes for e in packed.tensors] == [6, 24, 3, 40, 0, 2]
    later = StagingLayout.of([("x", torch.zeros(2))], alignment=1, start=81)
    assert later.tensors[0].offset == 84 and later.size == 92


def test_views_over_a_shared_memory_file_equal_the_tensors(tmp_path: Path) -> None:
    layout = StagingLayout.of(TENSORS)
    path = tmp_path / "staging"
    path.write_bytes(b"\xff" * layout.size)
    filled(layout, TENSORS, map_staging_file(path, layout.size))
    views = StagingLayout.from_wire(json.loads(json.dumps(layout.to_wire()))).views(map_staging_file(path, layout.size))
    assert list(views) == [name for name, _ in TENSORS]
    for (name, tensor), view in zip(TENSORS, views.values(), strict=True):
        assert view.dtype == tensor.dtype and view.shape == tensor.shape and torch.equal(view, tensor), name
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ) as raw:  # bytes in the file
        assert raw[64:88] == TENSORS[1][1].numpy().tobytes()


def test_the_wire_form_is_a_plain_json_object_that_round_trips() -> None:
    layout = StagingLayout.of(TENSORS, alignment=8)
    wire = layout.to_wire()
    assert set(wire) == {"alignment", "size", "tensors"} and isinstance(wire["tensors"], list)
    assert wire["tensors"][1] == {"name": "b.f32", "dtype": "float32", "shape": [2, 3], "offset": 8, "nbytes": 24}
    assert StagingLayout.from_wire(json.loads(json.dumps(wire))) == layout
    assert StagingLayout.from_wire({"alignment": 64, "size": 0, "tensors": []}).tensors == ()


def test_concat_joins_layouts_laid_one_after_the_other() -> None:
    first = StagingLayout.of(TENSORS[:2], alignment=1)
    second = StagingLayout.of(TENSORS[2:], alignment=1, start=first.size)
    joined = StagingLayout.concat([first, second])
    assert joined == StagingLayout.of(TENSORS, alignment=1)
    with pytest.raises(StagingLayoutError, match=r"layout\.tensors\[2\] \('a\.bf16'\): the name is given twice"):
        StagingLayout.concat([first, StagingLayout.of(TENSORS[:1], alignment=1, start=first.size)])


def test_a_tensor_beyond_the_capacity_is_an_overflow_naming_it() -> None:
    with pytest.raises(StagingOverflowError, match=r"b\.f32 \(float32, shape \(2, 3\), 24 bytes\) does not fit") as e:
        StagingLayout.of(TENSORS, capacity=80)
    assert e.value.needed == 64 + 24


def test_views_refuse_a_buffer_too_small_or_not_flat_bytes() -> None:
    layout = StagingLayout.of(TENSORS)
    with pytest.raises(StagingLayoutError, match=r"needs 258 bytes .* has 100"):
        layout.views(torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(StagingLayoutError, match="1-d uint8 tensor"):
        layout.views(torch.zeros(300, dtype=torch.float32))


def _wire() -> dict:
    return StagingLayout.of(TENSORS[:2]).to_wire()  # a.bf16 at 0 (6 bytes), b.f32 at 64 (24 bytes), size 88


def _with(change: dict | None = None, *, entry: int | None = None, drop: str | None = None) -> object:
    wire = copy.deepcopy(_wire())
    target = wire if entry is None else wire["tensors"][entry]
    target.update(change or {})
    if drop is not None:
        del target[drop]
    return wire


MALFORMED = [
    ("a string", "layout must be an object"),
    (json.dumps(_wire()), "layout must be an object"),  # JSON inside JSON: no longer the wire form
    (_with(drop="size"), "layout: missing size"),
    (_with({"extra": 1}), "layout: unknown extra"),
    (_with({"alignment": 3}), "layout.alignment must be a power of two"),
    (_with({"alignment": 0}), r"layout\.alignment must be from 1"),
    (_with({"size": "88"}), r"layout\.size must be an integer, got '88'"),
    (_with({"size": 88.0}), r"layout\.size must be an integer"),
    (_with({"size": True}), r"layout\.size must be an integer"),
    (_with({"size": 1 << 60}), r"layout\.size must be from 0 to"),
    (_with({"size": 80}), r"layout\.tensors\[1\] \('b\.f32'\): bytes 64\.\.88 lie beyond the layout's size 80"),
    (_with({"tensors": {"a": 1}}), "layout.tensors must be a list"),
    (_with({"tensors": [["w", "float32", [2], 0]]}), r"layout\.tensors\[0\] must be an object"),
    (_with({"dtype": "complex_nonsense"}, entry=0), r"tensors\[0\] \('a\.bf16'\): unknown dtype 'complex_nonsense'"),
    (_with({"dtype": "Tensor"}, entry=0), "unknown dtype 'Tensor'"),  # an attribute of torch, not a dtype
    (_with({"dtype": 7}, entry=0), r"tensors\[0\]\.dtype must be a string"),
    (_with({"name": ""}, entry=0), r"tensors\[0\]\.name must be a string of 1 to 1024"),
    (_with({"name": "b.f32"}, entry=0), r"tensors\[1\] \('b\.f32'\): the name is given twice"),
    (_with({"offset": -64}, entry=1), r"tensors\[1\]\.offset must be from 0"),
    (_with({"offset": 66}, entry=1), r"offset 66 is not a multiple of 64"),
    (_with({"offset": 0}, entry=1), r"tensors\[1\] \('b\.f32'\) at offset 0 overlaps layout\.tensors\[0\]"),
    (_with({"nbytes": 20}, entry=1), r"nbytes 20 does not match shape \(2, 3\) of float32 \(24 bytes\)"),
    (_with({"shape": [-2, 3]}, entry=1), r"tensors\[1\]\.shape\[0\] must be from 0"),
    (_with({"shape": [1 << 40, 1 << 40]}, entry=1), r"nbytes 24 does not match shape \(1099511627776, 1099511627776\)"),
    (_with({"shape": [1] * 33}, entry=1), r"tensors\[1\]\.shape must be a list of at most 32"),
    (_with({"shape": "2x3"}, entry=1), r"tensors\[1\]\.shape must be a list"),
    (_with(drop="nbytes", entry=1), r"layout\.tensors\[1\]: missing nbytes"),
]


@pytest.mark.parametrize(("wire", "match"), MALFORMED)
def test_each_malformed_wire_value_is_refused_naming_the_field(wire: object, match: str) -> None:
    with pytest.raises(StagingLayoutError, match=match):
        StagingLayout.from_wire(wire)


def test_a_huge_count_of_tensors_is_refused_before_any_entry_is_read() -> None:
    wire = {"alignment": 1, "size": 0, "tensors": [None] * (MAX_STAGED_TENSORS + 1)}
    with pytest.raises(StagingLayoutError, match=f"has {MAX_STAGED_TENSORS + 1} entries: at most {MAX_STAGED_TENSORS}"):
        StagingLayout.from_wire(wire)


def test_an_overlap_hidden_behind_an_empty_tensor_is_found() -> None:
    entries = (
        StagedTensor("big", "float32", (16,), 0, 64),
        StagedTensor("empty", "float32", (0,), 8, 0),
        StagedTensor("inside", "float32", (2,), 32, 8),
    )
    with pytest.raises(StagingLayoutError, match=r"tensors\[2\] \('inside'\) at offset 32 overlaps .*\[0\] \('big'"):
        StagingLayout(entries, size=64, alignment=1)


def test_the_flat_api_exports_it() -> None:
    assert miles_core.StagingLayout is StagingLayout and "StagingLayout" in miles_core.__all__
