"""``miles dashboard RUN_DIR``: serve the dashboard of a run (finished, or still running in another process)."""

from __future__ import annotations

import signal
import sys

from miles_core.builtin.dashboard.hosts import DashboardHostError, check_host
from miles_core.builtin.dashboard.server import DashboardServer
from miles_core.builtin.dashboard.store import check_run_dir
from miles_core.errors import MilesError


def serve_dashboard(run_dir: str, *, host: str, port: int) -> int:
    """Check the host (an empty one would bind every interface), the run directory and its database (a clear
    :class:`MilesError` otherwise), then serve until interrupted."""
    try:
        check_host(host)
    except DashboardHostError as exc:
        raise MilesError(f"--host: {exc}") from None
    check_run_dir(run_dir)
    try:
        server = DashboardServer(run_dir, host=host, port=port)
    except OSError as exc:
        raise MilesError(
            f"cannot serve the dashboard on {host}:{port}: {exc.strerror or exc} "
            "(choose another --port, or --port 0 for a free one)"
        ) from None
    _stop_on_signals()
    print(f"miles: dashboard of {run_dir} at {server.url} (Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("miles: dashboard stopped", file=sys.stderr)
    return 0


def _stop_on_signals() -> None:
    """Stop serving on SIGINT and SIGTERM. A process started as a background job of a script inherits SIGINT
    ignored, and Python then installs no handler of its own: without this, ``kill -INT`` would not stop it."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupt)
