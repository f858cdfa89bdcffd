"""The RPC client: submit, then long-poll, resending only what is safe to resend, always within a deadline.

Resend rule. A submit that provably never reached the worker (the connection was refused or timed out before it
was made, or the worker answered 503: overloaded, not accepted) is sent again as it was: the call has not run.
A submit that may have reached the worker (the connection broke after the request was written, or a gateway
answered 502/504) is resubmitted with the *same call id*: the worker executes a call id at most once and answers
a resubmit with that call's record, so the call runs once whichever way the first attempt went. From then on the
call *may have run*, and the client says so: a worker that no longer holds its result (404 after it was accepted,
410 for a call id it ran and forgot) is a :class:`CallLostError`, and an :class:`RpcDeadlineError` or
:class:`WorkerDiedError` carries ``may_have_run`` (with the call id to resubmit in its message). Polls are
read-only and are repeated freely. Every call has a deadline, and the submit carries it: the worker cancels the
call when it passes, so a call nobody waits for any more holds no slot of its concurrency group. A dead worker is
reported as such (fast when a liveness check is given, else when the deadline passes), never as a hang.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pydantic_core

from miles_core.workers.errors import (
    CallLostError,
    RemoteError,
    RpcDeadlineError,
    RpcProtocolError,
    RpcRequestError,
    WorkerDiedError,
)
from miles_core.workers.rpc.wire import (
    CANCEL_PATH,
    DONE,
    GONE,
    MAX_WAIT_S,
    POLL_PATH,
    RUNNING,
    SUBMIT_PATH,
    CallRecord,
    CancelRequest,
    ErrorBody,
    PollRequest,
    SubmitRequest,
    WireError,
    validate,
    validate_json,
)

NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
"""Transport failures before a connection existed: the request was never written."""
MAYBE_SENT = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadTimeout, httpx.WriteTimeout)
"""Transport failures on an open connection: the request may have been received whole."""
NOT_ACCEPTED_STATUSES = (503,)  # the worker's own "overloaded": it refused the call before accepting it
MAYBE_FORWARDED_STATUSES = (502, 504)  # a gateway's failure: it may have forwarded the request

LivenessCheck = Callable[[], Awaitable[bool]]


class RpcClient:
    """Calls methods of one worker. ``liveness`` (optional) answers whether the worker's process still lives."""

    def __init__(
        self,
        url: str,
        *,
        token: str,
        worker: str,
        timeout_s: float = 600.0,
        long_poll_s: float = 30.0,
        liveness: LivenessCheck | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.worker = worker
        self.timeout_s = timeout_s
        self.long_poll_s = min(long_poll_s, MAX_WAIT_S)
        self.liveness = liveness
        self._headers = {"Authorization": f"Bearer {token}"}
        self._http: httpx.AsyncClient | None = None
        self.resends = 0  # requests sent again after a transport failure or a 5xx (for tests and diagnostics)

    async def __aenter__(self) -> RpcClient:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:  # created lazily: an httpx client belongs to the event loop that first uses it
            self._http = httpx.AsyncClient(headers=self._headers, timeout=None)
        return self._http

    async def call(
        self, method: str, *args: Any, timeout_s: float | None = None, call_id: str | None = None, **kwargs: Any
    ) -> Any:
        """Call ``method`` with JSON arguments; return its JSON result or raise :class:`RemoteError` (or
        :class:`RpcDeadlineError`, :class:`WorkerDiedError`, :class:`CallLostError`, :class:`RpcRequestError`).
        Dataclasses and pydantic models travel as JSON objects and tuples as arrays (:func:`encode_value`; the worker
        rebuilds them from the method's type hints). Arguments that are not strict JSON even so (NaN, infinity, other
        objects) are a ``ValueError``, and nothing is sent."""
        call = _Call(self, method, call_id or uuid.uuid4().hex, time.monotonic() + (timeout_s or self.timeout_s))
        record = await call.request(SUBMIT_PATH, _submit_request(call, list(args), kwargs))
        while record.state == RUNNING:
            record = await call.request(POLL_PATH, PollRequest(call_id=call.call_id))
        if record.state == DONE:
            return record.result
        assert record.error is not None  # a failed record has one (CallRecord checks)
        raise RemoteError(
            worker=self.worker,
            method=method,
            error_type=record.error.type,
            message=record.error.message,
            traceback=record.error.traceback,
        )

    async def cancel(self, call_id: str, *, timeout_s: float = 10.0) -> CallRecord:
        """Cancel the call ``call_id`` if it still runs (one request, no retries); its record after the cancel: a
        failed one of type :data:`~miles_core.workers.rpc.wire.CANCELLED`, or the one it finished with."""
        response = await self._client().post(
            f"{self.url}{CANCEL_PATH}",
            content=CancelRequest(call_id=call_id).model_dump_json().encode(),
            headers=_JSON,
            timeout=timeout_s,
        )
        if response.status_code != 200:
            raise RpcRequestError(
                f"{self.worker}: cancel of call {call_id!r} refused with HTTP {response.status_code}: "
                f"{_error_message(response)}",
                status=response.status_code,
            )
        return validate_json(CallRecord, response.content)

    async def health(self, *, timeout_s: float = 5.0) -> dict[str, Any]:
        """The worker's health record (one request, no retries)."""
        response = await self._client().get(f"{self.url}/rpc/health", timeout=timeout_s)
        response.raise_for_status()
        return response.json()


class _Call:
    """The retry loop of one call, and what is known of its fate: whether a submit of it may have arrived."""

    def __init__(self, client: RpcClient, method: str, call_id: str, deadline: float) -> None:
        self.client = client
        self.method = method
        self.call_id = call_id
        self.deadline = deadline
        self.accepted = False
        self.may_have_run = False  # a submit was accepted or may have reached the worker
        self.attempt = 0
        self.last_error: BaseException | None = None

    def describe(self) -> str:
        return f"{self.client.worker}.{self.method} (call {self.call_id}, {self.client.url})"

    def fate(self, *, worker_died: bool = False) -> str:
        """What is known of whether the call ran, for an error that ends it without an answer."""
        if self.accepted and worker_died:
            return "the worker had accepted it, so it may have run in part or whole"
        if self.accepted:
            return (
                "the worker accepted it and cancels it at the same deadline unless it finished first: poll call id "
                f"{self.call_id!r} to learn its outcome"
            )
        if self.may_have_run:
            return f"it may have run: submit call id {self.call_id!r} again to learn its outcome"
        return "the worker never accepted it, so it did not run"

    async def request(self, path: str, request: SubmitRequest | PollRequest) -> CallRecord:
        """Send ``request`` (its ``wait_s`` set for each attempt) until an answer comes, resending what is safe to
        resend; the answer as a call record, or the error it is."""
        while True:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                last = f"; last error: {self.last_error!r} (is the worker alive?)" if self.last_error else ""
                raise RpcDeadlineError(
                    f"{self.describe()} did not finish before its deadline; {self.fate()}{last}",
                    may_have_run=self.may_have_run,
                )
            wait_s = max(0.0, min(self.client.long_poll_s, remaining - 0.25))
            update: dict[str, float] = {"wait_s": wait_s}
            if isinstance(request, SubmitRequest):
                update["deadline_s"] = remaining  # the worker cancels the call when the caller stops waiting for it
            try:
                response = await self._send(path, request.model_copy(update=update), remaining)
            except NEVER_SENT as exc:
                await self._before_resend(exc, path, maybe_reached=False)
                continue
            except MAYBE_SENT as exc:
                await self._before_resend(exc, path, maybe_reached=True)
                continue
            if response.status_code in NOT_ACCEPTED_STATUSES + MAYBE_FORWARDED_STATUSES:
                reached = response.status_code in MAYBE_FORWARDED_STATUSES
                await self._before_resend(_StatusError(response), path, maybe_reached=reached)
                continue
            return self._record(response)

    async def _send(self, path: str, request: SubmitRequest | PollRequest, remaining: float) -> httpx.Response:
        url = f"{self.client.url}{path}"
        timeout = httpx.Timeout(min(remaining, request.wait_s + 10.0), connect=min(remaining, 5.0))
        if isinstance(request, SubmitRequest):
            return await self.client._client().post(url, content=_json(request), headers=_JSON, timeout=timeout)
        return await self.client._client().get(url, params=request.model_dump(), timeout=timeout)

    def _record(self, response: httpx.Response) -> CallRecord:
        lost = response.status_code == GONE or (response.status_code == 404 and self.accepted)
        if lost and self.may_have_run:
            raise CallLostError(
                f"{self.describe()} is no longer known to the worker ({_error_message(response)}); it restarted or "
                "the result expired, so the call's outcome is unknown"
            )
        if response.status_code != 200:
            raise RpcRequestError(
                f"{self.describe()} refused with HTTP {response.status_code}: {_error_message(response)}",
                status=response.status_code,
            )
        self.may_have_run = True  # something at the worker's address took the request and answered it
        try:
            record = validate_json(CallRecord, response.content)
        except WireError as exc:
            raise RpcProtocolError(
                f"{self.describe()}: the worker's answer is not a call record ({exc}); is {self.client.url} a Miles "
                "worker of this version? The call may have run",
                may_have_run=True,
            ) from None
        if record.call_id != self.call_id:
            raise RpcProtocolError(
                f"{self.describe()}: the worker answered with the record of call {record.call_id!r}; is "
                f"{self.client.url} a Miles worker of this version? The call may have run",
                may_have_run=True,
            )
        self.accepted = True
        return record

    async def _before_resend(self, exc: BaseException, path: str, *, maybe_reached: bool) -> None:
        """Note whether the failed request may have arrived; fail fast if the worker is dead; otherwise back off a
        little before the same request is sent again."""
        self.last_error = exc
        if maybe_reached and path == SUBMIT_PATH:
            self.may_have_run = True
        liveness = self.client.liveness
        if liveness is not None and not await liveness():
            raise WorkerDiedError(
                f"worker {self.client.worker} died during {self.describe()}; {self.fate(worker_died=True)}: {exc!r}",
                may_have_run=self.may_have_run,
            )
        self.client.resends += 1
        self.attempt += 1
        delay = min(0.02 * 2**self.attempt, 1.0)
        await asyncio.sleep(min(delay, max(0.0, self.deadline - time.monotonic())))


class _StatusError(Exception):
    """A 5xx answer that is retried, kept as the call's last error."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"HTTP {response.status_code}: {response.text[:200]}")


def encode_value(value: Any) -> Any:
    """``value`` in its JSON form, the one the worker's server uses for results too: dataclasses and pydantic models
    as objects, tuples as arrays (``pydantic_core.to_jsonable_python``); NaN and infinity are left for the check."""
    return pydantic_core.to_jsonable_python(value)


def _submit_request(call: _Call, args: list[Any], kwargs: dict[str, Any]) -> SubmitRequest:
    """The call's submit, its arguments in JSON form; arguments that are not strict JSON, or a call id or method
    that the worker would refuse, are a ``ValueError`` before anything is sent."""
    try:
        submit = validate(
            SubmitRequest,
            {
                "call_id": call.call_id,
                "method": call.method,
                "args": encode_value(args),
                "kwargs": encode_value(kwargs),
            },
        )
        _json(submit)
        return submit
    except WireError as exc:
        raise ValueError(f"{call.describe()}: not a valid submit: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{call.describe()}: the arguments must be JSON (str keys, finite numbers, lists, dicts): {exc}"
        ) from None


_JSON = {"Content-Type": "application/json"}


def _json(submit: SubmitRequest) -> bytes:
    """A submit's body: strict JSON (NaN refused), ASCII-escaped as the worker's parser reads any string."""
    return json.dumps(submit.model_dump(), allow_nan=False).encode()


def _error_message(response: httpx.Response) -> str:
    """The message of a refusal: the worker's :class:`ErrorBody`, or the start of whatever else answered (a
    gateway's page)."""
    try:
        return validate_json(ErrorBody, response.content).error
    except WireError:
        return response.text[:500]
