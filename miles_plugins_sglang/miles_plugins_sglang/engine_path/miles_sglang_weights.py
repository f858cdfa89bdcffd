"""Miles' weight loader inside an SGLang server: loads a version's tensors from a staging file in shared memory.

This module runs in the SGLang engine's own environment (which has torch and sglang, not Miles): the sglang plugin
puts its directory on the engine's ``PYTHONPATH`` and names :func:`load_staged` in ``--custom-weight-loader``. A
sender (the trainer, a Megatron rank, or the rdt receiver beside the engine) lays a version's HF-named tensors out
in a staging file, then calls SGLang's ``/update_weights_from_tensor`` with ``load_format`` naming this function and,
for each TP rank, a pickled ``[(spec, placeholder)]`` whose ``spec`` is a JSON string ``{"staging_path",
"buffer_size", "layout"}`` (the layout is Miles' ``StagingLayout`` wire form). SGLang's own ``SafeUnpickler`` reads
that payload (a string and an empty tensor: no tensor data crosses the request); each TP rank maps the file and hands
views of it to the model's ``load_weights``, which copies them into its (sharded) parameters: one memory copy.
A spec ``{"describe": true, "request", "tp_rank"}`` loads nothing: the outcome lists the model's parameters and
their dtypes (:func:`parameter_dtypes`), from which senders stage each tensor in the dtype it is held in.

Staging files are accepted only as regular files directly inside ``$MILES_WEIGHT_STAGING_DIR`` (set by the plugin
at launch to the staging directory of the engine's user), and a layout is checked against the file before any
parameter is written: a bad request leaves the served weights as they were. SGLang answers ``success`` whatever a
custom loader does, and an exception raised here would end the server, so the loader never raises: it writes what
happened to an outcome file in the staging directory (``miles-load-<request>.tp<rank>.json``), which the sender reads
after the request and turns into its error.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import torch

STAGING_DIR_ENV = "MILES_WEIGHT_STAGING_DIR"
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""The dtypes a staged tensor may have (those of Miles' ``STAGING_DTYPES``)."""


class StagedLoadError(ValueError):
    """A staging request that names no staging file, or whose layout does not fit it; nothing was loaded."""


def load_staged(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader: every spec of ``named_tensors`` (see the module docstring) loaded into
    ``model``. All specs are checked before the first parameter is written; the outcome goes to each spec's status
    file, never up as an exception."""
    specs = [_parse(spec) for spec, _placeholder in named_tensors]
    if any(spec.get("describe") is True for spec in specs):
        _report(specs, ok=True, error=None, parameters=parameter_dtypes(model))
        return
    try:
        staged = [staged_views(spec) for spec in specs]
    except StagedLoadError as exc:
        _report(specs, ok=False, error=f"refused, nothing loaded: {exc}")
        return
    loading = ["?"]  # the tensor SGLang's loader is at: named in the error when it raises

    def tracked(views: list[tuple[str, torch.Tensor]]):
        for name, view in views:
            loading[0] = name
            yield name, view

    started = time.perf_counter()
    try:
        for views in staged:
            model.load_weights(tracked(views))
    except Exception as exc:  # SGLang's loaders raise anything; raising here would end the server
        _report(specs, ok=False, error=f"SGLang could not load {loading[0]}: {type(exc).__name__}: {exc}")
        return
    _report(specs, ok=True, error=None, loaded=sum(map(len, staged)), seconds=time.perf_counter() - started)


def parameter_dtypes(model: torch.nn.Module) -> dict[str, list]:
    """Every parameter of the model (SGLang's names: fused ones such as ``qkv_proj`` included), the dtype it is held
    in and its number of dimensions (``["bfloat16", 2]``): what a sender needs to stage each tensor in the dtype it
    will be held in."""
    return {name: [str(param.dtype).removeprefix("torch."), param.dim()] for name, param in model.named_parameters()}


def _parse(spec_text: object) -> dict:
    try:
        spec = json.loads(spec_text) if isinstance(spec_text, str) else None
    except ValueError:
        spec = None
    return spec if isinstance(spec, dict) else {}


def _report(specs: list[dict], **outcome: object) -> None:
    """Write ``outcome`` to each spec's outcome file in the staging directory (for well-formed request names)."""
    directory = os.environ.get(STAGING_DIR_ENV)
    for spec in specs:
        request, rank = spec.get("request"), spec.get("tp_rank", 0)
        if directory and isinstance(request, str) and request.isalnum() and _is_count(rank):
            (Path(directory) / f"miles-load-{request}.tp{rank}.json").write_text(json.dumps(outcome))


def staged_views(spec: dict) -> list[tuple[str, torch.Tensor]]:
    """The tensors a spec describes, as views into its mapped staging file, after checking the path and layout."""
    try:
        path, buffer_size, layout = spec["staging_path"], spec["buffer_size"], spec["layout"]
    except KeyError as exc:
        raise StagedLoadError(f"miles staging spec is not {{staging_path, buffer_size, layout}}: {exc}") from None
    if not _is_count(buffer_size):
        raise StagedLoadError(f"miles staging spec: buffer_size {buffer_size!r} is not a byte count")
    buffer = mapped(staging_file(path, buffer_size), buffer_size)
    return [
        (name, buffer[offset : offset + nbytes].view(dtype).view(shape))
        for name, dtype, shape, offset, nbytes in (
            _entry(row, index, buffer_size) for index, row in enumerate(_rows(layout))
        )
    ]


MAPPED_FILES = 4
"""Staging files kept mapped between loads: senders alternate two per engine (double buffering); mapping a file anew
would fault every page of it in again on each load."""
_mapped: dict[tuple[str, int, int, int], torch.Tensor] = {}


def mapped(file: Path, buffer_size: int) -> torch.Tensor:
    """The file as a uint8 tensor of ``buffer_size`` bytes, mapped once while it stays the same file (same inode)."""
    info = os.stat(file)
    key = (str(file), info.st_ino, info.st_dev, buffer_size)
    buffer = _mapped.pop(key, None)
    if buffer is None:
        buffer = torch.from_file(str(file), shared=True, size=max(buffer_size, 1), dtype=torch.uint8)
    _mapped[key] = buffer  # the most recently used last
    while len(_mapped) > MAPPED_FILES:  # a replaced or removed file's pages go once nothing maps them
        _mapped.pop(next(iter(_mapped)))
    return buffer


def staging_file(path: object, buffer_size: int) -> Path:
    """``path`` when it is a regular file directly inside the staging directory, at least ``buffer_size`` bytes."""
    directory = os.environ.get(STAGING_DIR_ENV)
    if not directory:
        raise StagedLoadError(f"this engine was started without {STAGING_DIR_ENV}: it loads no staging files")
    if not isinstance(path, str):
        raise StagedLoadError(f"miles staging spec: staging_path {path!r} is not a string")
    resolved = Path(path).resolve()
    if resolved.parent != Path(directory).resolve():
        raise StagedLoadError(f"{path!r} is not a file of the weight-staging directory {directory!r}")
    try:
        info = os.stat(resolved)
    except OSError as exc:
        raise StagedLoadError(f"staging file {path!r}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode) or info.st_size < buffer_size:
        raise StagedLoadError(f"staging file {path!r} is not a regular file of at least {buffer_size} bytes")
    return resolved


def _rows(layout: object) -> list[object]:
    tensors = layout.get("tensors") if isinstance(layout, dict) else None
    if not isinstance(tensors, list):
        raise StagedLoadError("miles staging spec: layout.tensors is not a list")
    return tensors


def _entry(row: object, index: int, buffer_size: int) -> tuple[str, torch.dtype, list[int], int, int]:
    where = f"layout.tensors[{index}]"
    if not isinstance(row, dict):
        raise StagedLoadError(f"{where} is not an object")
    name, dtype, shape, offset, nbytes = (row.get(key) for key in ("name", "dtype", "shape", "offset", "nbytes"))
    if not isinstance(name, str) or dtype not in DTYPES:
        raise StagedLoadError(f"{where}: name {name!r} or dtype {dtype!r} is not accepted")
    if not isinstance(shape, list) or not all(map(_is_count, shape)) or not _is_count(offset):
        raise StagedLoadError(f"{where} ({name}): shape {shape!r} or offset {offset!r} is not made of counts")
    element = torch.empty(0, dtype=DTYPES[dtype]).element_size()
    expected = element * _product(shape)
    if nbytes != expected or offset % element or offset + expected > buffer_size:
        raise StagedLoadError(f"{where} ({name}): {nbytes!r} bytes at {offset} do not fit {dtype}{shape} in the file")
    return name, DTYPES[dtype], shape, offset, expected


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _product(shape: list[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total
