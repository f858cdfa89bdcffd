"""Fault injection for tests: kill a chosen worker at a chosen moment of the run."""

from __future__ import annotations

import dataclasses
import signal

from miles_core.workers.errors import WorkerError
from miles_core.workers.provider import BaseWorkerProvider


@dataclasses.dataclass(frozen=True)
class Fault:
    """Kill ``worker`` with ``sig`` when the event ``at`` happens (for example ``"rollout:3"``)."""

    worker: str
    at: str
    sig: int = signal.SIGKILL

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``"WORKER@EVENT"``, e.g. ``"engine-0@rollout:3"``."""
        worker, sep, at = text.partition("@")
        if not sep or not worker or not at:
            raise WorkerError(f"a fault is WORKER@EVENT (like engine-0@rollout:3), got {text!r}")
        return cls(worker=worker, at=at)


class FaultInjector:
    """Fires each planned fault once, when :meth:`on_event` sees its moment."""

    def __init__(self, provider: BaseWorkerProvider, plan: list[Fault]) -> None:
        self.provider = provider
        self.pending = list(plan)
        self.fired: list[Fault] = []

    async def on_event(self, event: str) -> list[Fault]:
        """Fire the faults planned for ``event``; returns them."""
        due = [fault for fault in self.pending if fault.at == event]
        for fault in due:
            if fault.worker not in self.provider.workers:
                raise WorkerError(
                    f"fault {fault}: no running worker {fault.worker!r}; workers: {sorted(self.provider.workers)}"
                )
            await self.provider.kill(fault.worker, fault.sig)
            self.pending.remove(fault)
            self.fired.append(fault)
        return due
