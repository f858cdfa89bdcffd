"""SIGTERM and SIGHUP stop ``miles train`` as Ctrl-C does: what ``timeout``, systemd, Slurm and Kubernetes send, and
what a closed terminal sends, get the same clean stop (the workers stopped, where the run is and how to resume it
printed) and the exit status 128 + the signal's number. A second signal ends the process at once; the watchdog beside
each worker (:mod:`miles_core.workers.watchdog`) then stops the workers."""

from __future__ import annotations

import os
import signal
from types import FrameType, TracebackType

from miles_core.cli.exit_codes import INTERRUPTED

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""The signals handled as SIGINT is."""


class StopSignals:
    """While entered, :data:`STOP_SIGNALS` raise ``KeyboardInterrupt`` as SIGINT does (through SIGINT's handler of the
    moment: inside ``asyncio.run``, asyncio's, which cancels the main task so that its ``finally`` blocks run)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._saved: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        if len(self.received) > 1:
            os._exit(128 + signum)  # the second signal: at once (the workers' watchdogs stop them)
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            handler(signal.SIGINT, frame)
        else:  # SIGINT ignored (a background job): asyncio installed no handler of its own either
            raise KeyboardInterrupt

    @property
    def name(self) -> str:
        """How the stop reads in the message: ``interrupted`` (Ctrl-C) or ``stopped by SIGTERM``."""
        return f"stopped by {signal.Signals(self.received[0]).name}" if self.received else "interrupted"

    @property
    def exit_status(self) -> int:
        """128 + the number of the signal that stopped the run (130 for Ctrl-C)."""
        return 128 + self.received[0] if self.received else INTERRUPTED
