"""Nothing silent: a wait longer than a few seconds says what it waits for and how long it has waited.

    with waiting_for("engine-0 to start", log=log_file):
        await provider.start(spec)

prints nothing when the wait is short; once it has lasted :data:`GRACE_S` seconds (``$MILES_WAIT_NOTICE_S``), a line
``miles: waiting for engine-0 to start (log: runs/latest/logs/engine-0.log) ... 5 s`` on stderr, again every
:data:`EVERY_S` seconds, and when it ends ``miles: engine-0 to start: done after 23 s`` (or ``failed after``).
A thread keeps the time, so a wait that blocks the event loop (``ray.init``, a compilation) is reported too.
Lines are written through tqdm, so a live progress bar is redrawn below them rather than broken. :func:`notice`
prints one such line at once (an engine restarting, a transfer retried).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

GRACE_S = 5.0
"""A wait shorter than this prints nothing."""
EVERY_S = 10.0
"""How often a long wait says it is still waiting."""
GRACE_ENV = "MILES_WAIT_NOTICE_S"
"""Seconds before a wait is reported (default :data:`GRACE_S`); ``inf`` reports none."""


def notice(message: str) -> None:
    """One ``miles: MESSAGE`` line on stderr, at once (above a live progress bar)."""
    from tqdm import tqdm  # deferred: the config imports this module, and `miles --help` stays quick

    tqdm.write(f"miles: {message}", file=sys.stderr)
    sys.stderr.flush()


def grace_s() -> float:
    """:data:`GRACE_S`, or the number of seconds in ``$MILES_WAIT_NOTICE_S`` (a value that is not one is ignored)."""
    try:
        value = float(os.environ.get(GRACE_ENV, GRACE_S))
    except ValueError:
        return GRACE_S
    return value if value >= 0 and not math.isnan(value) else GRACE_S


class waiting_for:
    """Report the wait for ``what`` (and its ``log``) on stderr once it lasts ``grace`` seconds, then every
    ``every_s`` seconds, and how long it took when it ends; a short wait prints nothing."""

    def __init__(
        self, what: str, *, log: str | Path | None = None, grace: float | None = None, every_s: float = EVERY_S
    ) -> None:
        self.what = what
        self.log = log
        self.grace = grace_s() if grace is None else grace
        self.every_s = every_s
        self.reported = 0  # lines printed while waiting
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0

    def __enter__(self) -> waiting_for:
        self._started = time.monotonic()
        if math.isfinite(self.grace):
            self._thread = threading.Thread(target=self._report, name=f"waiting for {self.what}", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        if self.reported:
            outcome = "done" if kind is None else "failed" if issubclass(kind, Exception) else "stopped"
            notice(f"{self.what}: {outcome} after {self.elapsed():.0f} s")

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def _report(self) -> None:
        where = f" (log: {self.log})" if self.log else ""
        due = self.grace
        while not self._done.wait(timeout=max(0.0, due - self.elapsed())):
            notice(f"waiting for {self.what}{where} ... {self.elapsed():.0f} s")
            self.reported += 1
            due += self.every_s
