"""Loading a staging file into an engine, whichever staging route it serves, and checking what an SGLang engine holds.

Two engines copy a version out of a staging file in shared memory on their node (the route
:data:`~miles_core.weight_transfer.routes.STAGING_COPY`):

* Miles' local engine through its own ``/update_weights_from_staging`` (or serves from the file: ``swap``);
* SGLang through its ``/update_weights_from_tensor`` with ``load_format`` naming Miles' loader, which runs in the
  SGLang server (``miles_plugins_sglang/engine_path/miles_sglang_weights.py``). The request carries, per TP rank, a
  pickled ``[(spec, empty tensor)]`` (SGLang reads it with its ``SafeUnpickler``: a string and an empty tensor, no
  tensor data); the loader maps the file and copies the tensors into the model. SGLang answers ``success`` whatever a
  custom loader did, so the loader writes its outcome into the staging directory and :func:`load_staged` reads it.

SGLang loads inside a weight-update session (``/begin_weight_update`` ... ``/end_weight_update``), in which its CPU
weights are unpacked: :func:`verify_sampled` reads sampled parameters back there (``/get_weights_by_name``, the first
row of each) and compares them with the sender's, rounded to the served dtype (the same rounding SGLang's copy does:
they must be equal).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import pickle
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import torch

from miles_core.engines.client import EngineClient
from miles_core.engines.staging import weight_staging_dir
from miles_core.errors import EngineError, MilesError
from miles_core.weight_transfer.protocol import EngineEndpoint
from miles_core.weight_transfer.staging_layout import STAGING_DTYPES, StagingLayout

SERVED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "float32": torch.float32}


class WeightMismatchError(MilesError):
    """An engine holds other values than the sender sent for a parameter (named, with the engine)."""


async def load_staged(
    client: EngineClient,
    endpoint: EngineEndpoint,
    *,
    staging_path: str | Path,
    buffer_size: int,
    layout: StagingLayout,
    swap: bool = False,
    weight_version: str | None = None,
    flush_cache: bool = True,
) -> None:
    """Have the engine load ``layout``'s tensors from the staging file (``swap``: serve from it, local engine only;
    ``weight_version``: the version it serves from then on; ``flush_cache``: SGLang drops its prefix cache, which
    the last load of a version must do)."""
    loader = endpoint.capabilities.staging_loader
    if loader is None:
        await client.update_weights_from_staging(
            staging_path=str(staging_path),
            buffer_size=buffer_size,
            layout=layout,
            swap=swap,
            weight_version=weight_version,
        )
        return
    await check_against_served(client, endpoint, layout)
    spec = {"staging_path": str(staging_path), "buffer_size": buffer_size, "layout": layout.to_wire()}
    await _call_loader(client, endpoint, spec, weight_version=weight_version, flush_cache=flush_cache)


async def _call_loader(
    client: EngineClient,
    endpoint: EngineEndpoint,
    spec: dict,
    *,
    weight_version: str | None = None,
    flush_cache: bool = False,
) -> list[dict]:
    """One request to Miles' loader in the SGLang engine, ``spec`` for every TP rank; each rank's outcome."""
    request = uuid.uuid4().hex
    ranks = range(endpoint.capabilities.tp_size)
    specs = [json.dumps({**spec, "request": request, "tp_rank": rank}) for rank in ranks]
    payloads = [base64.b64encode(pickle.dumps([(text, torch.empty(0))])).decode() for text in specs]
    await client.update_weights_from_loader(
        payloads,
        load_format=endpoint.capabilities.staging_loader,
        weight_version=weight_version,
        flush_cache=flush_cache,
    )
    return [_read_outcome(endpoint, request, rank) for rank in ranks]


_HELD_DTYPES: dict[str, dict[str, tuple[str, int]]] = {}
"""Per engine URL, its parameters (SGLang's names) and the dtype and number of dimensions each is held in."""

NARROW_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes a tensor is narrowed to when staged for an engine that holds it so."""


async def held_dtypes(
    client: EngineClient, endpoint: EngineEndpoint, *, open_session: bool
) -> dict[str, tuple[str, int]]:
    """The engine's parameters and the dtype and dimensions each is held in (asked of Miles' loader once per engine,
    in a weight-update session: ``open_session`` opens one for the question, else one is open; ``{}`` for an engine
    without the loader)."""
    if endpoint.capabilities.staging_loader is None:
        return {}
    held = _HELD_DTYPES.get(endpoint.url)
    if held is None:
        async with weight_update_sessions([client] if open_session else []):
            outcome = (await _call_loader(client, endpoint, {"describe": True}))[0]
        held = {name: (str(dtype), int(dims)) for name, (dtype, dims) in outcome.get("parameters", {}).items()}
        _HELD_DTYPES[endpoint.url] = held
    return held


def staging_dtypes(
    tensors: Sequence[tuple[str, torch.Tensor]], engines: Sequence[Mapping[str, tuple[str, int]]]
) -> dict[str, torch.dtype]:
    """The tensors to stage in a narrower dtype for ``engines`` (each as :func:`held_dtypes` describes it), all of
    which load the same staging file: a floating tensor of two or more dimensions that every engine holds in the
    same dtype of :data:`NARROW_DTYPES`, narrower than the tensor's. The staging copy then rounds as the engine's own
    copy into its parameter would (round to nearest even), so the engine holds the same values, and the engine
    copies half the bytes. A tensor the engine renames (``q_proj`` into ``qkv_proj``) takes the dtype all of the
    engine's parameters of two or more dimensions share, if they share one (else it is staged as it is: a model that
    keeps a router in float32 keeps its fused experts' tensors at full width too); vectors (norms, biases, routing
    biases) are staged as they are: they are few bytes, and some are held in float32."""
    if not engines or not all(engines):
        return {}
    fallbacks = [_common_matrix_dtype(held) for held in engines]
    chosen: dict[str, torch.dtype] = {}
    for name, tensor in tensors:
        if not tensor.is_floating_point() or tensor.dim() < 2:
            continue
        pairs = zip(engines, fallbacks, strict=True)
        targets = {held[name][0] if name in held else fallback for held, fallback in pairs}
        target = SERVED_DTYPES.get(targets.pop()) if len(targets) == 1 else None
        if target in NARROW_DTYPES and target.itemsize < tensor.element_size():
            chosen[name] = target
    return chosen


def _common_matrix_dtype(held: Mapping[str, tuple[str, int]]) -> str | None:
    dtypes = {dtype for dtype, dims in held.values() if dims >= 2}
    return dtypes.pop() if len(dtypes) == 1 else None


_SERVED_TENSORS: dict[str, dict[str, tuple[tuple[int, ...], bool]]] = {}
"""Per engine URL, the served checkpoint's tensors (shape, floating) as read from its safetensors headers."""


async def check_against_served(client: EngineClient, endpoint: EngineEndpoint, layout: StagingLayout) -> None:
    """Before anything is loaded: every staged tensor that the engine's checkpoint has must have its shape and kind
    (floating or not) there; a :class:`WeightMismatchError` naming the parameter, the engine and both otherwise (the
    engine keeps serving what it served). Names the checkpoint lacks (a tied ``lm_head``) are SGLang's to judge."""
    served = _SERVED_TENSORS.get(endpoint.url)
    if served is None:
        model_path = (await client.model_info()).get("model_path")
        served = await asyncio.to_thread(checkpoint_tensors, str(model_path))
        _SERVED_TENSORS[endpoint.url] = served
    for entry in layout.tensors:
        if entry.name not in served:
            continue
        shape, floating = served[entry.name]
        sent_floating = STAGING_DTYPES[entry.dtype].is_floating_point
        if tuple(entry.shape) != shape or sent_floating != floating:
            raise WeightMismatchError(
                f"weight_transfer to engine {endpoint.name} ({endpoint.url}): parameter {entry.name} is "
                f"{list(entry.shape)} from the trainer (staged as {entry.dtype}), but the engine serves it as "
                f"{'floating' if floating else 'integer'}{list(shape)}; nothing was loaded, the engine keeps its "
                "weights"
            )


def checkpoint_tensors(model_path: str) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Every tensor of the safetensors files in ``model_path``: its shape and whether it is floating (headers only)."""
    from safetensors import safe_open  # deferred: only where SGLang engines load staged files

    found: dict[str, tuple[tuple[int, ...], bool]] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open is no mapping
                piece = tensors.get_slice(name)
                found[name] = (tuple(piece.get_shape()), piece.get_dtype().startswith(("F", "BF")))
    return found


def _read_outcome(endpoint: EngineEndpoint, request: str, rank: int) -> dict:
    """The outcome the loader wrote for TP rank ``rank`` (in this node's staging directory, the engine's too)."""
    status = weight_staging_dir() / f"miles-load-{request}.tp{rank}.json"
    try:
        outcome = json.loads(status.read_text())
    except (OSError, ValueError):
        raise EngineError(
            f"engine {endpoint.name} ({endpoint.url}) answered the staged load but its TP rank {rank} wrote no outcome "
            f"({status.name}): was it started with Miles' loader (--custom-weight-loader "
            f"{endpoint.capabilities.staging_loader}, set by miles-plugins-sglang)?"
        ) from None
    finally:
        status.unlink(missing_ok=True)
    if not outcome.get("ok"):
        raise EngineError(f"engine {endpoint.name} ({endpoint.url}) TP rank {rank}: {outcome.get('error')}")
    return outcome


@contextlib.asynccontextmanager
async def weight_update_sessions(clients: Sequence[EngineClient]) -> AsyncIterator[None]:
    """Every engine's weight-update session open for the body and closed after it; never left open on one engine when
    another refused to open (a later update could not open it again)."""
    opened = await asyncio.gather(*(c.begin_weight_update() for c in clients), return_exceptions=True)
    failures = [result for result in opened if isinstance(result, BaseException)]
    if failures:
        await end_sessions([c for c, r in zip(clients, opened, strict=True) if not isinstance(r, BaseException)])
        raise failures[0]
    try:
        yield
    except BaseException:
        await end_sessions(clients)
        raise
    await asyncio.gather(*(client.end_weight_update() for client in clients))


async def end_sessions(clients: Sequence[EngineClient]) -> None:
    """Close sessions on the way out of a failure (an engine that died cannot answer: that is not news)."""
    await asyncio.gather(*(client.end_weight_update() for client in clients), return_exceptions=True)


def sample_names(names: Sequence[str], *, count: int, version: int) -> list[str]:
    """``count`` of ``names`` spread over the list, a different set each version, so a run checks every one."""
    if not names or count <= 0:
        return []
    step = max(1, len(names) // count)
    return sorted({names[(version + i * step) % len(names)] for i in range(min(count, len(names)))})


async def served_dtype(client: EngineClient) -> torch.dtype | None:
    """The dtype the SGLang engine serves in (``/server_info``'s ``dtype``; ``None`` for ``auto``)."""
    info = await client.server_info()
    return SERVED_DTYPES.get(str(info.get("dtype")))


async def verify_sampled(
    client: EngineClient, endpoint: EngineEndpoint, expected: Mapping[str, torch.Tensor], *, version: int
) -> None:
    """Each parameter of ``expected`` as the engine holds it (its first row) equal to the sender's rounded to the
    served dtype; a :class:`WeightMismatchError` naming the parameter and the engine otherwise. Nothing to check (the
    default, verification off) asks the engine nothing."""
    if not expected:
        return
    dtype = await served_dtype(client)
    for name, tensor in expected.items():
        got = await client.weights_by_name(name, truncate_size=1)
        if got is None:
            raise WeightMismatchError(f"engine {endpoint.name} does not report {name} (/get_weights_by_name)")
        head = tensor.detach().reshape(tensor.shape[0], -1)[0] if tensor.dim() > 1 else tensor.detach().reshape(-1)[:1]
        served = torch.tensor(got[0] if got and isinstance(got[0], list) else got, dtype=torch.float32).reshape(-1)
        candidates = [dtype] if dtype is not None else list(dict.fromkeys(SERVED_DTYPES.values()))
        if served.shape != head.shape or not any(torch.equal(served, head.to(d).to(torch.float32)) for d in candidates):
            raise WeightMismatchError(
                f"engine {endpoint.name} ({endpoint.url}) holds other values for {name} than the trainer sent in "
                f"v{version}: first row {served[:4].tolist()}... against {head[:4].tolist()}... (served dtype "
                f"{dtype}); the run stops"
            )
