"""The health monitor: checks every running cell periodically and restores the ones that failed.

A failed cell is stopped, restarted from its specs, then handed to the recovery callbacks, which re-register it
wherever it was registered (the router, the dashboard) and bring it to the current weight version, while the run
goes on. Checks pause around weight updates (:meth:`HealthMonitor.paused`).

A cell whose process exited, or whose URL no longer answers HTTP, is restarted at the first check that sees it; one
whose process lives but does not answer its health URL is restarted after ``failures_to_restart`` such checks in a
row, since a busy server can miss one (SGLang answers ``/health_generate`` with 503 when its scheduler produced
nothing for 20 s). The owner of a generation pause checks with ``liveness_only``: a paused SGLang server produces
nothing, so its health URL cannot say it is well.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

from miles_core.progress import notice
from miles_core.workers.cells import Cell, CellManager, CellState

logger = logging.getLogger(__name__)

RecoveryCallback = Callable[[Cell], Awaitable[None]]


class HealthMonitor:
    """Checks cells every ``interval_s``; restarts a cell whose process exited, or whose health URL failed
    ``failures_to_restart`` checks in a row."""

    def __init__(
        self,
        cells: CellManager,
        *,
        interval_s: float = 5.0,
        timeout_s: float = 5.0,
        failures_to_restart: int = 2,
        on_recovered: list[RecoveryCallback] | None = None,
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0 or failures_to_restart < 1:
            raise ValueError("interval_s and timeout_s must be positive and failures_to_restart at least 1")
        self.cells = cells
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failures_to_restart = failures_to_restart
        self.on_recovered = list(on_recovered or [])
        self.failures: dict[str, int] = {}
        self.events: list[tuple[float, str, str]] = []  # (time, cell id, what happened)
        self._pause_depth = 0
        self._round = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._http: httpx.AsyncClient | None = None  # one client for every check: making one costs milliseconds
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop ``_http`` belongs to

    # -- control --------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Run checks in the background of the current event loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="health-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """No checks run inside this block (a round in progress is waited for first)."""
        self._pause_depth += 1
        try:
            async with self._round:
                pass
            yield
        finally:
            self._pause_depth -= 1

    @property
    def is_paused(self) -> bool:
        return self._pause_depth > 0

    # -- checking -------------------------------------------------------------------------------------------

    async def check_once(self, *, ignore_pause: bool = False, liveness_only: bool = False) -> list[str]:
        """One round over the running and failed cells; returns the ids of the cells it restored.

        ``ignore_pause`` is for the owner of the pause itself (a weight update that must restore an engine);
        ``liveness_only`` restores only cells whose processes exited, without asking any health URL (for engines
        whose generation the caller holds paused)."""
        if self.is_paused and not ignore_pause:
            return []
        async with self._round:
            restored = []
            for cell in list(self.cells.cells.values()):
                if self.is_paused and not ignore_pause:
                    break
                if await self._needs_recovery(cell, liveness_only=liveness_only) and await self._recover(cell):
                    restored.append(cell.cell_id)
            return restored

    async def is_healthy(self, cell: Cell) -> bool:
        """Every worker of the cell is alive and answers its health URL with 200."""
        return await self.is_alive(cell) and await self.answers_health(cell)

    async def is_alive(self, cell: Cell) -> bool:
        """The cell has workers, every one of their processes is alive and every worker URL answers HTTP at all (any
        status): a process being killed can still hold its port for a moment, accepting connections it never
        answers, after its clients already saw theirs drop."""
        alive = [await self.cells.provider.is_alive(worker.name) for worker in cell.workers]
        if not (alive and all(alive)):
            return False
        urls = [worker.url for worker in cell.workers if worker.url]
        client = self._client()
        return all(await asyncio.gather(*(_answers_http(client, url) for url in urls)))

    async def answers_health(self, cell: Cell) -> bool:
        """Every worker with a health URL answers it with 200 within ``timeout_s``."""
        headers = {"Authorization": f"Bearer {self.cells.provider.token}"}
        client = self._client()
        for url in (worker.health_url for worker in cell.workers if worker.health_url is not None):
            try:
                if (await client.get(url, headers=headers)).status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
        return True

    def _client(self) -> httpx.AsyncClient:
        """The monitor's HTTP client (made on first use, in the event loop the checks run in; closed by
        :meth:`stop`). A client of another event loop, closed with it, is replaced."""
        if self._http is None or self._http.is_closed or self._loop is not asyncio.get_running_loop():
            self._http = httpx.AsyncClient(timeout=self.timeout_s)
            self._loop = asyncio.get_running_loop()
        return self._http

    async def _needs_recovery(self, cell: Cell, *, liveness_only: bool) -> bool:
        if cell.state == CellState.FAILED:
            return True
        if cell.state != CellState.RUNNING:
            return False
        if not await self.is_alive(cell):
            self._event(cell.cell_id, "a process exited or its URL stopped answering")
            return True
        if liveness_only:
            return False
        if await self.answers_health(cell):
            self.failures[cell.cell_id] = 0
            return False
        self.failures[cell.cell_id] = self.failures.get(cell.cell_id, 0) + 1
        self._event(cell.cell_id, f"health check failed ({self.failures[cell.cell_id]} in a row)")
        return self.failures[cell.cell_id] >= self.failures_to_restart

    async def _recover(self, cell: Cell) -> bool:
        why = next((what for _, cell_id, what in reversed(self.events) if cell_id == cell.cell_id), "it failed")
        self._event(cell.cell_id, "restarting")
        notice(f"{cell.cell_id} failed ({why}); restarting it")  # in the terminal too, not only on the dashboard
        started = time.monotonic()
        try:
            await self.cells.restart(cell.cell_id)
            for callback in self.on_recovered:
                await callback(cell)
        except Exception as exc:  # the run goes on; the next round tries again
            self._event(cell.cell_id, f"recovery failed: {type(exc).__name__}: {exc}")
            notice(f"{cell.cell_id} could not be restarted ({type(exc).__name__}: {exc}); trying again")
            return False
        self.failures[cell.cell_id] = 0
        self._event(cell.cell_id, "recovered")
        notice(f"{cell.cell_id} restarted in {time.monotonic() - started:.0f} s (restart {cell.restarts})")
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_once()
            except Exception:  # never let a monitoring bug end the run
                logger.exception("health check round failed")

    def _event(self, cell_id: str, what: str) -> None:
        self.events.append((time.time(), cell_id, what))
        logger.info("cell %s: %s", cell_id, what)


async def _answers_http(client: httpx.AsyncClient, url: str) -> bool:
    """``url`` answers a GET with any status (a 404 or a 401 still says a server is there)."""
    try:
        await client.get(url)
    except httpx.HTTPError:
        return False
    return True
