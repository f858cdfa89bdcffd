"""The worker RPC server: submit-poll over HTTP, with long polling, concurrency groups and an expiring call store.

A worker marks the methods it serves with :func:`rpc_method`; :class:`RpcServer` serves them on its node's address
(:func:`~miles_core.workers.node.node_address`: loopback on one machine) by default. A submit is checked whole
before anything runs: its fields, the method, the arguments against the method's signature and, strictly, against
its type hints (``true`` is not an ``int``, ``"5"`` is not an ``int``, non-finite numbers are refused, containers
and pydantic models are checked element by element). Results are JSON. A call id is executed at most once:
resubmitting it returns the same call. A call is cancelled when its caller's deadline (the submit's
``deadline_s``) passes, or by ``POST /rpc/cancel``: an async method is cancelled where it awaits; a synchronous one
cannot be stopped (Python has no way to stop a thread), so its record says cancelled at once and its slot in the
concurrency group stays held until its thread returns, keeping the group's limit true.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import hashlib
import inspect
import json
import os
import re
import threading
import traceback
from collections.abc import Callable
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from miles_core.http import (
    JSON_ERRORS,
    BoundedHttpProtocol,
    HttpError,
    bearer_token_matches,
    parse_json_object,
    read_body,
)
from miles_core.workers.node import node_address, url_host
from miles_core.workers.process import listening_socket
from miles_core.workers.rpc.arguments import ArgumentCheck, ArgumentError, short_repr
from miles_core.workers.rpc.call_store import DEFAULT_RESULT_TTL_S, CallStore, StoredCall, StoreFullError
from miles_core.workers.rpc.wire import (
    CANCEL_PATH,
    CANCELLED,
    DONE,
    FAILED,
    GONE,
    HEALTH_PATH,
    POLL_PATH,
    RUNNING,
    SUBMIT_PATH,
    CallFailure,
    CallRecord,
    CancelRequest,
    ErrorBody,
    Model,
    PollRequest,
    SubmitRequest,
    WireError,
    validate,
    wire_text,
)

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


@dataclasses.dataclass
class _Method:
    """A served method, its concurrency group and the strict check of its arguments."""

    name: str
    fn: Callable
    group: str
    arguments: ArgumentCheck

    @classmethod
    def of(cls, name: str, fn: Callable, group: str) -> _Method:
        return cls(name=name, fn=fn, group=group, arguments=ArgumentCheck(name, fn))

    def bind(self, args: list[Any], kwargs: dict[str, Any]) -> inspect.BoundArguments:
        """Bind and strictly type-check JSON arguments; a mismatch is a 400 naming the parameter, the expected
        type and the value."""
        try:
            return self.arguments.bind(args, kwargs)
        except ArgumentError as exc:
            raise HttpError(400, str(exc)) from None


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
        future = loop.run_in_executor(self.executor, lambda: method.fn(*bound.args, **bound.kwargs))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The thread cannot be stopped: hold the group's slot (this task) until it returns, so that the
            # group never runs more calls at once than its limit.
            await asyncio.wait([future])
            raise


class RpcServer:
    """Serves a worker object's :func:`rpc_method` methods (plus any registered with :meth:`register`)."""

    def __init__(
        self,
        target: Any = None,
        *,
        token: str,
        name: str = "worker",
        host: str | None = None,
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
        self.host = host or node_address()
        self.port = port
        self._token = token
        self._group_limits = dict(DEFAULT_GROUPS if groups is None else groups)
        self._groups: dict[str, _Group] = {}
        self._methods: dict[str, _Method] = {}
        self.store = CallStore(ttl_s=result_ttl_s, max_calls=max_calls, max_result_bytes=max_result_bytes)
        self.max_body_bytes = max_body_bytes
        self._tasks: set[asyncio.Task] = set()
        self._running: dict[str, asyncio.Task] = {}  # call id -> the task running it, until it ends
        self._server: uvicorn.Server | None = None
        self._serve_task: asyncio.Task | None = None
        self._sweeper: asyncio.Task | None = None
        self._stopping: asyncio.Event | None = None  # set by stop(): held-open requests answer at once
        if target is not None:
            for method_name, fn in rpc_methods_of(type(target)).items():
                self.register(method_name, getattr(target, method_name), group=getattr(fn, RPC_MARKER))

    @property
    def url(self) -> str:
        """The base URL, once started."""
        return f"http://{url_host(self.host)}:{self.port}"

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
        sock = listening_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        self._groups = {name: _Group(name, limit) for name, limit in self._group_limits.items()}
        self._stopping = asyncio.Event()
        config = uvicorn.Config(
            self._app(), log_level="warning", access_log=False, timeout_keep_alive=75, http=BoundedHttpProtocol
        )
        self._server = uvicorn.Server(config)
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[sock]))
        self._sweeper = asyncio.create_task(self._sweep())
        while not self._server.started:
            if self._serve_task.done():
                self._serve_task.result()  # raises the start-up error
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        """Stop serving; running calls are cancelled, and requests held open for them are answered at once (the
        call still "running": its outcome is unknown) rather than when their wait would end."""
        if self._stopping is not None:
            self._stopping.set()
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
            Route(CANCEL_PATH, self._guard(self._cancel_route), methods=["POST"]),
            Route(HEALTH_PATH, self._guard(self._health), methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers=JSON_ERRORS)

    def _guard(self, handler: Callable) -> Callable:
        async def endpoint(request: Request) -> Response:
            try:
                self._check_token(request)
                return await handler(request)
            except HttpError as exc:
                return _error_response(str(exc), exc.status)
            except StoreFullError as exc:
                return _error_response(f"worker {self.name} is overloaded: {exc}", 503)

        return endpoint

    def _check_token(self, request: Request) -> None:
        if not bearer_token_matches(request.headers.get("authorization"), self._token):
            raise HttpError(401, "missing or wrong run token: send 'Authorization: Bearer <the run's token>'")

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"ok": True, "name": self.name, "pid": os.getpid(), "calls": len(self.store)})

    async def _submit(self, request: Request) -> Response:
        body = parse_json_object(await read_body(request, limit=self.max_body_bytes))
        submit = _valid(SubmitRequest, body)
        fingerprint = _fingerprint(submit)
        record = self.store.get(submit.call_id)
        if record is None:
            record = self._accept(submit, fingerprint)
        elif record.fingerprint != fingerprint:
            raise HttpError(
                409, f"call id {submit.call_id!r} was already submitted with a different method or arguments"
            )
        return await self._answer(record, submit.wait_s)

    def _accept(self, submit: SubmitRequest, fingerprint: str) -> StoredCall:
        """Start a new call, once every part of it is known to be valid."""
        reason = self.store.forgotten_reason(submit.call_id)
        if reason is not None:
            raise HttpError(
                GONE, f"call id {submit.call_id!r} was already executed and its result {reason}; use a new id"
            )
        method = self._methods.get(submit.method)
        if method is None:
            raise HttpError(
                404, f"worker {self.name} has no method {short_repr(submit.method)}; methods: {sorted(self._methods)}"
            )
        bound = method.bind(submit.args, submit.kwargs)
        record = StoredCall(call_id=submit.call_id, fingerprint=fingerprint, method=method.name)
        self.store.add(record)
        task = asyncio.create_task(self._execute(record, method, bound))
        self._tasks.add(task)
        self._running[record.call_id] = task
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: self._running.pop(record.call_id, None))
        if submit.deadline_s is not None:
            reason = f"its caller's deadline ({submit.deadline_s:g} s after the submit) passed"
            timer = asyncio.get_running_loop().call_later(submit.deadline_s, self.cancel, record.call_id, reason)
            task.add_done_callback(lambda _: timer.cancel())
        return record

    def cancel(self, call_id: str, reason: str) -> bool:
        """Cancel the running call ``call_id``: its record becomes a failed one of type :data:`CANCELLED` (its
        pollers answered at once) and its task is cancelled. False when no such call is running."""
        task = self._running.get(call_id)
        record = self.store.get(call_id)
        if task is None or record is None or record.done.is_set():
            return False
        failure = CallFailure(
            type=CANCELLED,
            message=wire_text(f"call {call_id!r} ({record.method}) was cancelled: {reason}"),
            traceback="",
        )
        self.store.finish(record, state=FAILED, body=CallRecord(call_id=call_id, state=FAILED, error=failure).to_json())
        task.cancel()
        return True

    async def _execute(self, record: StoredCall, method: _Method, bound: inspect.BoundArguments) -> None:
        try:
            result = await self._groups[method.group].run(method, bound)
            body = CallRecord(call_id=record.call_id, state=DONE, result=result).to_json()  # the result encoded once
            state = DONE
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # SystemExit too: a call must always end with a record
            body, state = CallRecord(call_id=record.call_id, state=FAILED, error=_failure(exc)).to_json(), FAILED
        if not record.done.is_set():  # a cancelled call keeps the record its cancel wrote
            self.store.finish(record, state=state, body=body)

    async def _poll(self, request: Request) -> Response:
        poll = _parse_poll(request)
        record = self.store.get(poll.call_id)
        if record is None:
            reason = self.store.forgotten_reason(poll.call_id)
            if reason is not None:
                raise HttpError(GONE, f"call {poll.call_id!r} {reason}: its result is no longer held")
            raise HttpError(404, f"unknown call id {poll.call_id!r} on worker {self.name}")
        return await self._answer(record, poll.wait_s)

    async def _cancel_route(self, request: Request) -> Response:
        cancel = _valid(CancelRequest, parse_json_object(await read_body(request, limit=self.max_body_bytes)))
        record = self.store.get(cancel.call_id)
        if record is None:
            reason = self.store.forgotten_reason(cancel.call_id)
            if reason is not None:
                raise HttpError(GONE, f"call {cancel.call_id!r} {reason}: it finished long ago")
            raise HttpError(404, f"unknown call id {cancel.call_id!r} on worker {self.name}")
        self.cancel(cancel.call_id, "a cancel request came")
        return await self._answer(record, 0.0)

    async def _answer(self, record: StoredCall, wait_s: float) -> Response:
        """The call's record, once it finished or ``wait_s`` (already validated) passed."""
        if wait_s > 0 and not record.done.is_set() and self._stopping is not None:
            waits = [asyncio.ensure_future(event.wait()) for event in (record.done, self._stopping)]
            try:
                await asyncio.wait(waits, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        if record.state == RUNNING:
            return Response(CallRecord(call_id=record.call_id, state=RUNNING).to_json(), media_type="application/json")
        return Response(record.body, media_type="application/json")


def _valid(model: type[Model], data: Any) -> Model:
    """``data`` as the request ``model``; a misfit is a 400 naming each field, its value and what it allows."""
    try:
        return validate(model, data)
    except WireError as exc:
        raise HttpError(400, str(exc)) from None


def _fingerprint(submit: SubmitRequest) -> str:
    """What a resubmit of the same call id must repeat: the method and its arguments."""
    return hashlib.sha256(json.dumps([submit.method, submit.args, submit.kwargs], sort_keys=True).encode()).hexdigest()


def _parse_poll(request: Request) -> PollRequest:
    """A poll's query string, each parameter given at most once and ``wait_s`` written as a plain decimal."""
    params = request.query_params
    for name, count in collections.Counter(name for name, _ in params.multi_items()).items():
        if count > 1:
            raise HttpError(400, f"poll parameter {short_repr(name)} is given {count} times; give it once")
    wait_s = params.get("wait_s", "0")
    if not _DECIMAL.fullmatch(wait_s):
        raise HttpError(400, f"wait_s must be a number of seconds such as 2.5, got {short_repr(wait_s)}")
    return _valid(PollRequest, {**params, "wait_s": float(wait_s)})


_DECIMAL = re.compile(r"[0-9]{1,20}(\.[0-9]{0,20})?([eE][-+]?[0-9]{1,3})?")
"""A non-negative decimal number as a query parameter (what ``str(float)`` writes; no ``nan``, ``inf`` or sign)."""


def _failure(exc: BaseException) -> CallFailure:
    """How a call failed, as texts that JSON can carry whatever the exception repeats."""
    return CallFailure(
        type=wire_text(_qualified_name(type(exc))),
        message=wire_text(str(exc)),
        traceback=wire_text(traceback.format_exc()),
    )


def _error_response(message: str, status: int) -> Response:
    """``{"error": message}`` (:class:`ErrorBody`; a message repeating hostile input still encodes)."""
    return Response(ErrorBody.of(message).to_json(), status_code=status, media_type="application/json")


def _qualified_name(cls: type) -> str:
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
