"""``LocalEngine``: a transformers model behind a request batcher, with SGLang's weight-update semantics.

Concurrent generate requests are gathered into batches (up to ``max_batch_size``) and sampled together on one
thread. Weight updates take the same lock as a batch, so they happen between batches and an engine never serves a
mix of versions: an update is checked in full before anything is copied.

Every request is admitted (checked against the model's vocabulary and context length) before it is queued, so a
bad request is refused alone and never fails the batch it would have joined; a request whose caller went away
(its task cancelled) leaves its batch at the next step.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import re
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

from miles_core.engines.sampling import MAX_TOP_LOGPROBS, GenerationRequest, GenerationResult, generate_batch
from miles_core.engines.staging import confined_staging_file, weight_staging_dir
from miles_core.engines.staging_layout import StagingLayout
from miles_core.engines.weights import (
    GROUP_BACKENDS,
    WeightLoadError,
    broadcast,
    check_named_tensors,
    checksum,
    decode_tensors,
    dtype_from_name,
    group_device,
    load_named_tensors,
    map_staging_file,
    new_weight_update_group,
    read_checkpoint_dir,
    read_safetensors_file,
    swap_in_named_tensors,
    unique_named_tensors,
)
from miles_core.errors import MilesError
from miles_core.models.hf_checkpoint import load_causal_lm

PAUSE_MODES = ("abort", "retract", "in_place")
MAX_STAGING_FILES = 4  # a trainer double-buffers; more would be stale mappings
MAX_WEIGHT_VERSION_CHARS = 128
_WEIGHT_VERSION = re.compile(r"[!-~](?:[ -~]*[!-~])?")  # printable ASCII, no space at either end
_CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


class RequestError(MilesError):
    """A request the engine refuses (the server answers 400); nothing was queued, loaded or changed."""


def check_weight_version(value: object, *, field: str = "weight_version") -> str:
    """A weight version as the engine keeps and sends it (in JSON and in the ``X-Weight-Version`` header): 1 to
    128 printable ASCII characters without surrounding spaces; an integer is taken as its decimal string."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or len(value) > MAX_WEIGHT_VERSION_CHARS or not _WEIGHT_VERSION.fullmatch(value):
        raise RequestError(
            f"{field} must be 1 to {MAX_WEIGHT_VERSION_CHARS} printable ASCII characters (it is "
            f"sent as an HTTP header), got {value!r:.100}"
        )
    return value


@dataclasses.dataclass
class _Pending:
    request: GenerationRequest
    future: asyncio.Future


@dataclasses.dataclass
class TokenUpdate:
    """Tokens sampled since the previous update of a stream (see :meth:`LocalEngine.stream`)."""

    output_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[float, int]]]  # empty unless the request asked for them


class LocalEngine:
    """Loads an HF checkpoint directory and generates from token ids."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        max_batch_size: int = 64,
        seed: int = 0,
        context_length: int | None = None,
        staging_dir: str | Path | None = None,
    ) -> None:
        """``context_length`` (prompt plus new tokens) defaults to the model's; ``staging_dir`` is the only
        directory whose files weight updates may read, map or remove (default: the user's, see
        :func:`miles_core.engines.staging.weight_staging_dir`)."""
        self.model_path = str(model_path)
        self.model = load_model(model_path)
        self.tokenizer = _load_tokenizer(model_path)
        self.eos_token_ids = _eos_token_ids(self.model)
        self.pad_token_id = self.model.config.pad_token_id or 0
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.context_length = _context_length(self.model.config, context_length)
        self.staging_dir = Path(staging_dir) if staging_dir is not None else weight_staging_dir()
        self.max_batch_size = max_batch_size
        self.seed = seed
        self._weight_version = "default"
        self.lock = threading.Lock()  # one batch or one weight update at a time
        self.groups: dict[str, Any] = {}
        self.weight_update_open = False  # SGLang's weight-update session (begin/end_weight_update)
        self.generated_tokens = 0
        self._queue: asyncio.Queue[_Pending] | None = None
        self._running = asyncio.Event()
        self._running.set()
        self._abort_message: str | None = None
        self._batches = 0
        self._loop_task: asyncio.Task | None = None
        self._held: _Pending | None = None  # taken from the queue, waiting for the engine to resume
        self._staging: dict[tuple[str, int], torch.Tensor] = {}  # mapped shared-memory staging files

    # -- generation -----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the batching loop in the running event loop."""
        self._queue = asyncio.Queue()
        self._loop_task = asyncio.create_task(self._batch_loop(), name="local-engine-batches")

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @weight_version.setter
    def weight_version(self, value: str) -> None:
        self._weight_version = check_weight_version(value)

    def admit(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` checked against the model (token ids in its vocabulary, prompt plus ``max_new_tokens``
        within its context; an unset ``max_new_tokens`` shrinks to what fits); a :class:`RequestError` if not."""
        ids, params = request.input_ids, request.params
        if not ids:
            raise RequestError("a prompt needs at least one token id")
        for where, tokens in (("input_ids", ids), ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in tokens if not _is_token_id(t, self.vocab_size)), None)
            if bad is not None:
                raise RequestError(f"{where} holds {bad!r}: token ids are integers from 0 to {self.vocab_size - 1}")
        room = self.context_length - len(ids)
        if room < 0:
            raise RequestError(
                f"the prompt has {len(ids)} tokens, more than the context length ({self.context_length})"
            )
        if "max_new_tokens" not in params.model_fields_set:
            params = params.model_copy(update={"max_new_tokens": min(params.max_new_tokens, room)})
        elif params.max_new_tokens > room:
            raise RequestError(
                f"max_new_tokens {params.max_new_tokens} with a prompt of {len(ids)} tokens exceeds "
                f"the context length ({self.context_length}): ask for at most {room}"
            )
        if params.stop and self.tokenizer is None:
            raise RequestError(
                "stop strings need the model's tokenizer, and this model directory has none: use stop_token_ids"
            )
        top = request.top_logprobs_num
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs_num must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top!r:.40}")
        return dataclasses.replace(request, input_ids=list(ids), params=params)

    def decode(self, output_ids: list[int]) -> str:
        """The text of ``output_ids`` as answers carry it (special tokens skipped, as SGLang does by default);
        empty without a tokenizer."""
        return self.tokenizer.decode(output_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Admit requests (all or none), queue them and wait for their results (they may be batched with other
        callers' requests). Cancelling the caller cancels its requests, running or queued."""
        assert self._queue is not None, "call start() first"
        admitted = [self.admit(request) for request in requests]
        loop = asyncio.get_running_loop()
        pending = [_Pending(request, loop.create_future()) for request in admitted]
        for item in pending:
            self._queue.put_nowait(item)
        try:
            return list(await asyncio.gather(*(item.future for item in pending)))
        except asyncio.CancelledError:
            for item in pending:  # queued ones are skipped (their futures are cancelled), running ones stop
                item.request.cancel.set()
            raise

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenUpdate | GenerationResult]:
        """Generate ``request`` (admitted and batched as by :meth:`generate`), yielding a :class:`TokenUpdate` as
        soon as tokens are sampled (everything sampled since the last one) and the :class:`GenerationResult` last.
        Closing the iterator early cancels the request."""
        loop = asyncio.get_running_loop()
        arrived: asyncio.Queue[tuple[int, float, list[tuple[float, int]] | None]] = asyncio.Queue()

        def on_token(token: int, logprob: float, top: list[tuple[float, int]] | None) -> None:
            loop.call_soon_threadsafe(arrived.put_nowait, (token, logprob, top))  # from the sampling thread

        task = asyncio.ensure_future(self.generate([dataclasses.replace(request, on_token=on_token)]))
        try:
            while not task.done():
                getter = asyncio.ensure_future(arrived.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                items = [getter.result()]
                while not arrived.empty():
                    items.append(arrived.get_nowait())
                yield TokenUpdate(
                    [t for t, _, _ in items],
                    [lp for _, lp, _ in items],
                    [top for _, _, top in items if top is not None],
                )
            yield (await task)[0]  # the whole result: a consumer may trust it over the updates
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _batch_loop(self) -> None:
        assert self._queue is not None
        while True:
            first = self._held = await self._queue.get()
            await self._running.wait()
            self._held = None
            if first.future.done():  # aborted while held
                continue
            batch = [first]
            while len(batch) < self.max_batch_size and not self._queue.empty():
                item = self._queue.get_nowait()
                if not item.future.done():  # cancelled while queued
                    batch.append(item)
            await self._serve(batch)

    async def _serve(self, batch: list[_Pending]) -> None:
        """Run a batch; if it fails, run its requests one by one, so a fault fails only the request it is in."""
        try:
            results = await asyncio.to_thread(self._run_batch, [item.request for item in batch])
        except Exception as exc:
            if len(batch) > 1:
                for item in batch:
                    await self._serve([item])
            elif not batch[0].future.done():
                batch[0].future.set_exception(exc)
            return
        for item, result in zip(batch, results, strict=True):
            if not item.future.done():
                item.future.set_result(result)

    def _run_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        with self.lock:
            self._batches += 1
            results = generate_batch(
                self.model,
                requests,
                eos_token_ids=self.eos_token_ids,
                pad_token_id=self.pad_token_id,
                default_seed=self.seed * 1_000_003 + self._batches * 4099,
                should_abort=lambda: self._abort_message,
                decode=self.decode if self.tokenizer is not None else None,
            )
        self.generated_tokens += sum(len(r.output_ids) for r in results)
        return results

    @property
    def queued(self) -> int:
        return self._queue.qsize() if self._queue is not None else 0

    # -- pause / continue -----------------------------------------------------------------------------------

    async def pause(self, mode: str = "abort") -> None:
        """Stop serving: ``abort`` ends running and queued requests with an abort reason; ``retract`` and
        ``in_place`` hold queued requests until :meth:`resume` (the running batch finishes)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._running.clear()
        if mode == "abort":
            self._abort_message = "aborted by pause_generation"
            self._abort_queued()
            await asyncio.to_thread(self._wait_idle)
            self._abort_message = None

    def resume(self) -> None:
        self._running.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def _abort_queued(self) -> None:
        assert self._queue is not None
        held = [self._held] if self._held is not None else []
        while not self._queue.empty():
            held.append(self._queue.get_nowait())
        for item in held:
            if not item.future.done():
                result = GenerationResult([], [], {"type": "abort", "message": "aborted by pause_generation"})
                item.future.set_result(result)

    def _wait_idle(self) -> None:
        with self.lock:
            pass

    # -- weights ----------------------------------------------------------------------------------------------

    def _load(self, tensors: dict[str, torch.Tensor], weight_version: str | None) -> int:
        version = None if weight_version is None else check_weight_version(weight_version)  # before any copy
        with self.lock:
            loaded = load_named_tensors(self.model, tensors)
            if version is not None:
                self.weight_version = version
        return loaded

    def update_from_disk(self, model_path: str, weight_version: str | None) -> int:
        return self._load(read_checkpoint_dir(model_path), weight_version)

    def update_from_tensor(self, serialized: list[str], weight_version: str | None, load_format: str | None) -> int:
        """``load_format`` ``safetensors`` (default): base64 safetensors bytes; ``safetensors_path``: the path of a
        safetensors file in the staging directory, removed once loaded (a refused one is left to its sender). Tensors
        in a shared-memory staging file come through :meth:`update_from_staging`."""
        if len(serialized) != 1:
            raise WeightLoadError(f"the local engine has one rank; got {len(serialized)} serialized payloads")
        if not isinstance(serialized[0], str):
            raise WeightLoadError(f"serialized_named_tensors[0] must be a string, got {type(serialized[0]).__name__}")
        if load_format == "safetensors_path":
            path = confined_staging_file(serialized[0], self.staging_dir, field="serialized_named_tensors[0]")
            loaded = self._load(read_safetensors_file(path), weight_version)
            path.unlink(missing_ok=True)  # consumed; only now, so that a refused update deletes nothing
            return loaded
        try:
            data = base64.b64decode(serialized[0], validate=True)
        except ValueError as exc:
            raise WeightLoadError(f"serialized_named_tensors[0] is not base64: {exc}") from None
        return self._load(decode_tensors(data), weight_version)

    def update_from_staging(
        self, *, path: str, buffer_size: int, layout: StagingLayout, swap: bool, weight_version: str | None
    ) -> int:
        """Copy the tensors that ``layout`` places in a shared-memory staging file that the trainer filled (mapped
        once), or, with ``swap``, point the parameters at them (zero copy: the trainer never writes that file again
        while the engine may still serve from it). The file must be a staging file (see
        :mod:`miles_core.engines.staging`) at least ``buffer_size`` bytes long: mapping never grows or writes it."""
        version = None if weight_version is None else check_weight_version(weight_version)
        if layout.size > buffer_size:
            raise WeightLoadError(
                f"layout.size {layout.size} is beyond buffer_size {buffer_size}: the layout's tensors must lie in the "
                f"staging file"
            )
        resolved = confined_staging_file(path, self.staging_dir, field="staging_path")
        key = (str(resolved), buffer_size)
        buffer = self._staging.get(key)
        if buffer is None:
            if resolved.stat().st_size < buffer_size:
                raise WeightLoadError(f"staging file {path} is smaller than buffer_size {buffer_size} bytes")
            buffer = map_staging_file(*key)
        views = layout.views(buffer)
        if key not in self._staging:  # cached only once its first request checked out
            while len(self._staging) >= MAX_STAGING_FILES:
                self._staging.pop(next(iter(self._staging)))
            self._staging[key] = buffer
        if not swap:
            return self._load(views, version)
        with self.lock:
            loaded = swap_in_named_tensors(self.model, views)
            if version is not None:
                self.weight_version = version
        return loaded

    def init_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        if backend not in GROUP_BACKENDS:
            raise MilesError(f"backend must be one of {', '.join(GROUP_BACKENDS)}, got {backend!r}")
        if group_name in self.groups:
            raise MilesError(f"weight update group {group_name!r} already exists; destroy it first")
        group = new_weight_update_group(
            master_address=master_address,
            master_port=master_port,
            rank=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        self.groups[group_name] = (group, group_device(backend))

    def update_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None,
    ) -> int:
        if not self.weight_update_open:  # as SGLang: a receive outside a session would never join the broadcast
            raise MilesError(
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        if group_name not in self.groups:
            raise MilesError(f"no weight update group {group_name!r}; call /init_weights_update_group first")
        if not len(names) == len(dtypes) == len(shapes):
            raise MilesError("names, dtypes and shapes must have the same length")
        group, device = self.groups[group_name]
        # Checked against the model before anything is allocated or received: a wrong name or shape is refused.
        announced = {
            name: torch.empty(shape, dtype=dtype_from_name(dtype), device="meta")
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True)
        }
        check_named_tensors(self.model, announced)
        received = {}
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            tensor = torch.empty(shape, dtype=dtype_from_name(dtype), device=device)
            broadcast(group, tensor, root=0)
            received[name] = tensor
        return self._load(received, weight_version)

    def weights_checksum(self) -> str:
        """SHA-256 of the served weights (see :func:`miles_core.engines.weights.checksum`)."""
        with self.lock:
            return checksum(unique_named_tensors(self.model.state_dict().items()))

    def begin_weight_update(self) -> None:
        """Open the weight-update session that distributed updates need (one at a time, as SGLang)."""
        if self.weight_update_open:
            raise MilesError("a weight-update session is already open; call end_weight_update() first")
        self.weight_update_open = True

    def end_weight_update(self) -> None:
        if not self.weight_update_open:
            raise MilesError("no weight-update session is open; call begin_weight_update() first")
        self.weight_update_open = False

    def destroy_group(self, group_name: str) -> None:
        if self.groups.pop(group_name, None) is None:
            raise MilesError(f"no weight update group {group_name!r}")


def load_model(model_path: str | Path) -> transformers.PreTrainedModel:
    """An HF checkpoint directory as an eval-mode transformers model."""
    return load_causal_lm(model_path).eval()


def _load_tokenizer(model_path: str | Path) -> Any:
    path = Path(model_path)
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def _is_token_id(token: object, vocab_size: int) -> bool:
    return isinstance(token, int) and not isinstance(token, bool) and 0 <= token < vocab_size


def _context_length(config: Any, requested: int | None) -> int:
    """The longest prompt plus completion: the model's (its position limit), or ``requested`` if not longer."""
    native = next(
        (getattr(config, key) for key in _CONTEXT_LENGTH_KEYS if isinstance(getattr(config, key, None), int)), None
    )
    if requested is not None and requested < 1:
        raise MilesError(f"context length must be at least 1, got {requested}")
    if native is None:
        if requested is None:
            raise MilesError(f"the model config has none of {', '.join(_CONTEXT_LENGTH_KEYS)}: pass --context-length")
        return requested
    if requested is not None and requested > native:
        raise MilesError(f"context length {requested} exceeds the model's ({native})")
    return requested or native


def _eos_token_ids(model: transformers.PreTrainedModel) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None) or model.config.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)
