"""The local engine's HTTP server: SGLang's native API (``/generate``, ``/update_weights_*``, ...) on a
transformers model. Run it as ``python -m miles_core.engines.local_server --model-path DIR --port P``; its flags
mirror ``sglang.launch_server`` so the same supervision code can launch either.

Control routes (weight updates, pause, flush, version) require ``Authorization: Bearer <admin key>`` when an admin
key is set. Every JSON answer carries the engine's ``weight_version``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pydantic
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from miles_core import __version__
from miles_core.engines.local_engine import LocalEngine
from miles_core.engines.sampling import GenerationRequest, GenerationResult, SamplingParams
from miles_core.errors import MilesError
from miles_core.workers.rpc_wire import TOKEN_ENV

MAX_BODY_BYTES = 1 << 30  # weights may travel in /update_weights_from_tensor


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class LocalEngineServer:
    """Routes of the SGLang API over a :class:`LocalEngine`."""

    def __init__(self, engine: LocalEngine, *, admin_key: str | None, host: str, port: int) -> None:
        self.engine = engine
        self.admin_key = admin_key
        self.host, self.port = host, port
        self.in_flight = 0
        self.generate_requests = 0  # /generate calls served (a batch counts once)

    def app(self) -> Starlette:
        public = {"/generate": self.generate, "/health": self.health, "/health_generate": self.health_generate,
                  "/model_info": self.model_info, "/get_model_info": self.model_info,
                  "/server_info": self.server_info, "/get_server_info": self.server_info}  # fmt: skip
        control = {"/flush_cache": self.flush_cache, "/update_weights_from_disk": self.update_from_disk,
                   "/update_weights_from_tensor": self.update_from_tensor,
                   "/init_weights_update_group": self.init_group,
                   "/update_weights_from_distributed": self.update_from_distributed,
                   "/destroy_weights_update_group": self.destroy_group, "/pause_generation": self.pause,
                   "/continue_generation": self.resume, "/update_weight_version": self.update_version,
                   "/weights_checksum": self.weights_checksum}  # fmt: skip
        routes = [Route(path, self._wrap(fn, control=False), methods=["GET", "POST"]) for path, fn in public.items()]
        routes += [Route(path, self._wrap(fn, control=True), methods=["GET", "POST"]) for path, fn in control.items()]
        return Starlette(routes=routes, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.engine.start()
        yield

    def _wrap(self, handler: Callable[[dict], Awaitable[Any]], *, control: bool) -> Callable:
        async def endpoint(request: Request) -> Response:
            try:
                if control:
                    self._check_admin(request)
                result = await handler(await _json_body(request))
            except HttpError as exc:
                result = JSONResponse({"error": str(exc), "weight_version": self.engine.weight_version}, exc.status)
            except (MilesError, ValueError) as exc:
                body = {"success": False, "message": f"{type(exc).__name__}: {exc}",
                        "weight_version": self.engine.weight_version}  # fmt: skip
                result = JSONResponse(body, status_code=400)
            if not isinstance(result, Response):
                result = JSONResponse(result)
            result.headers["X-Weight-Version"] = self.engine.weight_version
            return result

        return endpoint

    def _check_admin(self, request: Request) -> None:
        if self.admin_key is None:
            return
        presented = request.headers.get("authorization", "").removeprefix("Bearer ").encode()
        if not hmac.compare_digest(presented, self.admin_key.encode()):
            raise HttpError(401, "this route needs the admin key: Authorization: Bearer <admin key>")

    # -- data plane -----------------------------------------------------------------------------------------

    async def generate(self, body: dict) -> Any:
        if body.get("stream"):
            raise HttpError(400, "stream=true is not supported by the local engine")
        batch, single = _input_batch(body, self.engine.tokenizer)
        params = _sampling_params(body.get("sampling_params"), len(batch))
        requests = [GenerationRequest(ids, p) for ids, p in zip(batch, params, strict=True)]
        self.in_flight += len(requests)
        self.generate_requests += 1
        try:
            results = await self.engine.generate(requests)
        finally:
            self.in_flight -= len(requests)
        rid = body.get("rid")
        outputs = [self._output(r, req, body.get("return_logprob", False), rid, i)
                   for i, (r, req) in enumerate(zip(results, requests, strict=True))]  # fmt: skip
        return outputs[0] if single else outputs

    def _output(self, result: GenerationResult, request: GenerationRequest, logprob: bool, rid: Any, i: int) -> dict:
        meta: dict[str, Any] = {
            "id": (rid[i] if isinstance(rid, list) else rid) or f"local-{os.getpid()}-{id(result)}",
            "finish_reason": result.finish_reason,
            "prompt_tokens": len(request.input_ids),
            "completion_tokens": len(result.output_ids),
            "cached_tokens": 0,
            "weight_version": self.engine.weight_version,
        }
        if logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(result.logprobs, result.output_ids,
                                                                                  strict=True)]  # fmt: skip
        tokenizer = self.engine.tokenizer
        text = tokenizer.decode(result.output_ids) if tokenizer is not None else ""
        return {"text": text, "output_ids": result.output_ids, "meta_info": meta}

    async def health(self, body: dict) -> Response:
        return Response(status_code=200)

    async def health_generate(self, body: dict) -> Response:
        if self.engine.paused:
            return Response(status_code=200)  # paused on purpose: alive, not serving
        request = GenerationRequest([self.engine.pad_token_id], SamplingParams(max_new_tokens=1, temperature=0))
        try:
            await asyncio.wait_for(self.engine.generate([request]), timeout=20)
        except TimeoutError:
            return Response(status_code=503)
        return Response(status_code=200)

    async def model_info(self, body: dict) -> dict:
        return {"model_path": self.engine.model_path, "tokenizer_path": self.engine.model_path,
                "is_generation": True, "weight_version": self.engine.weight_version,
                "model_type": self.engine.model.config.model_type}  # fmt: skip

    async def server_info(self, body: dict) -> dict:
        return {"model_path": self.engine.model_path, "host": self.host, "port": self.port,
                "max_batch_size": self.engine.max_batch_size, "random_seed": self.engine.seed,
                "version": f"miles-local-engine {__version__}", "weight_version": self.engine.weight_version,
                "internal_states": [{"queued": self.engine.queued, "in_flight": self.in_flight,
                                     "paused": self.engine.paused,
                                     "generated_tokens": self.engine.generated_tokens,
                                     "generate_requests": self.generate_requests}]}  # fmt: skip

    # -- control plane --------------------------------------------------------------------------------------

    async def flush_cache(self, body: dict) -> Response:
        if self.in_flight:
            return PlainTextResponse("Cache not flushed: requests are running.", status_code=400)
        return PlainTextResponse("Cache flushed.")

    async def update_from_disk(self, body: dict) -> dict:
        if body.get("abort_all_requests"):
            await self.engine.pause("abort")
            self.engine.resume()
        loaded = await asyncio.to_thread(self.engine.update_from_disk, _require(body, "model_path", str),
                                         _version(body))  # fmt: skip
        return self._success(f"loaded {loaded} bytes from {body['model_path']}", num_paused_requests=0)

    async def update_from_tensor(self, body: dict) -> dict:
        payload = _require(body, "serialized_named_tensors", list)
        load_format = body.get("load_format")
        if load_format not in (None, "safetensors", "safetensors_path", "shm_staging", "shm_swap"):
            raise HttpError(
                400, f"load_format {load_format!r}: use safetensors, safetensors_path, shm_staging or shm_swap"
            )
        loaded = await asyncio.to_thread(self.engine.update_from_tensor, payload, _version(body), load_format)
        return self._success(f"loaded {loaded} bytes")

    async def init_group(self, body: dict) -> dict:
        await asyncio.to_thread(
            self.engine.init_group, master_address=_require(body, "master_address", str),
            master_port=_require(body, "master_port", int), rank_offset=_require(body, "rank_offset", int),
            world_size=_require(body, "world_size", int), group_name=body.get("group_name", "weight_update_group"),
            backend=body.get("backend", "gloo"),
        )  # fmt: skip
        return self._success("weight update group ready")

    async def update_from_distributed(self, body: dict) -> dict:
        loaded = await asyncio.to_thread(
            self.engine.update_from_distributed, names=_require(body, "names", list),
            dtypes=_require(body, "dtypes", list), shapes=_require(body, "shapes", list),
            group_name=body.get("group_name", "weight_update_group"), weight_version=_version(body),
        )  # fmt: skip
        return self._success(f"received {loaded} bytes")

    async def destroy_group(self, body: dict) -> dict:
        self.engine.destroy_group(body.get("group_name", "weight_update_group"))
        return self._success("weight update group destroyed")

    async def pause(self, body: dict) -> dict:
        await self.engine.pause(body.get("mode", "abort"))
        return {"status": "ok", "message": "generation paused", "weight_version": self.engine.weight_version}

    async def resume(self, body: dict) -> dict:
        self.engine.resume()
        return {"status": "ok", "message": "generation continued", "weight_version": self.engine.weight_version}

    async def update_version(self, body: dict) -> dict:
        new_version = _require(body, "new_version", str)
        if body.get("abort_all_requests", True):
            await self.engine.pause("abort")
            self.engine.resume()
        self.engine.weight_version = new_version
        return {**self._success(f"weight version is {new_version}"), "new_version": new_version}

    async def weights_checksum(self, body: dict) -> dict:
        """Not in SGLang's API: lets a test or ``verify_checksum`` prove the engine holds exact weights."""
        digest = await asyncio.to_thread(self.engine.weights_checksum)
        return {"checksum": digest, "weight_version": self.engine.weight_version}

    def _success(self, message: str, **extra: Any) -> dict:
        return {"success": True, "message": message, "weight_version": self.engine.weight_version, **extra}


async def _json_body(request: Request) -> dict:
    if request.method == "GET":
        return dict(request.query_params)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise HttpError(413, f"request body of {declared} bytes exceeds {MAX_BODY_BYTES}")
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HttpError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HttpError(400, "request body must be a JSON object")
    return body


def _require(body: dict, key: str, kind: type) -> Any:
    if key not in body:
        raise HttpError(400, f"missing field {key!r}")
    if not isinstance(body[key], kind) or (isinstance(body[key], bool) and kind is int):
        raise HttpError(400, f"field {key!r} must be {kind.__name__}, got {body[key]!r}")
    return body[key]


def _version(body: dict) -> str | None:
    version = body.get("weight_version")
    return None if version is None else str(version)


def _input_batch(body: dict, tokenizer: Any) -> tuple[list[list[int]], bool]:
    """The prompts as token-id lists, and whether the request was a single prompt."""
    if "input_ids" in body:
        ids = body["input_ids"]
        single = bool(ids) and all(isinstance(t, int) for t in ids)
        batch = [ids] if single else ids
        if (
            not isinstance(batch, list)
            or not batch
            or not all(
                isinstance(row, list) and row and all(isinstance(t, int) and not isinstance(t, bool) for t in row)
                for row in batch
            )
        ):
            raise HttpError(400, "input_ids must be a non-empty list of token ids, or a list of such lists")
        return batch, single
    if "text" in body:
        if tokenizer is None:
            raise HttpError(400, "this model directory has no tokenizer: send input_ids")
        texts = body["text"]
        single = isinstance(texts, str)
        return [tokenizer.encode(t) for t in ([texts] if single else texts)], single
    raise HttpError(400, "send input_ids (or text)")


def _sampling_params(raw: Any, count: int) -> list[SamplingParams]:
    raws = raw if isinstance(raw, list) else [raw or {}] * count
    if len(raws) != count:
        raise HttpError(400, f"{len(raws)} sampling_params for {count} prompts")
    try:
        return [SamplingParams.model_validate(item) for item in raws]
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise HttpError(400, f"bad sampling_params: {problems}") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles_core.engines.local_server", description=__doc__)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--admin-api-key", default=os.environ.get(TOKEN_ENV))
    parser.add_argument("--max-batch-size", "--max-running-requests", dest="max_batch_size", type=int, default=64)
    for flag in ("--tp-size", "--dp-size", "--ep-size"):  # SGLang's parallel flags: the local engine is one process
        parser.add_argument(flag, type=int, default=1, choices=[1], help="SGLang's flag; only 1 (one process)")
    parser.add_argument("--random-seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        engine = LocalEngine(args.model_path, max_batch_size=args.max_batch_size, seed=args.random_seed)
    except MilesError as exc:
        print(f"local engine: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    server = LocalEngineServer(engine, admin_key=args.admin_api_key, host=args.host, port=args.port)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        print(f"local engine: error: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        raise SystemExit(2) from None
    config = uvicorn.Config(server.app(), log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
