"""What travels between an RPC client and a worker's RPC server (JSON over HTTP, nothing pickled).

``POST /rpc/submit``  ``{"call_id", "method", "args": [...], "kwargs": {...}, "wait_s": 0}`` -> a call record
``GET  /rpc/poll?call_id=ID&wait_s=S``                                                   -> a call record
``GET  /rpc/health``                                                                     -> ``{"ok": true, "pid"}``

A call record is ``{"call_id", "state": "running" | "done" | "failed"}`` plus ``"result"`` (done) or ``"error":
{"type", "message", "traceback"}`` (failed). Every route needs ``Authorization: Bearer <run token>``.
Errors are ``{"error": message}`` with a 4xx status (5xx only for an overloaded server).
"""

from __future__ import annotations

SUBMIT_PATH = "/rpc/submit"
POLL_PATH = "/rpc/poll"
HEALTH_PATH = "/rpc/health"

TOKEN_ENV = "MILES_RUN_TOKEN"
"""Environment variable that hands the run's token to worker processes (never put on a command line)."""

RUNNING, DONE, FAILED = "running", "done", "failed"

MAX_WAIT_S = 60.0
"""The longest a single submit or poll request is held open by the server."""
