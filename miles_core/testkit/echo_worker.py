"""``EchoWorker``: a small worker whose calls are counted, timed and traced, for runtime tests and benchmarks."""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time

from miles_core.workers.rpc.server import rpc_method

ECHO_GROUPS: dict[str, int | None] = {"control": 1, "query": None, "limited": 4}
"""Concurrency groups an ``EchoWorker`` server is started with."""


class EchoWorker:
    """Counts executions per key, tracks peak concurrency per group, and can sleep, fail or return big results."""

    def __init__(self, *, label: str = "echo") -> None:
        self.label = label
        self.version = 0
        self.executions: collections.Counter[str] = collections.Counter()
        self._running: collections.Counter[str] = collections.Counter()
        self.peaks: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()  # "limited" calls run in threads

    @rpc_method("control")
    def record(self, key: str, value: int) -> int:
        """Count one execution of ``key``; return ``2 * value``."""
        self.executions[key] += 1
        return 2 * value

    @rpc_method("query")
    def execution_counts(self) -> dict[str, int]:
        return dict(self.executions)

    @rpc_method("query")
    def ping(self) -> str:
        return "pong"

    @rpc_method("query")
    def identity(self) -> dict[str, object]:
        return {"label": self.label, "pid": os.getpid(), "version": self.version}

    @rpc_method("control")
    def set_version(self, version: int) -> int:
        self.version = version
        return version

    @rpc_method("control")
    async def sleep(self, seconds: float) -> float:
        start = time.monotonic()
        await asyncio.sleep(seconds)
        return time.monotonic() - start

    @rpc_method("query")
    def fail(self, message: str) -> None:
        raise ValueError(message)

    @rpc_method("query")
    def blob(self, size: int) -> str:
        return "x" * size

    @rpc_method("control")
    async def hold_control(self, seconds: float) -> int:
        return await self._hold("control", seconds)

    @rpc_method("limited")
    def hold_limited(self, seconds: float) -> int:
        """A synchronous method: runs in the group's threads."""
        self._enter("limited")
        try:
            time.sleep(seconds)
        finally:
            self._leave("limited")
        return self.peaks["limited"]

    @rpc_method("query")
    async def hold_query(self, seconds: float) -> int:
        return await self._hold("query", seconds)

    @rpc_method("query")
    def concurrency_peaks(self) -> dict[str, int]:
        return dict(self.peaks)

    async def _hold(self, group: str, seconds: float) -> int:
        self._enter(group)
        try:
            await asyncio.sleep(seconds)
        finally:
            self._leave(group)
        return self.peaks[group]

    def _enter(self, group: str) -> None:
        with self._lock:
            self._running[group] += 1
            self.peaks[group] = max(self.peaks[group], self._running[group])

    def _leave(self, group: str) -> None:
        with self._lock:
            self._running[group] -= 1
