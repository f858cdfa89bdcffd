"""The local engine's HTTP server: SGLang's native API (``/generate``, ``/update_weights_*``, ...) on a
transformers model. Run it as ``python -m miles_core.builtin.local_engine.server --model-path DIR --port P``; its flags
mirror ``sglang.launch_server`` so the same supervision code can launch either.

Control routes (weight updates, pause, flush, version) always require ``Authorization: Bearer <admin key>``: the
key is ``--admin-api-key`` (or the run's token in ``$MILES_RUN_TOKEN``); without one, the server generates a key and
writes it to a file only its user can read (``--admin-key-file``, printed at start). Every JSON answer carries the
engine's ``weight_version``. Every request is bounded (body size per route, strict JSON, each field checked, at most
:data:`MAX_PROMPTS_PER_REQUEST` prompts, each query parameter once, a head and body that keep arriving) and refused
with a 4xx that says what is wrong; a ``/generate`` whose client goes away is cancelled. Every ``/generate`` key is
implemented (``stream: true`` is SGLang's native server-sent events) or refused by name
(:data:`GENERATE_FIELDS`, :data:`NEUTRAL_GENERATE_FIELDS`). The OpenAI-compatible routes (``/v1/...``) live in
:mod:`.openai_routes`.

``/generate`` needs no key, so the engine refuses what only a web page would send
(:func:`miles_core.http.check_browser_request`): a ``Host`` that is not a name of the engine with its port (a page
that rebound its domain name to 127.0.0.1 could otherwise use the GPU and read the answers, the model path
included) and any foreign ``Origin`` (a page posting a no-preflight "simple" request). SGLang's router and Miles'
clients send ``Host: <the engine's address>:<port>`` and no ``Origin``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy
import pydantic
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from miles_core import __version__
from miles_core.builtin.local_engine.engine import LocalEngine, TokenUpdate, check_weight_version
from miles_core.builtin.local_engine.lora_adapters import MAX_NAME_CHARS, AdapterError, check_adapter_name
from miles_core.builtin.local_engine.openai_routes import OpenAIRoutes
from miles_core.builtin.local_engine.sampling import (
    MAX_TOP_LOGPROBS,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    weight_version_spans,
)
from miles_core.builtin.local_engine.serving import (
    CONTROL_BODY_BYTES,
    MAX_PROMPTS_PER_REQUEST,
    ROUTE_BODY_BYTES,
    held_back,
    unless_client_leaves,
    visible_text,
)
from miles_core.engines.routed_experts import encode_routed_experts
from miles_core.engines.staging import STAGING_DIR_ENV, weight_staging_dir
from miles_core.errors import MilesError
from miles_core.http import (
    JSON_ERRORS,
    BoundedHttpProtocol,
    HttpError,
    allowed_host_names,
    bearer_token_matches,
    check_browser_request,
    parse_json_object,
    read_body,
    safe_message,
)
from miles_core.weight_transfer.staging_layout import MAX_STAGING_BYTES, StagingLayout
from miles_core.workers.node import node_address
from miles_core.workers.process import listening_socket
from miles_core.workers.rpc.wire import TOKEN_ENV

MAX_RID_CHARS = 256
STAGING_FIELDS = ("staging_path", "buffer_size", "layout", "swap", "weight_version")
LORA_LOAD_FIELDS = ("lora_name", "lora_path", "pinned", "lora_id")
LORA_UNLOAD_FIELDS = ("lora_name", "lora_id")

GENERATE_FIELDS = frozenset(
    {
        "input_ids",
        "text",
        "sampling_params",
        "rid",
        "stream",
        "return_logprob",
        "top_logprobs_num",
        "return_text_in_logprobs",
        "return_routed_experts",
        "lora_path",
        "log_metrics",
        "model",
    }
)
"""The ``/generate`` fields the local engine implements (``log_metrics`` only concerns SGLang's own metrics;
``model``, which the sglang-router adds to every request it forwards, names the one model served)."""
NEUTRAL_GENERATE_FIELDS: dict[str, tuple[Any, ...]] = {
    "logprob_start_len": (None, -1),  # -1: logprobs of the output only (prompt logprobs are not computed)
    "lora_id": (None,),
    "image_data": (None,),
    "video_data": (None,),
    "audio_data": (None,),
    "input_embeds": (None,),
    "modalities": (None,),
    "return_hidden_states": (None, False),
    "custom_logit_processor": (None,),
    "session_params": (None,),
    "token_ids_logprob": (None,),
    "bootstrap_host": (None,),
    "bootstrap_port": (None,),
    "bootstrap_room": (None,),
    "data_parallel_rank": (None,),
    # the sglang-router (0.3) adds these to every /generate it forwards
    "background": (None, False),
    "no_logs": (None, False),
    "return_bytes": (None, False),
    "return_entropy": (None, False),
}
"""SGLang's ``/generate`` fields that its clients send (``sglang.bench_serving`` and the sglang-router send several),
accepted only with the value that asks for nothing: any other value is a feature the local engine does not have,
refused with a 400."""

log = logging.getLogger(__name__)


HEALTH_CHECK_TIMEOUT_ENV = "SGLANG_HEALTH_CHECK_TIMEOUT"
"""SGLang's setting, read the same way: how long ``/health_generate`` waits for its generation before a 503."""


def health_check_timeout_s() -> float:
    """``$SGLANG_HEALTH_CHECK_TIMEOUT`` in seconds (20 when unset, SGLang's default)."""
    value = os.environ.get(HEALTH_CHECK_TIMEOUT_ENV, "20")
    try:
        seconds = float(value)
    except ValueError:
        raise MilesError(f"{HEALTH_CHECK_TIMEOUT_ENV}={value!r} is not a number of seconds") from None
    if not seconds > 0:
        raise MilesError(f"{HEALTH_CHECK_TIMEOUT_ENV}={value!r} must be a positive number of seconds")
    return seconds


class LocalEngineServer:
    """Routes of the SGLang API over a :class:`LocalEngine`; control routes need ``admin_key`` (never open)."""

    def __init__(
        self, engine: LocalEngine, *, admin_key: str, host: str, port: int, key_file: Path | None = None
    ) -> None:
        """``key_file``: a generated key's file, removed when the server stops."""
        if not isinstance(admin_key, str) or not admin_key.strip():
            raise MilesError("the local engine's control routes need an admin key: pass a non-empty admin_key")
        self.engine = engine
        self.admin_key = admin_key
        self.key_file = key_file
        self.host, self.port = host, port
        self.served_names = allowed_host_names(host)  # the Host headers it answers (DNS rebinding)
        self.in_flight = 0
        self.generate_requests = 0  # /generate calls served (a batch counts once)

    def app(self) -> Starlette:
        public = {
            "/generate": self.generate,
            "/health": self.health,
            "/health_generate": self.health_generate,
            "/model_info": self.model_info,
            "/get_model_info": self.model_info,
            "/server_info": self.server_info,
            "/get_server_info": self.server_info,
        }
        control = {
            "/flush_cache": self.flush_cache,
            "/update_weights_from_disk": self.update_from_disk,
            "/update_weights_from_tensor": self.update_from_tensor,
            "/update_weights_from_staging": self.update_from_staging,
            "/init_weights_update_group": self.init_group,
            "/begin_weight_update": self.begin_update,
            "/end_weight_update": self.end_update,
            "/update_weights_from_distributed": self.update_from_distributed,
            "/destroy_weights_update_group": self.destroy_group,
            "/pause_generation": self.pause,
            "/continue_generation": self.resume,
            "/update_weight_version": self.update_version,
            "/weights_checksum": self.weights_checksum,
            "/load_lora_adapter": self.load_lora_adapter,
            "/unload_lora_adapter": self.unload_lora_adapter,
        }
        routes = [
            Route(path, self._wrap(path, fn, control=False), methods=["GET", "POST"]) for path, fn in public.items()
        ]
        routes += [
            Route(path, self._wrap(path, fn, control=True), methods=["GET", "POST"]) for path, fn in control.items()
        ]
        routes += OpenAIRoutes(self).routes()
        return Starlette(routes=routes, lifespan=self._lifespan, exception_handlers=JSON_ERRORS)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.engine.start()
        try:
            yield
        finally:  # here, not after uvicorn's run(): uvicorn re-raises SIGTERM once it has shut down
            if self.key_file is not None:
                self.key_file.unlink(missing_ok=True)

    def _wrap(self, path: str, handler: Callable[[dict], Awaitable[Any]], *, control: bool) -> Callable:
        limit = ROUTE_BODY_BYTES.get(path, CONTROL_BODY_BYTES)
        cancel_when_gone = path == "/generate"

        async def endpoint(request: Request) -> Response:
            try:
                check_browser_request(request.headers, names=self.served_names, port=self.port)
                if control:
                    self._check_admin(request)
                body = await _request_body(request, limit=limit)
                work = handler(body)
                result = await (unless_client_leaves(request, work) if cancel_when_gone else work)
            except HttpError as exc:
                result = self._refusal(exc.status, str(exc))
            except (MilesError, ValueError) as exc:
                result = self._refusal(400, f"{type(exc).__name__}: {exc}")
            except Exception as exc:  # a defect, not the caller's fault: say so, keep serving
                log.exception("local engine: %s failed", path)
                result = self._refusal(500, f"internal error in {path}: {type(exc).__name__}: {exc}")
            if not isinstance(result, Response):
                result = JSONResponse(result)
            result.headers["X-Weight-Version"] = self.engine.weight_version
            return result

        return endpoint

    def _refusal(self, status: int, message: str) -> JSONResponse:
        message = safe_message(message)  # a MilesError or ValueError may repeat a field's value whole
        body = {"success": False, "error": message, "message": message, "weight_version": self.engine.weight_version}
        return JSONResponse(body, status_code=status)

    def _check_admin(self, request: Request) -> None:
        if not bearer_token_matches(request.headers.get("authorization"), self.admin_key):
            raise HttpError(401, "this route needs the admin key: Authorization: Bearer <admin key>")

    # -- data plane -----------------------------------------------------------------------------------------

    async def generate(self, body: dict) -> Any:
        """Every field is checked here and every prompt admitted by the engine before any is queued: a bad
        request gets its own 400 and never reaches (or fails) a batch."""
        started = time.perf_counter()  # SGLang's meta_info.e2e_latency: from the request's arrival to its answer
        _check_generate_fields(body)
        _optional(body, "log_metrics", bool, True)
        stream = _optional(body, "stream", bool, False)
        logprobs = _LogprobOptions(
            enabled=_optional(body, "return_logprob", bool, False),
            top=_optional(body, "top_logprobs_num", int, 0, low=0, high=MAX_TOP_LOGPROBS),
            with_text=_optional(body, "return_text_in_logprobs", bool, False),
        )
        batch, single = _input_batch(body, self.engine.tokenizer)
        params = _sampling_params(body.get("sampling_params"), len(batch))
        rids = _rids(body.get("rid"), len(batch), single=single)
        top = logprobs.top if logprobs.enabled else 0
        routed = _optional(body, "return_routed_experts", bool, False)
        adapters = _lora_names(body.get("lora_path"), len(batch), single=single)
        requests = [
            self.engine.admit(
                GenerationRequest(ids, p, top_logprobs_num=top, return_routed_experts=routed, lora_name=adapter)
            )
            for ids, p, adapter in zip(batch, params, adapters, strict=True)
        ]
        if stream:
            if not single:
                raise HttpError(400, "stream=true takes one prompt: send one request per prompt")
            return self._stream(requests[0], logprobs, rids[0])
        results = await self.generate_counted(requests)
        texts = self.engine.decode_many([result.output_ids for result in results])
        latency = time.perf_counter() - started
        outputs = [
            self._output(r, req, logprobs, rid, text=text, e2e_latency=latency)
            for r, req, rid, text in zip(results, requests, rids, texts, strict=True)
        ]
        return outputs[0] if single else outputs

    async def generate_counted(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """``engine.generate`` of requests the caller admitted (``engine.admit``), counted in ``in_flight``
        (``/flush_cache`` refuses while requests run) and ``generate_requests`` (a batch counts once)."""
        self.in_flight += len(requests)
        self.generate_requests += 1
        try:
            return await self.engine.generate(requests, admitted=True)
        finally:
            self.in_flight -= len(requests)

    async def stream_tokens(self, request: GenerationRequest) -> AsyncIterator[TokenUpdate | GenerationResult]:
        """``engine.stream``, counted in ``in_flight`` (for the OpenAI routes too)."""
        self.in_flight += 1
        self.generate_requests += 1
        try:
            async for item in self.engine.stream(request):
                yield item
        finally:
            self.in_flight -= 1

    def _stream(self, request: GenerationRequest, logprobs: _LogprobOptions, rid: str | None) -> Response:
        """SGLang's native streaming: server-sent events ``data: {json}``, each with the text, ``output_ids`` and
        ``meta_info`` so far (cumulative, as SGLang sends them by default), then ``data: [DONE]``."""
        rid = rid or f"local-{os.getpid()}-{id(request)}"

        async def events() -> AsyncIterator[bytes]:
            ids: list[int] = []
            lps: list[float] = []
            tops: list[list[tuple[float, int]]] = []
            try:
                async for item in self.stream_tokens(request):
                    if isinstance(item, TokenUpdate):
                        ids += item.output_ids
                        lps += item.logprobs
                        tops += item.top_logprobs
                        partial = GenerationResult(ids, lps, {}, tops)
                        chunk = self._output(partial, request, logprobs, rid, finished=False)
                    else:
                        chunk = self._output(item, request, logprobs, rid)
                    yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            except Exception as exc:  # a defect: the 200 is sent already, so say it in the stream, as SGLang does
                log.exception("local engine: a /generate stream failed")
                error = {"message": safe_message(f"internal error: {type(exc).__name__}: {exc}"), "code": 500}
                yield b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def _output(
        self,
        result: GenerationResult,
        request: GenerationRequest,
        logprobs: _LogprobOptions,
        rid: str | None,
        *,
        finished: bool = True,
        text: str | None = None,
        e2e_latency: float | None = None,
    ) -> dict:
        """SGLang's answer to ``request``; ``text``: its output decoded already (``engine.decode_many``);
        ``e2e_latency``: seconds from the request's arrival to its answer (SGLang's ``meta_info`` key)."""
        meta: dict[str, Any] = {
            "id": rid or f"local-{os.getpid()}-{id(result)}",
            "finish_reason": result.finish_reason if finished else None,
            "prompt_tokens": len(request.input_ids),
            "completion_tokens": len(result.output_ids),
            "cached_tokens": 0,
            "weight_version": self.engine.weight_version,
        }
        if e2e_latency is not None:
            meta["e2e_latency"] = e2e_latency
        if result.version_events:  # a weight update came while it held tokens: where each version's tokens are
            meta["weight_versions"] = weight_version_spans(
                result.version_events, self.engine.weight_version, len(result.output_ids)
            )
        if logprobs.enabled:
            token_text = self._token_text if logprobs.with_text else _no_text
            meta["output_token_logprobs"] = [
                [lp, tok, token_text(tok)] for lp, tok in zip(result.logprobs, result.output_ids, strict=True)
            ]
            if logprobs.top:
                meta["output_top_logprobs"] = [
                    [[lp, tok, token_text(tok)] for lp, tok in position] for position in result.top_logprobs
                ]
        if request.return_routed_experts and finished:  # SGLang sends them with the finished answer alone
            experts = result.routed_experts
            meta["routed_experts"] = encode_routed_experts(experts if experts is not None else numpy.zeros((0,)))
        text = self.engine.decode(result.output_ids) if text is None else text
        # a finished answer is cut before its stop string; a streamed one never shows a piece of one either
        text = visible_text(text, result.finish_reason) if finished else text[: held_back(text, request.params.stop)]
        return {"text": text, "output_ids": result.output_ids, "meta_info": meta}

    def _token_text(self, token: int) -> str | None:
        return self.engine.decode([token]) if self.engine.tokenizer is not None else None

    async def health(self, body: dict) -> Response:
        return Response(status_code=200)

    async def health_generate(self, body: dict) -> Response:
        """As SGLang answers it: 200 once a one-token generation finishes, 503 when it did not within
        ``$SGLANG_HEALTH_CHECK_TIMEOUT`` seconds (20 by default). A paused engine holds the generation, so it
        answers 503 as SGLang does: a health check cannot tell a paused engine from a stuck one."""
        request = GenerationRequest([self.engine.pad_token_id], SamplingParams(max_new_tokens=1, temperature=0))
        try:
            await asyncio.wait_for(self.engine.generate([request]), timeout=health_check_timeout_s())
        except TimeoutError:
            return Response(status_code=503)
        return Response(status_code=200)

    async def model_info(self, body: dict) -> dict:
        return {
            "model_path": self.engine.model_path,
            "tokenizer_path": self.engine.model_path,
            "is_generation": True,
            "weight_version": self.engine.weight_version,
            "model_type": self.engine.model.config.model_type,
        }

    async def server_info(self, body: dict) -> dict:
        return {
            "model_path": self.engine.model_path,
            "host": self.host,
            "port": self.port,
            "max_batch_size": self.engine.max_batch_size,
            "random_seed": self.engine.seed,
            "version": f"miles-local-engine {__version__}",
            "weight_version": self.engine.weight_version,
            "internal_states": [
                {
                    "queued": self.engine.queued,
                    "in_flight": self.in_flight,
                    "paused": self.engine.paused,
                    "generated_tokens": self.engine.generated_tokens,
                    "generate_requests": self.generate_requests,
                }
            ],
        }

    # -- control plane --------------------------------------------------------------------------------------

    async def flush_cache(self, body: dict) -> Response:
        if self.in_flight:
            return PlainTextResponse("Cache not flushed: requests are running.", status_code=400)
        return PlainTextResponse("Cache flushed.")

    async def update_from_disk(self, body: dict) -> dict:
        model_path, version = _require(body, "model_path", str), _version(body)
        if _optional(body, "abort_all_requests", bool, False):
            await self.engine.pause("abort")
            self.engine.resume()
        loaded = await asyncio.to_thread(self.engine.update_from_disk, model_path, version)
        return self._success(f"loaded {loaded} bytes from {model_path}", num_paused_requests=0)

    async def update_from_tensor(self, body: dict) -> dict:
        payload = _require(body, "serialized_named_tensors", list)
        load_format = body.get("load_format")
        if load_format not in (None, "safetensors", "safetensors_path"):
            raise HttpError(
                400,
                f"load_format {load_format!r:.80}: use safetensors or safetensors_path (tensors in a shared-memory "
                "staging file go to /update_weights_from_staging)",
            )
        loaded = await asyncio.to_thread(self.engine.update_from_tensor, payload, _version(body), load_format)
        return self._success(f"loaded {loaded} bytes")

    async def update_from_staging(self, body: dict) -> dict:
        """Tensors in a shared-memory staging file: ``staging_path``, ``buffer_size``, ``layout`` (a
        :class:`StagingLayout`'s wire object), ``swap`` (serve from the file, no copy) and ``weight_version``."""
        unknown = sorted(str(key)[:80] for key in body if key not in STAGING_FIELDS)
        if unknown:
            fields = ", ".join(STAGING_FIELDS)
            raise HttpError(400, f"unknown field {unknown[0]!r}: /update_weights_from_staging takes {fields}")
        layout = StagingLayout.from_wire(_require(body, "layout", dict))
        loaded = await asyncio.to_thread(
            self.engine.update_from_staging,
            path=_require(body, "staging_path", str, high=4096),
            buffer_size=_require(body, "buffer_size", int, low=1, high=MAX_STAGING_BYTES),
            layout=layout,
            swap=_optional(body, "swap", bool, False),
            weight_version=_version(body),
        )
        return self._success(f"loaded {loaded} bytes")

    async def init_group(self, body: dict) -> dict:
        world_size = _require(body, "world_size", int, low=2, high=1 << 16)
        await asyncio.to_thread(
            self.engine.init_group,
            master_address=_require(body, "master_address", str, high=255),
            master_port=_require(body, "master_port", int, low=1, high=65535),
            rank_offset=_require(body, "rank_offset", int, low=1, high=world_size - 1),
            world_size=world_size,
            group_name=_group_name(body),
            backend=_optional(body, "backend", str, "gloo"),
        )
        return self._success("weight update group ready")

    async def update_from_distributed(self, body: dict) -> dict:
        names, dtypes, shapes = _tensor_specs(body)
        loaded = await asyncio.to_thread(
            self.engine.update_from_distributed,
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=_group_name(body),
            weight_version=_version(body),
        )
        return self._success(f"received {loaded} bytes")

    async def begin_update(self, body: dict) -> dict:
        self.engine.begin_weight_update()
        return self._success("weight-update session open")

    async def end_update(self, body: dict) -> dict:
        self.engine.end_weight_update()
        return self._success("weight-update session closed")

    async def destroy_group(self, body: dict) -> dict:
        self.engine.destroy_group(_group_name(body))
        return self._success("weight update group destroyed")

    async def pause(self, body: dict) -> dict:
        await self.engine.pause(_optional(body, "mode", str, "abort"))
        return {"status": "ok", "message": "generation paused", "weight_version": self.engine.weight_version}

    async def resume(self, body: dict) -> dict:
        self.engine.resume()
        return {"status": "ok", "message": "generation continued", "weight_version": self.engine.weight_version}

    async def update_version(self, body: dict) -> dict:
        new_version = check_weight_version(_require(body, "new_version", str), field="new_version")
        if _optional(body, "abort_all_requests", bool, True):
            await self.engine.pause("abort")
            self.engine.resume()
        self.engine.weight_version = new_version
        return {**self._success(f"weight version is {new_version}"), "new_version": new_version}

    async def weights_checksum(self, body: dict) -> dict:
        """Not in SGLang's API: lets a test or ``verify_checksum`` prove the engine holds exact weights."""
        digest = await asyncio.to_thread(self.engine.weights_checksum)
        return {"checksum": digest, "weight_version": self.engine.weight_version}

    async def load_lora_adapter(self, body: dict) -> dict:
        """SGLang's route: ``lora_name``, ``lora_path`` (a peft adapter directory), ``pinned`` (accepted: nothing is
        evicted here). The answer adds ``digest``, the adapter as served (not in SGLang's API), which the trainer
        compares with its own."""
        _known_fields(body, LORA_LOAD_FIELDS, route="/load_lora_adapter")
        name = check_adapter_name(_require(body, "lora_name", str, high=MAX_NAME_CHARS))
        path = _require(body, "lora_path", str, high=4096)
        _optional(body, "pinned", bool, False)
        digest = await asyncio.to_thread(self.engine.load_lora_adapter, name, path)
        return {**self._lora_answer(f"loaded the adapter {name!r}"), "digest": digest}

    async def unload_lora_adapter(self, body: dict) -> dict:
        """SGLang's route: ``lora_name``."""
        _known_fields(body, LORA_UNLOAD_FIELDS, route="/unload_lora_adapter")
        name = check_adapter_name(_require(body, "lora_name", str, high=MAX_NAME_CHARS))
        await asyncio.to_thread(self.engine.unload_lora_adapter, name)
        return self._lora_answer(f"unloaded the adapter {name!r}")

    def _lora_answer(self, message: str) -> dict:
        """SGLang's ``LoadLoRAAdapterReqOutput``: success, error_message, loaded_adapters (name -> path)."""
        return {**self._success(message), "error_message": "", "loaded_adapters": dict(self.engine.adapters.paths)}

    def _success(self, message: str, **extra: Any) -> dict:
        return {"success": True, "message": message, "weight_version": self.engine.weight_version, **extra}


async def _request_body(request: Request, *, limit: int) -> dict:
    """The request's fields: the query of a GET, else the JSON object of the body (at most ``limit`` bytes)."""
    if request.method == "GET":
        return _query_fields(request)
    return parse_json_object(await read_body(request, limit=limit))


def _query_fields(request: Request) -> dict[str, str]:
    """A GET's query parameters as fields, each given at most once (as a JSON body gives each key once)."""
    pairs = request.query_params.multi_items()
    fields = dict(pairs)
    if len(fields) != len(pairs):
        twice = next(key for key in fields if len(request.query_params.getlist(key)) > 1)
        raise HttpError(400, f"query parameter {twice[:100]!r} is given more than once: give each parameter once")
    return fields


@dataclasses.dataclass(frozen=True)
class _LogprobOptions:
    enabled: bool
    top: int  # alternatives per position (SGLang's top_logprobs_num)
    with_text: bool  # each token's text beside its id (SGLang's return_text_in_logprobs)


def _no_text(token: int) -> None:
    return None


def _check_generate_fields(body: dict) -> None:
    """Every key of a ``/generate`` body is implemented, or one of SGLang's with its no-effect value: anything
    else is refused by name (silently ignoring ``lora_path`` or ``image_data`` would answer a different question)."""
    for key, value in body.items():
        if key in GENERATE_FIELDS:
            continue
        allowed = NEUTRAL_GENERATE_FIELDS.get(key)
        if allowed is None:
            raise HttpError(
                400,
                f"unknown field {key[:80]!r}: the local engine's /generate takes "
                f"{', '.join(sorted(GENERATE_FIELDS))} (and SGLang's "
                f"{', '.join(sorted(NEUTRAL_GENERATE_FIELDS))} at their defaults)",
            )
        if not any(value is v or (type(value) is type(v) and value == v) for v in allowed):
            shown = " or ".join(json.dumps(v) for v in allowed)
            raise HttpError(
                400,
                f"field {key!r} = {value!r:.80} is not supported by the local engine: it takes "
                f"only {shown} (the default, which asks for nothing)",
            )


def _known_fields(body: dict, fields: tuple[str, ...], *, route: str) -> None:
    unknown = sorted(str(key)[:80] for key in body if key not in fields)
    if unknown:
        raise HttpError(400, f"unknown field {unknown[0]!r}: {route} takes {', '.join(fields)}")


def _lora_names(value: Any, count: int, *, single: bool) -> list[str | None]:
    """``/generate``'s ``lora_path`` (as SGLang: the name of a loaded adapter, one for the batch or one per prompt,
    null for the base) as one adapter name (or ``None``) per prompt."""
    if value is None:
        return [None] * count
    if isinstance(value, list) and not single:
        if len(value) != count:
            raise HttpError(400, f"lora_path has {len(value)} names for {count} prompts: give one per prompt")
        return [None if name is None else _lora_name(name) for name in value]
    return [_lora_name(value)] * count


def _lora_name(value: Any) -> str:
    try:
        return check_adapter_name(value)
    except AdapterError as exc:
        raise HttpError(400, f"lora_path: {exc}") from None


def _require(body: dict, key: str, kind: type, *, low: int | None = None, high: int | None = None) -> Any:
    """``body[key]``, which must be a ``kind``; an int within ``low..high``, a str of at most ``high`` characters."""
    if key not in body:
        raise HttpError(400, f"missing field {key!r}")
    return _checked(body[key], key, kind, low=low, high=high)


def _optional(body: dict, key: str, kind: type, default: Any, **bounds: int) -> Any:
    """``body[key]`` checked as in :func:`_require`, or ``default`` when it is absent or null."""
    return default if body.get(key) is None else _checked(body[key], key, kind, **bounds)


def _checked(value: Any, key: str, kind: type, *, low: int | None = None, high: int | None = None) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise HttpError(400, f"field {key!r} must be {kind.__name__}, got {value!r:.100}")
    if kind is int and ((low is not None and value < low) or (high is not None and value > high)):
        raise HttpError(400, f"field {key!r} must be an integer from {low} to {high}, got {value}")
    if kind is str and high is not None and len(value) > high:
        raise HttpError(400, f"field {key!r} must be at most {high} characters, got {len(value)}")
    return value


def _version(body: dict) -> str | None:
    """The request's ``weight_version``, checked before anything is loaded (it becomes a header value)."""
    version = body.get("weight_version")
    return None if version is None else check_weight_version(version)


def _group_name(body: dict) -> str:
    name = _optional(body, "group_name", str, "weight_update_group", high=128)
    if not name:
        raise HttpError(400, "field 'group_name' must not be empty")
    return name


def _tensor_specs(body: dict) -> tuple[list[str], list[str], list[list[int]]]:
    """``names``, ``dtypes`` and ``shapes`` of a broadcast: equally long lists of strings, strings and lists of
    non-negative integers."""
    names, dtypes, shapes = (_require(body, key, list) for key in ("names", "dtypes", "shapes"))
    if not len(names) == len(dtypes) == len(shapes):
        raise HttpError(
            400,
            f"names, dtypes and shapes must have the same length, got {len(names)}, {len(dtypes)} and {len(shapes)}",
        )
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        if not isinstance(name, str) or not isinstance(dtype, str):
            raise HttpError(400, f"names[{i}] and dtypes[{i}] must be strings, got {name!r:.80} and {dtype!r:.80}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise HttpError(400, f"shapes[{i}] must be a list of non-negative integers, got {shape!r:.80}")
    return names, dtypes, shapes


def _input_batch(body: dict, tokenizer: Any) -> tuple[list[list[int]], bool]:
    """The prompts as token-id lists, and whether the request was a single prompt (the engine checks the ids
    against its vocabulary)."""
    if "input_ids" in body:
        ids = body["input_ids"]
        single = isinstance(ids, list) and bool(ids) and all(_is_int(t) for t in ids)
        batch = [ids] if single else ids
        _check_batch_size(batch, "input_ids")
        if (
            not isinstance(batch, list)
            or not batch
            or not all(isinstance(row, list) and row and all(_is_int(t) for t in row) for row in batch)
        ):
            raise HttpError(400, "input_ids must be a non-empty list of token ids, or a list of such lists")
        return batch, single
    if "text" in body:
        texts = body["text"]
        single = isinstance(texts, str)
        batch = [texts] if single else texts
        _check_batch_size(batch, "text")
        if tokenizer is None:
            raise HttpError(400, "this model directory has no tokenizer: send input_ids")
        if not isinstance(batch, list) or not batch or not all(isinstance(t, str) and t for t in batch):
            raise HttpError(400, "text must be a non-empty string, or a non-empty list of such strings")
        return [tokenizer.encode(t) for t in batch], single
    raise HttpError(400, "send input_ids (or text)")


def _check_batch_size(batch: Any, field: str) -> None:
    """A batch of at most :data:`MAX_PROMPTS_PER_REQUEST` prompts, checked before any is looked at."""
    if isinstance(batch, list) and len(batch) > MAX_PROMPTS_PER_REQUEST:
        raise HttpError(
            400,
            f"{field} holds {len(batch)} prompts; one request takes at most {MAX_PROMPTS_PER_REQUEST}: split the batch",
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rids(rid: Any, count: int, *, single: bool) -> list[str | None]:
    """One request id per prompt: ``rid`` is a string for a single prompt, a list of ``count`` strings for a
    batch, or absent."""
    if rid is None:
        return [None] * count
    rids = [rid] if single else rid
    if not isinstance(rids, list) or len(rids) != count or not all(isinstance(r, str) for r in rids):
        want = "a string" if single else f"a list of {count} strings (one per prompt)"
        raise HttpError(400, f"rid must be {want}, got {rid!r:.100}")
    if any(len(r) > MAX_RID_CHARS for r in rids):
        raise HttpError(400, f"a rid must be at most {MAX_RID_CHARS} characters")
    return rids


def _sampling_params(raw: Any, count: int) -> list[SamplingParams]:
    if raw is not None and not isinstance(raw, dict | list):
        raise HttpError(400, f"sampling_params must be an object, or a list of one object per prompt, got {raw!r:.80}")
    raws = raw if isinstance(raw, list) else [raw or {}] * count
    if len(raws) != count:
        raise HttpError(400, f"{len(raws)} sampling_params for {count} prompts")
    try:
        return [SamplingParams.model_validate(item) for item in raws]
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'sampling_params'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise HttpError(400, f"bad sampling_params: {problems}") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles_core.builtin.local_engine.server", description=__doc__)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default=node_address(), help="address to bind (default: this node's address)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--admin-api-key",
        default=os.environ.get(TOKEN_ENV),
        help=f"the control routes' bearer key (default: ${TOKEN_ENV}, else a generated one)",
    )
    parser.add_argument(
        "--admin-key-file",
        type=Path,
        help="where a generated admin key is written (mode 0600; default: a new file in the "
        "temporary directory, removed at exit)",
    )
    parser.add_argument("--max-batch-size", "--max-running-requests", dest="max_batch_size", type=int, default=64)
    parser.add_argument("--context-length", type=int, help="prompt plus new tokens at most (default: the model's)")
    parser.add_argument(
        "--weight-staging-dir",
        type=Path,
        help=f"the only directory whose files weight updates may name (default: ${STAGING_DIR_ENV}, "
        "else /dev/shm/miles-staging-<uid>)",
    )
    for flag in ("--tp-size", "--dp-size", "--ep-size"):  # SGLang's parallel flags: the local engine is one process
        parser.add_argument(flag, type=int, default=1, choices=[1], help="SGLang's flag; only 1 (one process)")
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--cpu-threads", type=int, help="torch CPU threads (default: torch's, one per core)")
    args = parser.parse_args(argv)
    if args.cpu_threads is not None:
        if args.cpu_threads < 1:
            parser.error(f"--cpu-threads must be at least 1, got {args.cpu_threads}")
        torch.set_num_threads(args.cpu_threads)
    try:
        health_check_timeout_s()  # a bad value stops the start, not a health check later
        engine = LocalEngine(
            args.model_path,
            max_batch_size=args.max_batch_size,
            seed=args.random_seed,
            context_length=args.context_length,
            staging_dir=args.weight_staging_dir or weight_staging_dir(),
        )
    except MilesError as exc:
        print(f"local engine: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    admin_key, key_file = args.admin_api_key, None
    if not admin_key:  # never serve the control routes open
        admin_key = secrets.token_urlsafe(32)
        key_file = _write_key_file(admin_key, args.admin_key_file, port=args.port)
        print(
            f"local engine: no --admin-api-key given: control routes need the key in {key_file} (mode 0600)",
            file=sys.stderr,
            flush=True,
        )
    server = LocalEngineServer(
        engine,
        admin_key=admin_key,
        host=args.host,
        port=args.port,
        key_file=key_file if args.admin_key_file is None else None,
    )
    try:
        sock = listening_socket(args.host, args.port)
    except OSError as exc:
        print(f"local engine: error: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        raise SystemExit(2) from None
    config = uvicorn.Config(server.app(), log_level="warning", access_log=False, http=BoundedHttpProtocol)
    uvicorn.Server(config).run(sockets=[sock])


def _write_key_file(key: str, path: Path | None, *, port: int) -> Path:
    """Write ``key`` to ``path`` (or a new file in the temporary directory), readable by this user only."""
    if path is None:
        descriptor, name = tempfile.mkstemp(prefix=f"miles-local-engine-{port}-", suffix=".admin-key")  # mode 0600
        path = Path(name)
    else:
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            print(f"local engine: error: cannot write the admin key to {path}: {exc.strerror}", file=sys.stderr)
            raise SystemExit(2) from None
    with os.fdopen(descriptor, "w") as key_file:
        os.fchmod(key_file.fileno(), 0o600)  # an existing file keeps its mode otherwise
        key_file.write(key + "\n")
    return path


if __name__ == "__main__":
    main()
