"""Errors of the worker runtime; each names the worker, and the method and call id where there is one."""

from __future__ import annotations

from miles_core.errors import MilesError


class WorkerError(MilesError):
    """Base class of worker-runtime errors."""


class RpcRequestError(WorkerError):
    """The worker refused a call (bad arguments, unknown method, bad token, ...): a 4xx answer."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class RemoteError(WorkerError):
    """The remote method raised; carries the remote exception's type, message and traceback text."""

    def __init__(self, *, worker: str, method: str, error_type: str, message: str, traceback: str) -> None:
        super().__init__(f"{worker}.{method} raised {error_type}: {message}\n--- remote traceback ---\n{traceback}")
        self.worker = worker
        self.method = method
        self.error_type = error_type
        self.remote_message = message
        self.remote_traceback = traceback


class _OutcomeUnknownError(WorkerError):
    """A call that ended without an answer; ``may_have_run`` says whether the worker may have started it (False
    only when no submit of it can have reached the worker, so calling again cannot run it twice)."""

    def __init__(self, message: str, *, may_have_run: bool) -> None:
        super().__init__(message)
        self.may_have_run = may_have_run


class WorkerDiedError(_OutcomeUnknownError):
    """The worker process is gone."""


class CallLostError(WorkerError):
    """The worker no longer knows a call that was accepted or may have run (it restarted, or the result expired or
    was evicted): the call's outcome is unknown."""


class RpcProtocolError(_OutcomeUnknownError):
    """The worker answered with something that is not a call record (another program on its port, or a worker of
    another version): the message names the field that does not fit."""


class RpcDeadlineError(_OutcomeUnknownError):
    """A call did not finish before its deadline."""


class WorkerStartError(WorkerError):
    """A worker did not start or never became healthy; the message carries the tail of its log."""


class PortTakenError(WorkerStartError):
    """A starting worker's bind found its port taken by another process; the provider starts it again on other
    ports."""
