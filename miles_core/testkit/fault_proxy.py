"""A TCP proxy for HTTP/1.1 that breaks chosen requests, to test the RPC client's retries.

Each request through the proxy takes the next fault from its plan (then passes, once the plan is used up):

* ``"before"``: the connection is closed after the request arrived, without forwarding it (never executed);
* ``"after"``: the request is forwarded and answered, but the answer is dropped (executed, answer lost);
* ``"mid"``: half of the answer is relayed, then the connection is closed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

FAULTS = ("before", "after", "mid")


async def _read_message(reader: asyncio.StreamReader) -> bytes | None:
    """One HTTP/1.1 message (head and Content-Length body), or None at end of stream."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    return head + (await reader.readexactly(length) if length else b"")


class FaultProxy:
    """Listens on 127.0.0.1 and forwards to ``upstream_port``; counts what it did in :attr:`done`."""

    def __init__(self, upstream_port: int, plan: list[str]) -> None:
        unknown = set(plan) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; choose from {FAULTS}")
        self.upstream_port = upstream_port
        self.plan = collections.deque(plan)
        self.done: collections.Counter[str] = collections.Counter()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            while (request := await _read_message(client_reader)) is not None:
                fault = self.plan.popleft() if self.plan else "pass"
                self.done[fault] += 1
                if fault == "before":
                    return
                upstream_writer.write(request)
                await upstream_writer.drain()
                response = await _read_message(upstream_reader)
                if response is None or fault == "after":
                    return
                if fault == "mid":
                    client_writer.write(response[: len(response) // 2])
                    await client_writer.drain()
                    return
                client_writer.write(response)
                await client_writer.drain()
        finally:
            for writer in (client_writer, upstream_writer):
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()
