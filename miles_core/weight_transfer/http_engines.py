"""The base of the protocols that reach engines through their HTTP API (``EngineClient``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from miles_core.engines.client import EngineClient
from miles_core.weight_transfer.protocol import EngineEndpoint, TransferReport, WeightTransferProtocol


class HttpEngineProtocol(WeightTransferProtocol):
    """Keeps one :class:`EngineClient` per engine and runs a step on all engines at once."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.engines: list[EngineEndpoint] = []
        self.clients: list[EngineClient] = []

    async def connect(self, engines: Sequence[EngineEndpoint]) -> None:
        await self._close_clients()
        self.engines = list(engines)
        self.clients = [EngineClient(e.url, admin_key=e.admin_key, name=e.name) for e in self.engines]

    async def on_each_engine(self, step: Callable[[EngineClient], Awaitable[Any]]) -> list[Any]:
        return list(await asyncio.gather(*(step(client) for client in self.clients)))

    async def publish_version(self, version: int) -> None:
        await self.on_each_engine(lambda client: client.update_weight_version(str(version)))

    def report(self, *, version: int, num_bytes: int, started: float) -> TransferReport:
        return TransferReport(
            protocol=self.name,
            version=version,
            num_bytes=num_bytes,
            seconds=time.perf_counter() - started,
            num_engines=len(self.engines),
        )

    async def close(self) -> None:
        await self._close_clients()

    async def _close_clients(self) -> None:
        for client in self.clients:
            await client.aclose()
        self.clients = []
