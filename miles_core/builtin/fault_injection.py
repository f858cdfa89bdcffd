"""The built-in plugin ``faults``: fires the run's planned faults (``--fault-injection``, parsed by
:mod:`miles_core.fault_injection`) at their moments, through the run's worker provider."""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING, Any

from miles_core.fault_injection import PlannedFault
from miles_core.hookspecs import hookimpl
from miles_core.progress import notice

if TYPE_CHECKING:
    from miles_core.config.build import MilesConfig


class FaultInjectionPlugin:
    """Fires the run's planned faults (``run.fault_injection``) once each, at their moments."""

    def __init__(self) -> None:
        self.pending: list[PlannedFault] = []
        self.fired: list[PlannedFault] = []
        self._controller: Any = None
        self._kills: set[asyncio.Task] = set()

    @hookimpl
    def on_run_start(self, config: MilesConfig, run_dir: Any, start_step: int) -> None:
        self.pending = [PlannedFault.parse(entry) for entry in config.run.fault_injection]
        self.fired = []

    @hookimpl
    def prepare_rollout(self, rollout_id: int, controller: Any) -> None:
        self._controller = controller  # the weight update's hook has none: it comes from here
        self._fire("step", rollout_id + 1)

    @hookimpl
    def before_weight_update(self, version: int, protocol: Any) -> None:
        self._fire("weight_update", version)

    def _fire(self, moment: str, number: int) -> None:
        due = [fault for fault in self.pending if (fault.moment, fault.number) == (moment, number)]
        for fault in due:
            self.pending.remove(fault)
            self.fired.append(fault)
            notice(f"fault injection: killing {fault.target} {fault.when()} (--fault-injection {fault})")
            # the hooks run in the event loop; the provider's kill is a coroutine, run as soon as the hook returns
            kill = asyncio.get_running_loop().create_task(self._controller.provider.kill(fault.target, signal.SIGKILL))
            self._kills.add(kill)
            kill.add_done_callback(self._kills.discard)
