"""The descriptions the run hooks pass to plugins, as types: :class:`TrainerInfo` (``register_trainer``),
:class:`EngineInfo` (``register_engines``) and :class:`RouterInfo` (``register_router``). Each is a frozen dataclass
with :meth:`to_dict` for a JSON form (the dashboard stores that)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class TrainerInfo:
    """The run's trainer: its backend (``--trainer``), the model implementation it trains, its ranks in order."""

    backend: str
    implementation: str
    ranks: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "implementation": self.implementation, "ranks": list(self.ranks)}


@dataclasses.dataclass(frozen=True)
class EngineWorker:
    """One worker of an engine cell: its name, URL (``http://host:port``), pid and node."""

    name: str
    url: str | None
    pid: int | None
    node: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """One engine cell: ``cell_id`` (``engine-0``), its state (``running``, ``failed``, ...), restarts, last error,
    workers and the weight version the controller last published to it."""

    cell_id: str
    server_id: str
    index: int
    state: str
    restarts: int
    last_error: str | None
    workers: tuple[EngineWorker, ...]
    weight_version: int

    @property
    def urls(self) -> list[str]:
        """The workers' URLs (a router routes to these while the cell runs)."""
        return [worker.url for worker in self.workers if worker.url]

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "workers": [worker.to_dict() for worker in self.workers]}


@dataclasses.dataclass(frozen=True)
class RouterInfo:
    """A router in front of the engines: its worker name, URL and pid, and the key its control routes (worker
    registration) take (never recorded: :meth:`to_dict` leaves it out)."""

    name: str
    url: str
    pid: int | None
    admin_key: str = dataclasses.field(default="", repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "pid": self.pid}
