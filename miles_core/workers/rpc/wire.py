"""What travels between an RPC client and a worker's RPC server (JSON over HTTP, nothing pickled).

``POST /rpc/submit``  ``{"call_id", "method", "args": [...], "kwargs": {...}, "wait_s": 0}`` -> a call record
``GET  /rpc/poll?call_id=ID&wait_s=S``                                                   -> a call record
``GET  /rpc/health``                                                                     -> ``{"ok": true, "pid"}``

A submit has only these fields (``args``, ``kwargs`` and ``wait_s`` may be left out); ``wait_s`` is a number of
seconds >= 0 (at most :data:`MAX_WAIT_S` are used), in a poll written as a plain decimal such as ``2.5``. Bodies
are strict JSON (no NaN or infinity, bounded integers and nesting: :mod:`miles_core.http`).

A call record is ``{"call_id", "state": "running" | "done" | "failed"}`` plus ``"result"`` (done) or ``"error":
{"type", "message", "traceback"}`` (failed). Every route needs ``Authorization: Bearer <run token>``.
Errors are ``{"error": message}`` with a 4xx status: 400 a malformed request (nothing ran), 401 a missing or wrong
token, 404 an unknown method or call id, 409 a call id resubmitted with other arguments, 410 a call id whose call
already ran and whose result expired or was evicted, 413 a body over the limit. 503 means the worker is overloaded
(every slot holds a running call): the call was not accepted, so it is safe to send again.
"""

from __future__ import annotations

SUBMIT_PATH = "/rpc/submit"
POLL_PATH = "/rpc/poll"
HEALTH_PATH = "/rpc/health"

TOKEN_ENV = "MILES_RUN_TOKEN"
"""Environment variable that hands the run's token to worker processes (never put on a command line)."""

RUNNING, DONE, FAILED = "running", "done", "failed"

MAX_WAIT_S = 60.0
"""The longest a single submit or poll request is held open by the server (a larger ``wait_s`` waits this long)."""

GONE = 410
"""The status of a call id that already ran and whose result the server no longer holds."""
