"""Cells: engines grouped under stable string ids ``"{server_id}-{index}"``, started, stopped and restarted by id."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import Callable
from typing import Any

from miles_core.workers.errors import WorkerError
from miles_core.workers.provider import BaseWorkerProvider, WorkerInfo
from miles_core.workers.specs import WorkerSpec


class CellState(enum.StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    RUNNING = "running"
    FAILED = "failed"


@dataclasses.dataclass
class Cell:
    """One engine (or any replicated worker): its id, its specs, its running workers and its state."""

    cell_id: str
    server_id: str
    index: int
    specs: list[WorkerSpec]
    state: CellState = CellState.STOPPED
    workers: list[WorkerInfo] = dataclasses.field(default_factory=list)
    restarts: int = 0
    last_error: str | None = None

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready description of the cell."""
        return {
            "cell_id": self.cell_id,
            "server_id": self.server_id,
            "index": self.index,
            "state": self.state.value,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "workers": [dataclasses.asdict(worker) for worker in self.workers],
        }


SpecFactory = Callable[[str], list[WorkerSpec]]
"""Builds the worker specs of a cell from its id (worker names must be unique, e.g. derived from the id)."""


class CellManager:
    """Owns the cells of a run and starts their workers through a provider."""

    def __init__(self, provider: BaseWorkerProvider) -> None:
        self.provider = provider
        self.cells: dict[str, Cell] = {}

    def add_server(self, server_id: str, *, count: int, specs: SpecFactory) -> list[Cell]:
        """Declare ``count`` cells ``{server_id}-0 ... {server_id}-{count-1}`` (not started)."""
        if count < 1:
            raise ValueError(f"a server needs at least one cell, got count={count}")
        created = []
        for index in range(count):
            cell_id = f"{server_id}-{index}"
            if cell_id in self.cells:
                raise WorkerError(f"cell {cell_id!r} already exists")
            created.append(Cell(cell_id=cell_id, server_id=server_id, index=index, specs=specs(cell_id)))
            self.cells[cell_id] = created[-1]
        return created

    def get(self, cell_id: str) -> Cell:
        if cell_id not in self.cells:
            raise WorkerError(f"no cell {cell_id!r}; cells: {sorted(self.cells)}")
        return self.cells[cell_id]

    async def start(self, cell_id: str) -> Cell:
        """Start every worker of the cell; on failure the started ones are stopped and the cell is FAILED."""
        cell = self.get(cell_id)
        cell.state = CellState.STARTING
        try:
            for spec in cell.specs:
                cell.workers.append(await self.provider.start(spec))
        except BaseException as exc:
            cell.last_error = f"{type(exc).__name__}: {exc}"
            await self._stop_workers(cell)
            cell.state = CellState.FAILED
            raise
        cell.state = CellState.RUNNING
        cell.last_error = None
        return cell

    async def stop(self, cell_id: str) -> Cell:
        cell = self.get(cell_id)
        await self._stop_workers(cell)
        cell.state = CellState.STOPPED
        return cell

    async def restart(self, cell_id: str) -> Cell:
        cell = await self.stop(cell_id)
        cell.restarts += 1
        return await self.start(cell_id)

    async def start_all(self) -> None:
        for cell_id in self.cells:
            if self.cells[cell_id].state != CellState.RUNNING:
                await self.start(cell_id)

    async def stop_all(self) -> None:
        """Stop every cell at once (a real SGLang server takes seconds to stop: a run with several engines should not
        pay them one after the other); every cell is stopped even when one fails, and the first failure is raised."""
        results = await asyncio.gather(*(self.stop(cell_id) for cell_id in list(self.cells)), return_exceptions=True)
        failures = [result for result in results if isinstance(result, BaseException)]
        if failures:
            raise failures[0]

    def running(self) -> list[Cell]:
        return [cell for cell in self.cells.values() if cell.state == CellState.RUNNING]

    def topology(self) -> dict[str, Any]:
        """Every cell with its workers, addresses and state."""
        return {"cells": [cell.snapshot() for cell in self.cells.values()]}

    async def _stop_workers(self, cell: Cell) -> None:
        for spec in cell.specs:
            await self.provider.stop(spec.name)
        cell.workers.clear()
