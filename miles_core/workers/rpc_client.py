"""The RPC client: submit, then long-poll, resending only what is safe to resend, always within a deadline.

Retry rule (``retry_until_deadline``): a request that provably never reached the server (the connection was
refused, or failed before the request was written) is simply sent again. A request that may have reached the server
is resubmitted with the *same call id*; the server executes a call id at most once and answers with that call's
record. Polls are read-only and are repeated freely. Every call has a deadline; a dead worker is reported as such
(fast when a liveness check is given, else when the deadline passes), never as a hang.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from miles_core.workers.errors import (
    CallLostError,
    RemoteError,
    RpcDeadlineError,
    RpcRequestError,
    WorkerDiedError,
)
from miles_core.workers.rpc_wire import DONE, MAX_WAIT_S, POLL_PATH, RUNNING, SUBMIT_PATH

NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
MAYBE_SENT = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadTimeout, httpx.WriteTimeout)
RETRY_STATUSES = (502, 503, 504)

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
        self.resends = 0  # requests sent again after a transport failure (for tests and diagnostics)

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
        :class:`RpcDeadlineError`, :class:`WorkerDiedError`, :class:`CallLostError`, :class:`RpcRequestError`)."""
        call = _Call(self, method, call_id or uuid.uuid4().hex, time.monotonic() + (timeout_s or self.timeout_s))
        payload = {"call_id": call.call_id, "method": method, "args": list(args), "kwargs": kwargs}
        record = await call.request("POST", SUBMIT_PATH, payload=payload)
        while record["state"] == RUNNING:
            record = await call.request("GET", POLL_PATH, params={"call_id": call.call_id})
        if record["state"] == DONE:
            return record.get("result")
        error = record["error"]
        raise RemoteError(
            worker=self.worker, method=method, error_type=error["type"], message=error["message"],
            traceback=error["traceback"],
        )  # fmt: skip

    async def health(self, *, timeout_s: float = 5.0) -> dict[str, Any]:
        """The worker's health record (one request, no retries)."""
        response = await self._client().get(f"{self.url}/rpc/health", timeout=timeout_s)
        response.raise_for_status()
        return response.json()


class _Call:
    """The retry loop of one call."""

    def __init__(self, client: RpcClient, method: str, call_id: str, deadline: float) -> None:
        self.client = client
        self.method = method
        self.call_id = call_id
        self.deadline = deadline
        self.accepted = False
        self.attempt = 0
        self.last_error: BaseException | None = None

    def describe(self) -> str:
        return f"{self.client.worker}.{self.method} (call {self.call_id}, {self.client.url})"

    async def request(self, verb: str, path: str, *, payload: dict | None = None, params: dict | None = None) -> dict:
        while True:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                last = f"; last error: {self.last_error!r} (is the worker alive?)" if self.last_error else ""
                raise RpcDeadlineError(f"{self.describe()} did not finish before its deadline{last}")
            wait_s = max(0.0, min(self.client.long_poll_s, remaining - 0.25))
            try:
                response = await self._send(verb, path, payload, params, wait_s, remaining)
            except NEVER_SENT as exc:
                await self._before_resend(exc, maybe_reached=False)
                continue
            except MAYBE_SENT as exc:
                await self._before_resend(exc, maybe_reached=True)
                continue
            if response.status_code in RETRY_STATUSES:
                await self._before_resend(None, maybe_reached=True)
                continue
            return self._record(response)

    async def _send(
        self, verb: str, path: str, payload: dict | None, params: dict | None, wait_s: float, remaining: float
    ) -> httpx.Response:
        url = f"{self.client.url}{path}"
        timeout = httpx.Timeout(min(remaining, wait_s + 10.0), connect=min(remaining, 5.0))
        if verb == "POST":
            return await self.client._client().post(url, json={**(payload or {}), "wait_s": wait_s}, timeout=timeout)
        return await self.client._client().get(url, params={**(params or {}), "wait_s": wait_s}, timeout=timeout)

    def _record(self, response: httpx.Response) -> dict:
        try:
            body = response.json()
        except json.JSONDecodeError:
            body = {"error": response.text[:500]}
        if response.status_code == 404 and self.accepted:
            raise CallLostError(
                f"{self.describe()} is no longer known to the worker ({body.get('error')}); it restarted or the "
                "result expired, so the call's outcome is unknown"
            )
        if response.status_code != 200:
            raise RpcRequestError(
                f"{self.describe()} refused with HTTP {response.status_code}: {body.get('error')}",
                status=response.status_code,
            )
        self.accepted = True
        return body

    async def _before_resend(self, exc: BaseException | None, *, maybe_reached: bool) -> None:
        """Fail fast if the worker is dead; otherwise back off a little before the same request is resent."""
        self.last_error = exc
        liveness = self.client.liveness
        if liveness is not None and not await liveness():
            raise WorkerDiedError(f"worker {self.client.worker} died during {self.describe()}: {exc!r}")
        self.client.resends += 1
        self.attempt += 1
        delay = min(0.02 * 2**self.attempt, 1.0)
        await asyncio.sleep(min(delay, max(0.0, self.deadline - time.monotonic())))
