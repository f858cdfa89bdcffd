"""The worker RPC server: submit-poll over HTTP, with long polling, concurrency groups and an expiring call store.

A worker marks the methods it serves with :func:`rpc_method`; :class:`RpcServer` serves them on 127.0.0.1 by
default. Arguments are JSON, checked against the method's signature and type hints before a call is accepted;
results are JSON. A call id is executed at most once: resubmitting it returns the same call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import hmac
import inspect
import json
import os
import socket
import threading
import traceback
import typing
from collections.abc import Callable
from typing import Any

import pydantic
import pydantic_core
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from miles_core.workers.call_store import DEFAULT_RESULT_TTL_S, CallRecord, CallStore, StoreFullError
from miles_core.workers.rpc_wire import DONE, FAILED, HEALTH_PATH, MAX_WAIT_S, POLL_PATH, RUNNING, SUBMIT_PATH

RPC_MARKER = "__miles_rpc_group__"
DEFAULT_GROUPS: dict[str, int | None] = {"control": 1, "query": None}
"""Concurrency group -> limit (None: unlimited). Control calls run one at a time; queries run freely."""
UNLIMITED_THREADS = 64


def rpc_method(group: str = "control") -> Callable[[Callable], Callable]:
    """Mark a worker method as callable over RPC, in the concurrency group ``group``."""

    def mark(fn: Callable) -> Callable:
        setattr(fn, RPC_MARKER, group)
        return fn

    return mark


def rpc_methods_of(cls: type) -> dict[str, Callable]:
    """The methods of ``cls`` marked with :func:`rpc_method`, by name."""
    return {name: fn for name, fn in inspect.getmembers(cls, callable) if hasattr(fn, RPC_MARKER)}


class BadRequest(Exception):
    """A request the server refuses with a 4xx status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class _Method:
    name: str
    fn: Callable
    group: str
    signature: inspect.Signature
    adapters: dict[str, pydantic.TypeAdapter]

    @classmethod
    def of(cls, name: str, fn: Callable, group: str) -> _Method:
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
        adapters = {}
        for param in signature.parameters.values():
            annotation = hints.get(param.name, Any)
            if param.kind is param.VAR_POSITIONAL:
                annotation = tuple[annotation, ...]
            elif param.kind is param.VAR_KEYWORD:
                annotation = dict[str, annotation]
            adapters[param.name] = pydantic.TypeAdapter(annotation)
        return cls(name=name, fn=fn, group=group, signature=signature, adapters=adapters)

    def bind(self, args: list[Any], kwargs: dict[str, Any]) -> inspect.BoundArguments:
        """Bind and type-check JSON arguments; a mismatch is a 400 naming the parameter and the value."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise BadRequest(400, f"bad arguments for {self.name}{self.signature}: {exc}") from None
        for name, value in bound.arguments.items():
            try:
                bound.arguments[name] = self.adapters[name].validate_python(value)
            except pydantic.ValidationError as exc:
                problems = "; ".join(error["msg"] for error in exc.errors())
                message = f"bad argument {name}={value!r} for {self.name}{self.signature}: {problems}"
                raise BadRequest(400, message) from None
        return bound


class _Group:
    """A concurrency group: a limit on running calls, and threads for its synchronous methods."""

    def __init__(self, name: str, limit: int | None) -> None:
        self.name = name
        self.limit = limit
        self.semaphore = asyncio.Semaphore(limit) if limit else None
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=limit or UNLIMITED_THREADS, thread_name_prefix=f"rpc-{name}"
        )

    async def run(self, method: _Method, bound: inspect.BoundArguments) -> Any:
        if self.semaphore is None:
            return await self._call(method, bound)
        async with self.semaphore:
            return await self._call(method, bound)

    async def _call(self, method: _Method, bound: inspect.BoundArguments) -> Any:
        if inspect.iscoroutinefunction(method.fn):
            return await method.fn(*bound.args, **bound.kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, lambda: method.fn(*bound.args, **bound.kwargs))


class RpcServer:
    """Serves a worker object's :func:`rpc_method` methods (plus any registered with :meth:`register`)."""

    def __init__(
        self,
        target: Any = None,
        *,
        token: str,
        name: str = "worker",
        host: str = "127.0.0.1",
        port: int = 0,
        groups: dict[str, int | None] | None = None,
        result_ttl_s: float = DEFAULT_RESULT_TTL_S,
        max_calls: int = 100_000,
        max_result_bytes: int = 256 << 20,
        max_body_bytes: int = 16 << 20,
    ) -> None:
        if not token:
            raise ValueError("an RPC server needs the run's token")
        self.name = name
        self.host = host
        self.port = port
        self._token = token.encode()
        self._group_limits = dict(DEFAULT_GROUPS if groups is None else groups)
        self._groups: dict[str, _Group] = {}
        self._methods: dict[str, _Method] = {}
        self.store = CallStore(ttl_s=result_ttl_s, max_calls=max_calls, max_result_bytes=max_result_bytes)
        self.max_body_bytes = max_body_bytes
        self._tasks: set[asyncio.Task] = set()
        self._server: uvicorn.Server | None = None
        self._serve_task: asyncio.Task | None = None
        self._sweeper: asyncio.Task | None = None
        if target is not None:
            for method_name, fn in rpc_methods_of(type(target)).items():
                self.register(method_name, getattr(target, method_name), group=getattr(fn, RPC_MARKER))

    @property
    def url(self) -> str:
        """The base URL, once started."""
        return f"http://{self.host}:{self.port}"

    def register(self, name: str, fn: Callable, *, group: str = "control") -> None:
        """Serve ``fn`` as method ``name`` in concurrency group ``group``."""
        if group not in self._group_limits:
            raise ValueError(f"unknown concurrency group {group!r} for {name}; groups: {sorted(self._group_limits)}")
        if name in self._methods:
            raise ValueError(f"method {name!r} is registered twice")
        self._methods[name] = _Method.of(name, fn, group)

    # -- lifecycle ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the socket and start serving in the running event loop."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted connections
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        self._groups = {name: _Group(name, limit) for name, limit in self._group_limits.items()}
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, timeout_keep_alive=75)
        self._server = uvicorn.Server(config)
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[sock]))
        self._sweeper = asyncio.create_task(self._sweep())
        while not self._server.started:
            if self._serve_task.done():
                self._serve_task.result()  # raises the start-up error
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        """Stop serving; running calls are cancelled."""
        if self._server is not None:
            self._server.should_exit = True
        for task in [*self._tasks, self._sweeper]:
            if task is not None:
                task.cancel()
        if self._serve_task is not None:
            await self._serve_task
        for group in self._groups.values():
            group.executor.shutdown(wait=False, cancel_futures=True)

    def start_in_thread(self) -> threading.Thread:
        """Serve from a daemon thread with its own event loop (for hosts that own the main thread, like Ray
        actors). Returns once the server listens."""
        started = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            async def main() -> None:
                try:
                    await self.start()
                except BaseException as exc:
                    failure.append(exc)
                    raise
                finally:
                    started.set()
                await self._serve_task

            asyncio.run(main())

        thread = threading.Thread(target=serve, name=f"rpc-server-{self.name}", daemon=True)
        thread.start()
        started.wait()
        if failure:
            raise failure[0]
        return thread

    async def _sweep(self) -> None:
        interval = min(max(self.store.ttl_s / 4, 0.05), 60.0)
        while True:
            await asyncio.sleep(interval)
            self.store.expire()

    # -- HTTP -----------------------------------------------------------------------------------------------

    def _app(self) -> Starlette:
        routes = [
            Route(SUBMIT_PATH, self._guard(self._submit), methods=["POST"]),
            Route(POLL_PATH, self._guard(self._poll), methods=["GET"]),
            Route(HEALTH_PATH, self._guard(self._health), methods=["GET"]),
        ]
        return Starlette(routes=routes)

    def _guard(self, handler: Callable) -> Callable:
        async def endpoint(request: Request) -> Response:
            try:
                self._check_token(request)
                return await handler(request)
            except BadRequest as exc:
                return JSONResponse({"error": str(exc)}, status_code=exc.status)
            except StoreFullError as exc:
                return JSONResponse({"error": f"worker {self.name} is overloaded: {exc}"}, status_code=503)

        return endpoint

    def _check_token(self, request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented:
            raise BadRequest(401, "missing run token: send 'Authorization: Bearer <token>'")
        if not hmac.compare_digest(presented.encode(), self._token):
            raise BadRequest(401, "wrong run token")

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"ok": True, "name": self.name, "pid": os.getpid(), "calls": len(self.store)})

    async def _submit(self, request: Request) -> Response:
        body = await self._read_json(request)
        call_id, method_name = body.get("call_id"), body.get("method")
        args, kwargs, wait_s = body.get("args", []), body.get("kwargs", {}), body.get("wait_s", 0)
        if not isinstance(call_id, str) or not 0 < len(call_id) <= 128:
            raise BadRequest(400, "call_id must be a string of 1 to 128 characters")
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise BadRequest(400, "args must be a JSON list and kwargs a JSON object")
        fingerprint = hashlib.sha256(json.dumps([method_name, args, kwargs], sort_keys=True).encode()).hexdigest()
        record = self.store.get(call_id)
        if record is None:
            record = self._accept(call_id, method_name, args, kwargs, fingerprint)
        elif record.fingerprint != fingerprint:
            raise BadRequest(409, f"call id {call_id!r} was already submitted with a different method or arguments")
        return await self._answer(record, wait_s)

    def _accept(self, call_id: str, method_name: Any, args: list, kwargs: dict, fingerprint: str) -> CallRecord:
        reason = self.store.forgotten_reason(call_id)
        if reason is not None:
            raise BadRequest(409, f"call id {call_id!r} was already executed and its result {reason}; use a new id")
        method = self._methods.get(method_name) if isinstance(method_name, str) else None
        if method is None:
            raise BadRequest(404, f"worker {self.name} has no method {method_name!r}; methods: {sorted(self._methods)}")
        bound = method.bind(args, kwargs)
        record = CallRecord(call_id=call_id, fingerprint=fingerprint, method=method.name)
        self.store.add(record)
        task = asyncio.create_task(self._execute(record, method, bound))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return record

    async def _execute(self, record: CallRecord, method: _Method, bound: inspect.BoundArguments) -> None:
        try:
            result = await self._groups[method.group].run(method, bound)
            body = _record_body(record.call_id, DONE, "result", pydantic_core.to_json(result).decode())
            state = DONE
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # SystemExit too: a call must always end with a record
            error = {"type": _qualified_name(type(exc)), "message": str(exc), "traceback": traceback.format_exc()}
            body, state = _record_body(record.call_id, FAILED, "error", json.dumps(error)), FAILED
        self.store.finish(record, state=state, body=body)

    async def _poll(self, request: Request) -> Response:
        call_id = request.query_params.get("call_id", "")
        record = self.store.get(call_id)
        if record is None:
            reason = self.store.forgotten_reason(call_id)
            if reason is not None:
                raise BadRequest(404, f"call {call_id!r} {reason}: its result is no longer held")
            raise BadRequest(404, f"unknown call id {call_id!r} on worker {self.name}")
        return await self._answer(record, request.query_params.get("wait_s", "0"))

    async def _answer(self, record: CallRecord, wait_s: Any) -> Response:
        try:
            wait = min(max(float(wait_s), 0.0), MAX_WAIT_S)
        except (TypeError, ValueError):
            raise BadRequest(400, f"wait_s must be a number of seconds, got {wait_s!r}") from None
        if wait > 0 and not record.done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(record.done.wait(), timeout=wait)
        if record.state == RUNNING:
            return Response(_record_body(record.call_id, RUNNING), media_type="application/json")
        return Response(record.body, media_type="application/json")

    async def _read_json(self, request: Request) -> dict[str, Any]:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise BadRequest(413, f"request body of {declared} bytes exceeds the limit of {self.max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BadRequest(413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest(400, "request body must be a JSON object")
        return body


def _record_body(call_id: str, state: str, key: str | None = None, raw_json: str | None = None) -> str:
    head = f'{{"call_id": {json.dumps(call_id)}, "state": "{state}"'
    return head + (f', "{key}": {raw_json}}}' if key else "}")


def _qualified_name(cls: type) -> str:
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
