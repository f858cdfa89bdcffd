"""``LocalEngine``: a transformers model behind a continuous batcher, with SGLang's weight-update semantics.

Concurrent generate requests join and leave one running batch between decode steps (up to ``max_batch_size``
rows, see :mod:`.running_batch`), stepped on one worker thread: a short request's answer comes
as soon as it ends, whatever else runs. Weight updates wait for a step boundary at which nothing is being stepped
(the engine paused or idle) and hold back new requests meanwhile, so an update never lands inside a step and a
request is never served a mix of versions; an update is checked in full before anything is copied.

Every request is admitted (checked against the model's vocabulary and context length) before it is queued, so a
bad request is refused alone and never fails the batch it would have joined; a request whose caller went away
(its task cancelled) leaves the batch at the next step.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import dataclasses
import logging
import re
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

from miles_core.builtin.local_engine.batch_generation import new_running_batch
from miles_core.builtin.local_engine.lora_adapters import LoraAdapters
from miles_core.builtin.local_engine.running_batch import result_of
from miles_core.builtin.local_engine.sampling import MAX_TOP_LOGPROBS, GenerationRequest, GenerationResult, Sampler
from miles_core.engines.staging import confined_staging_file, weight_staging_dir
from miles_core.engines.weights import (
    GROUP_BACKENDS,
    WeightLoadError,
    broadcast,
    check_named_tensors,
    decode_tensors,
    dtype_from_name,
    group_device,
    load_named_tensors,
    new_weight_update_group,
    read_checkpoint_dir,
    read_safetensors_file,
    swap_in_named_tensors,
)
from miles_core.errors import MilesError
from miles_core.models.hf_checkpoint import checkpoint_named_tensors, load_causal_lm
from miles_core.training.lora import base_and_merged
from miles_core.weight_transfer.digests import checksum
from miles_core.weight_transfer.staging_layout import StagingLayout, map_staging_file

PAUSE_MODES = ("abort", "retract", "in_place")
ABORT_MESSAGE = "aborted by pause_generation"
CANCELLED = {"type": "abort", "message": "cancelled: the client went away"}
MAX_STAGING_FILES = 4  # a trainer double-buffers; more would be stale mappings
MAX_WEIGHT_VERSION_CHARS = 128
_WEIGHT_VERSION = re.compile(r"[!-~](?:[ -~]*[!-~])?")  # printable ASCII, no space at either end
_CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
logger = logging.getLogger(__name__)


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


@dataclasses.dataclass(eq=False)
class _Pending:
    """A request from admission to its result: queued, a row of the running batch, retracted or held."""

    request: GenerationRequest
    future: asyncio.Future
    sampler: Sampler | None = None  # made when it first joins the batch; kept when it leaves it and comes back
    solo: bool = False  # it was in a step that failed: it runs alone, so that a fault fails only its own request


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
        self.lock = threading.Lock()  # a decode step or a weight update (or read) at a time, never one inside the other
        self.groups: dict[str, Any] = {}
        self.weight_update_open = False  # SGLang's weight-update session (begin/end_weight_update)
        self._state = threading.Condition()  # guards what follows; the decode thread takes it at step boundaries
        self._waiting: collections.deque[_Pending] = collections.deque()  # queued; retracted ones go to the front
        self._batch = new_running_batch(self.model, pad_token_id=self.pad_token_id)  # the decode thread's alone
        self._mode: str | None = None  # the pause mode; None while serving
        self._abort: str | None = None  # a pause("abort") that the decode thread has yet to apply to the batch
        self._busy = False  # the decode thread steps requests: weights wait until it stops (paused or idle)
        self._updates_waiting = 0  # weight updates (or reads) waiting: nothing joins the batch, so that it drains
        self._loading = False  # a weight update (or read) holds the weights: nothing is stepped
        self._stale = False  # the weights changed under the batch's KV cache: its requests are prefilled again
        self._boundary_waiters: list[asyncio.Future] = []  # pause() calls waiting for the next step boundary
        self._requests = 0  # requests that joined the batch: the default seeds of those without a sampling_seed
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._staging: dict[tuple[str, int], torch.Tensor] = {}  # mapped shared-memory staging files
        self.adapters = LoraAdapters(self.model)  # LoRA adapters by name; the running batch runs one at a time

    # -- generation -----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the decode loop in the running event loop."""
        self._event_loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._loop_task = asyncio.create_task(self._batch_loop(), name="local-engine-decode")

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
            bad = _bad_token_id(tokens, self.vocab_size)
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
        if request.return_routed_experts and self._batch.routing is None:
            raise RequestError(
                f"return_routed_experts: {self._batch.routing_refusal}; ask for it only of an MoE model whose "
                "routing can be captured (Qwen3-MoE)"
            )
        if request.lora_name is not None and request.lora_name not in self.adapters.paths:
            raise RequestError(
                f"lora_path {request.lora_name[:200]!r} names no loaded adapter (loaded: {self.adapters.describe()}); "
                "load it with /load_lora_adapter"
            )
        return dataclasses.replace(request, input_ids=list(ids), params=params)

    def decode(self, output_ids: list[int]) -> str:
        """The text of ``output_ids`` as answers carry it (special tokens skipped, as SGLang does by default);
        empty without a tokenizer."""
        return self.tokenizer.decode(output_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def decode_many(self, outputs: list[list[int]]) -> list[str]:
        """:meth:`decode` of each of ``outputs``: a fast tokenizer that cleans up nothing decodes them all in one call
        into its Rust side (transformers' own loop over them costs more than the decoding)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and getattr(self.tokenizer, "clean_up_tokenization_spaces", True) is False:
            return backend.decode_batch(outputs, skip_special_tokens=True)
        return [self.decode(ids) for ids in outputs]

    async def generate(
        self, requests: Sequence[GenerationRequest], *, admitted: bool = False
    ) -> list[GenerationResult]:
        """Admit requests (all or none; ``admitted``: the caller passed each through :meth:`admit` already, as the
        server does for a whole batch before it queues any), queue them and wait for their results (they may be
        batched with other callers' requests). Cancelling the caller cancels its requests, running or queued."""
        assert self._event_loop is not None, "call start() first"
        admitted = list(requests) if admitted else [self.admit(request) for request in requests]
        loop = asyncio.get_running_loop()
        pending = [_Pending(request, loop.create_future()) for request in admitted]
        with self._state:
            self._waiting.extend(pending)
        self._kick()
        try:
            return list(await asyncio.gather(*(item.future for item in pending)))
        except asyncio.CancelledError:
            for item in pending:  # queued ones are skipped (their futures are cancelled), running ones leave
                item.request.cancel.set()
            self._kick()
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

    @property
    def generated_tokens(self) -> int:
        return self._batch.generated_tokens

    @property
    def queued(self) -> int:
        return len(self._waiting)

    # -- the decode loop ----------------------------------------------------------------------------------------

    async def _batch_loop(self) -> None:
        """Run the decode thread whenever there may be something to do (it returns once nothing is left to step)."""
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await asyncio.to_thread(self._decode_loop)
            except Exception as exc:  # a fault of the loop's own: what it ran fails, the engine serves on
                logger.exception("the decode loop failed")
                for item in self._batch.clear():
                    self._settle(item, error=exc)
                with self._state:
                    self._busy = False
                    self._state.notify_all()

    def _kick(self) -> None:
        """Have the decode thread look at the queue and the flags (callable from any thread)."""
        if self._event_loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nothing is left to serve
                self._event_loop.call_soon_threadsafe(self._wake.set)

    def _decode_loop(self) -> None:
        """The decode thread: at each step boundary, apply pauses, aborts, cancellations and weight updates and take
        the queued requests that join; then prefill those, or else step the batch. A prefill takes every request
        queued (arrivals in a burst share one forward), and never two in a row while the batch has rows to step:
        however fast requests arrive, running ones keep going. Returns when nothing is left to step."""
        prefilled = False
        while True:
            with self._state:
                joining = self._boundary(admit=not prefilled or not self._batch.rows)
                if not self._busy:
                    return
            with self.lock:
                if joining:
                    self._join(joining)
                else:
                    self._step()
            prefilled = bool(joining)

    def _boundary(self, *, admit: bool = True) -> list[_Pending]:
        """Under ``_state``, between two steps: what pauses, aborts, cancellations and weight updates do to the
        batch, and the queued requests that join it now (if ``admit``; none while paused or while weights wait or
        load)."""
        batch = self._batch
        if self._stale:  # its KV cache was computed under other weights: prefilled again under the new ones
            self._retract()
            self._stale = False
        if self._abort is not None:
            for item in batch.clear():
                self._settle(item, result=self._result(item, {"type": "abort", "message": self._abort}))
            self._abort = None
        elif self._mode == "retract":
            self._retract()
        for item in batch.remove([item for item in batch.rows if item.request.cancel.is_set()]):
            self._settle(item, result=self._result(item, CANCELLED))
        serving = self._mode is None and not self._loading
        joining = self._take_joining() if admit and serving and not self._updates_waiting else []
        self._busy = serving and bool(joining or batch.rows)
        for waiter in self._boundary_waiters:
            waiter.get_loop().call_soon_threadsafe(_resolve, waiter)
        self._boundary_waiters.clear()
        self._state.notify_all()
        return joining

    def _retract(self) -> None:
        """Every running request back to the front of the queue, in order, keeping its tokens and generator."""
        self._waiting.extendleft(reversed(self._batch.clear()))

    def _take_joining(self) -> list[_Pending]:
        """The queued requests that join the batch now, up to ``max_batch_size`` rows; a ``solo`` one only joins
        an empty batch, and nothing joins it after."""
        if any(item.solo for item in self._batch.rows):
            return []
        joining: list[_Pending] = []
        adapter = _adapter_of([*self._batch.rows, *self._waiting])
        while self._waiting and len(self._batch) + len(joining) < self.max_batch_size:
            item = self._waiting[0]
            if (item.solo and (joining or self._batch.rows)) or item.request.lora_name != adapter:
                break  # one adapter per batch: the next one's requests wait for this batch to drain
            self._waiting.popleft()
            if item.request.cancel.is_set() or item.future.done():  # its caller went away while it was queued
                self._settle(item, result=self._result(item, CANCELLED))
                continue
            if adapter is not None and adapter not in self.adapters.paths:  # unloaded while it was queued
                self._settle(item, error=RequestError(f"the adapter {adapter!r} was unloaded"))
                continue
            if item.sampler is None:
                default_seed = self.seed * 1_000_003 + self._requests
                self._requests += 1
                decode = self.decode if self.tokenizer is not None else None
                item.sampler = Sampler(item.request, self.eos_token_ids, default_seed, decode)
            if item.sampler.finish_reason is not None:  # max_new_tokens 0
                self._settle(item, result=self._result(item))
                continue
            joining.append(item)
            if item.solo:
                break
        return joining

    def _join(self, joining: list[_Pending]) -> None:
        """Prefill ``joining`` into the batch together; if that fails, one by one, so that a fault fails only the
        request it is in (the batch is untouched by a failed prefill)."""
        try:
            self.adapters.activate(joining[0].request.lora_name)
            self._batch.prefill(joining)
        except Exception as exc:
            if len(joining) == 1:
                self._settle(joining[0], error=exc)
            else:
                for item in joining:
                    self._join([item])
            return
        self._settle_finished()

    def _step(self) -> None:
        """One decode step of the batch. If it fails, its cache may be half written: every row goes back to the
        front of the queue as ``solo`` (each is prefilled again and runs alone), so a fault fails only its request."""
        if not self._batch.rows:
            return
        try:
            self.adapters.activate(self._batch.rows[0].request.lora_name)
            self._batch.step()
        except Exception as exc:
            rows = self._batch.clear()
            if len(rows) == 1:
                self._settle(rows[0], error=exc)
                return
            for item in rows:
                item.solo = True
            with self._state:
                self._waiting.extendleft(reversed(rows))
            return
        self._settle_finished()

    def _settle_finished(self) -> None:
        for item in self._batch.finished():
            self._settle(item, result=self._result(item))

    @staticmethod
    def _result(item: _Pending, finish_reason: dict | None = None) -> GenerationResult:
        """``item``'s result: the tokens it has (none if it never ran), ending for ``finish_reason`` if given."""
        if item.sampler is None:
            return GenerationResult([], [], finish_reason or {"type": "length", "length": 0})
        return result_of(item.sampler, finish_reason)

    @staticmethod
    def _settle(item: _Pending, *, result: GenerationResult | None = None, error: Exception | None = None) -> None:
        """Resolve ``item``'s future on its event loop (from any thread); a cancelled caller's is left as it is."""

        def settle() -> None:
            if item.future.done():
                return
            if error is not None:
                item.future.set_exception(error)
            else:
                item.future.set_result(result)

        with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody waits for it
            item.future.get_loop().call_soon_threadsafe(settle)

    # -- pause / continue -----------------------------------------------------------------------------------

    async def pause(self, mode: str = "abort") -> None:
        """Stop serving, as SGLang's ``/pause_generation``; it returns once the next step boundary applied it.

        ``abort`` ends running and queued requests with an ``abort`` reason, each keeping the tokens it has (a
        caller may continue a cut request). ``retract`` takes running requests out of the batch to the front of the
        queue, keeping their tokens: after :meth:`resume` they are prefilled again (prompt plus tokens so far,
        under the weights then loaded) and continue to their ``max_new_tokens``, seeds continuing. ``in_place``
        stops stepping running requests, which keep their place and KV cache (see :meth:`_weights_held` for what a
        weight update does to it). Until :meth:`resume`, new requests queue."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        assert self._event_loop is not None, "call start() first"
        boundary = asyncio.get_running_loop().create_future()
        with self._state:
            self._mode = mode
            if mode == "abort":
                self._abort = ABORT_MESSAGE
                while self._waiting:
                    item = self._waiting.popleft()
                    self._settle(item, result=self._result(item, {"type": "abort", "message": ABORT_MESSAGE}))
            self._boundary_waiters.append(boundary)
        self._kick()
        await boundary

    def resume(self) -> None:
        """Serve again: held and retracted requests continue, queued ones join."""
        with self._state:
            self._mode = None
        self._kick()

    @property
    def paused(self) -> bool:
        return self._mode is not None

    def _wait_idle(self) -> None:
        """Block until no request is being stepped (the engine is idle or paused)."""
        with self._state:
            self._state.wait_for(lambda: not self._busy)

    @contextlib.contextmanager
    def _weights_held(self, *, change: bool = True) -> Iterator[None]:
        """Hold the weights (to update them, or with ``change=False`` to read them), never inside a decode step.

        It waits for a step boundary at which no request is being stepped: the engine is paused or idle. Meanwhile
        no request joins the batch, so a busy engine drains. Requests held by ``pause("in_place")`` keep their tokens
        and place across an update, but not their KV cache: computed under the old weights, it would mix two
        versions in one answer, so the next boundary after the update retracts them and, once resumed, they are
        prefilled again (prompt plus tokens so far) under the new weights and continue, seeds continuing. (SGLang
        refuses an update over in-place requests unless their cache is flushed; this engine recomputes it.)"""
        with self._state:
            self._updates_waiting += 1
            try:
                self._state.wait_for(lambda: not self._busy and not self._loading)
                self._loading = True
            finally:
                self._updates_waiting -= 1
        changed = False
        try:
            with self.lock:
                yield
            changed = change
        finally:
            with self._state:
                self._loading = False
                self._stale = self._stale or changed
                self._state.notify_all()
            self._kick()

    # -- weights ----------------------------------------------------------------------------------------------

    def _load(self, tensors: dict[str, torch.Tensor], weight_version: str | None) -> int:
        version = None if weight_version is None else check_weight_version(weight_version)  # before any copy
        with self._weights_held():
            loaded = load_named_tensors(self.model, tensors)
            self._publish(version)
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
        with self._weights_held():
            loaded = swap_in_named_tensors(self.model, views)
            self._publish(version)
        return loaded

    def _publish(self, version: str | None) -> None:
        """After new weights were loaded (inside :meth:`_weights_held`): every request that holds tokens notes where
        the old version's end (SGLang's ``weight_versions`` spans), then ``version`` becomes the engine's."""
        held = [*(row.sampler for row in self._batch.rows), *(item.sampler for item in self._waiting)]
        for sampler in held:
            if sampler is not None and sampler.output_ids:
                sampler.version_events.append((self.weight_version, len(sampler.output_ids)))
        if version is not None:
            self.weight_version = version

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
        """SHA-256 of the served (base) weights, LoRA adapters left out (see
        :func:`miles_core.weight_transfer.digests.checksum`)."""
        with self._weights_held(change=False):
            # under the names the trainers send (a MoE's experts one by one), so both sides' checksums agree
            return checksum(checkpoint_named_tensors(self.model, base_and_merged(self.model, merged=False)))

    def load_lora_adapter(self, name: str, path: str) -> str:
        """Load the peft adapter directory ``path`` as ``name`` (between two steps, as a weight update; requests
        paused in place are prefilled again); returns the digest of the adapter as served."""
        with self._weights_held():
            return self.adapters.load(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Remove the adapter ``name``; its queued requests fail, saying so."""
        with self._weights_held():
            self.adapters.unload(name)

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


def _adapter_of(items: Sequence[_Pending]) -> str | None:
    """The adapter the batch runs: its rows' (all share one), else the first queued request's."""
    return items[0].request.lora_name if items else None


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


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


def _bad_token_id(tokens: Sequence[object], vocab_size: int) -> object | None:
    """The first of ``tokens`` that is not a token id of the vocabulary, or ``None``: all plain ints in range (the
    check of every prompt of a batch, so it runs in C: their types, then their minimum and maximum)."""
    if not tokens or (set(map(type, tokens)) == {int} and min(tokens) >= 0 and max(tokens) < vocab_size):
        return None
    return next(t for t in tokens if not _is_token_id(t, vocab_size))


def _context_length(hf_config: Any, requested: int | None) -> int:
    """The longest prompt plus completion: the model's (its position limit), or ``requested`` if not longer."""
    native = next(
        (getattr(hf_config, key) for key in _CONTEXT_LENGTH_KEYS if isinstance(getattr(hf_config, key, None), int)),
        None,
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
