"""The exit statuses of the ``miles`` command, in one module that every command imports."""

from __future__ import annotations

OK = 0
"""The command did what it was asked."""
FAILED = 1
"""The command failed after it started (a closed output pipe, a failed run)."""
USAGE_ERROR = 2
"""The command was not started: a bad flag, config value or plugin, reported in one line."""
INTERRUPTED = 130
"""The exit status after Ctrl-C (128 + SIGINT), as shells report it; SIGTERM and SIGHUP stop ``miles train`` the same
way with 128 + their number (143, 129: :mod:`miles_core.cli.stop_signals`)."""
