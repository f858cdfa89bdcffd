"""What travels between an RPC client and a worker's RPC server (JSON over HTTP, nothing pickled), as the pydantic
models that both ends use: the client builds a :class:`SubmitRequest` and :class:`PollRequest` and parses every
answer as a :class:`CallRecord` (or an :class:`ErrorBody`); the server validates requests with the same models and
writes its records and errors with them.

``POST /rpc/submit``  :class:`SubmitRequest` ``{"call_id", "method", "args": [...], "kwargs": {...}, "wait_s": 0}``
``GET  /rpc/poll?call_id=ID&wait_s=S``  :class:`PollRequest`, as a query string
``POST /rpc/cancel``  :class:`CancelRequest` ``{"call_id"}``
``GET  /rpc/health``  ``{"ok": true, "name", "pid", "calls"}``

Every request answers a :class:`CallRecord`. A submit has only these fields (``args``, ``kwargs``, ``wait_s`` and
``deadline_s`` may be left out); ``wait_s`` is a number of seconds >= 0 (at most :data:`MAX_WAIT_S` are used), in a
poll written as a plain decimal such as ``2.5``. ``deadline_s`` is the caller's deadline, in seconds from the submit
(relative: the two ends' clocks need not agree): when it passes the worker cancels the call, so a call nobody waits
for any more cannot hold its concurrency group. A cancel (the deadline's, or ``/rpc/cancel``'s) ends the call as
failed with the error type :data:`CANCELLED`; a call that had already finished keeps its record.
Request bodies are strict JSON (no NaN or infinity, bounded integers and nesting:
:mod:`miles_core.http`); the models are strict too (``true`` is not a number, ``"5"`` is not one either).

A call record is ``{"call_id", "state": "running" | "done" | "failed"}`` plus ``"result"`` (done) or ``"error":
{"type", "message", "traceback"}`` (failed). Every route needs ``Authorization: Bearer <run token>``.
Errors are :class:`ErrorBody` ``{"error": message}`` with a 4xx status: 400 a malformed request (nothing ran), 401 a
missing or wrong token, 404 an unknown method or call id, 409 a call id resubmitted with other arguments, 410 a call
id whose call already ran and whose result expired or was evicted, 413 a body over the limit. 503 means the worker
is overloaded (every slot holds a running call): the call was not accepted, so it is safe to send again.

A body that does not fit its model is a :class:`WireError` whose message names each field, the value (cut short)
and what the field allows, in the words of the field's ``description``.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import pydantic
from pydantic import AfterValidator, ConfigDict, Field

from miles_core.workers.rpc.arguments import short_repr

SUBMIT_PATH = "/rpc/submit"
POLL_PATH = "/rpc/poll"
HEALTH_PATH = "/rpc/health"
CANCEL_PATH = "/rpc/cancel"

TOKEN_ENV = "MILES_RUN_TOKEN"
"""Environment variable that hands the run's token to worker processes (never put on a command line)."""


def new_run_token() -> str:
    """A fresh run token: 192 random bits as hex. Servers take it as a flag value (``--admin-api-key TOKEN``), so it
    must never begin with ``-`` (a URL-safe base64 token does one time in 64, and argparse then reads it as a flag)."""
    return secrets.token_hex(24)


RUNNING, DONE, FAILED = "running", "done", "failed"

CANCELLED = "CallCancelled"
"""The error type of a cancelled call's record: its caller's deadline passed, or a cancel request came."""

MAX_WAIT_S = 60.0
"""The longest a single submit or poll request is held open by the server (a larger ``wait_s`` waits this long)."""

MAX_CALL_ID_CHARS = 128

GONE = 410
"""The status of a call id that already ran and whose result the server no longer holds."""


class WireError(ValueError):
    """A body that is not what its wire model allows; the message names the fields, values and allowed values."""


class _WireModel(pydantic.BaseModel):
    """A frozen, strict wire model: no coercion between types, no field the protocol does not have."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    WIRE_NAME: ClassVar[str]
    """What the model is called in error messages ("submit", "call record")."""


def _capped(seconds: float) -> float:
    return min(seconds, MAX_WAIT_S)


CallId = Annotated[
    str,
    Field(min_length=1, max_length=MAX_CALL_ID_CHARS, description=f"a string of 1 to {MAX_CALL_ID_CHARS} characters"),
]
WaitSeconds = Annotated[
    float,
    Field(ge=0, allow_inf_nan=False, description=f"a number of seconds >= 0 (at most {MAX_WAIT_S:g} are used)"),
    AfterValidator(_capped),  # a longer wait is not an error: it is held as long as the server holds any
]


class SubmitRequest(_WireModel):
    """``POST /rpc/submit``: run ``method(*args, **kwargs)`` once under ``call_id``, holding the answer up to
    ``wait_s`` seconds for the call to finish (the arguments are checked against the method by the server)."""

    WIRE_NAME: ClassVar[str] = "submit"

    call_id: CallId
    method: Annotated[str, Field(min_length=1, description="the name of a method (a non-empty string)")]
    args: Annotated[list[Any], Field(description="a JSON list of positional arguments")] = []
    kwargs: Annotated[dict[str, Any], Field(description="a JSON object of keyword arguments")] = {}
    wait_s: WaitSeconds = 0.0
    deadline_s: Annotated[
        float | None,
        Field(
            gt=0,
            allow_inf_nan=False,
            description="the caller's deadline: a number of seconds > 0 from the submit, or null for none",
        ),
    ] = None


class CancelRequest(_WireModel):
    """``POST /rpc/cancel``: cancel call ``call_id`` if it is still running; answered with its record."""

    WIRE_NAME: ClassVar[str] = "cancel"

    call_id: CallId


class PollRequest(_WireModel):
    """``GET /rpc/poll``: the record of call ``call_id``, once it finished or ``wait_s`` seconds passed."""

    WIRE_NAME: ClassVar[str] = "poll"

    call_id: CallId
    wait_s: WaitSeconds = 0.0


class CallFailure(_WireModel):
    """How a failed call failed: the exception's qualified type name, its message and the remote traceback."""

    WIRE_NAME: ClassVar[str] = "call error"

    type: Annotated[str, Field(description="the exception's qualified type name (a string)")]
    message: Annotated[str, Field(description="the exception's message (a string)")]
    traceback: Annotated[str, Field(description="the remote traceback (a string)")]


_ABSENT = {RUNNING: {"result", "error"}, DONE: {"error"}, FAILED: {"result"}}
"""The fields a record of each state leaves out of its JSON."""


class CallRecord(_WireModel):
    """The answer to a submit or poll: a call's state, and its result (done) or error (failed)."""

    # NaN and infinity in a result travel as JSON's NaN/Infinity constants (both ends' parsers read them), as
    # pydantic_core.to_json writes them: a NaN loss must not arrive as null.
    model_config = ConfigDict(ser_json_inf_nan="constants")
    WIRE_NAME: ClassVar[str] = "call record"

    call_id: CallId
    state: Annotated[Literal["running", "done", "failed"], Field(description="'running', 'done' or 'failed'")]
    result: Annotated[Any, Field(description="the method's JSON result (done records only)")] = None
    error: Annotated[
        CallFailure | None, Field(description="an object {type, message, traceback} (failed records only)")
    ] = None

    @pydantic.model_validator(mode="after")
    def _fits_state(self) -> CallRecord:
        if self.state == FAILED and self.error is None:
            raise ValueError("a failed call record needs an error {type, message, traceback}")
        if self.state != FAILED and self.error is not None:
            raise ValueError(f"a {self.state} call record has no error")
        if self.state != DONE and self.result is not None:
            raise ValueError(f"a {self.state} call record has no result")
        return self

    def to_json(self) -> bytes:
        """The record as it travels: only the fields its state has (a done record always has ``result``)."""
        return self.__pydantic_serializer__.to_json(self, exclude=_ABSENT[self.state])


class ErrorBody(_WireModel):
    """The body of every refusal (a 4xx or 503 status)."""

    WIRE_NAME: ClassVar[str] = "error body"

    error: Annotated[str, Field(description="a message (a string)")]

    @classmethod
    def of(cls, message: str) -> ErrorBody:
        """An error body for ``message``, which may repeat hostile input (see :func:`wire_text`)."""
        return cls(error=wire_text(message))

    def to_json(self) -> bytes:
        return self.__pydantic_serializer__.to_json(self)


def wire_text(text: str) -> str:
    """``text`` as UTF-8 JSON can carry it: a lone surrogate (from hostile input, or an exception repeating it) is
    written as its escape ``\\udXXXX`` instead of making the record or error impossible to encode."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


Model = TypeVar("Model", bound=_WireModel)


def validate(model: type[Model], data: Any) -> Model:
    """``data`` (parsed JSON) as ``model``; a misfit is a :class:`WireError` naming each field."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise WireError(explain(model, exc)) from None


def validate_json(model: type[Model], raw: bytes | str) -> Model:
    """The JSON text ``raw`` as ``model``; invalid JSON or a misfit is a :class:`WireError`."""
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        raise WireError(explain(model, exc)) from None


def explain(model: type[_WireModel], exc: pydantic.ValidationError) -> str:
    """A validation error as a reader wants it: ``unknown submit fields ['x']; a submit has [...]`` and, once per
    field, ``call_id must be a string of 1 to 128 characters, got 17 (Input should be a valid string)``."""
    unknown: list[str] = []
    problems: dict[str, str] = {}  # the first problem of each field, in the order pydantic found them
    for error in exc.errors(include_url=False):
        loc = error["loc"]
        if error["type"] == "extra_forbidden" and len(loc) == 1:
            unknown.append(str(loc[0]))
        elif not loc or loc[0] not in model.model_fields:  # the whole body: not JSON, not an object, a cross-field rule
            problems.setdefault("", f"{model.WIRE_NAME}: {error['msg']}")
        else:
            problems.setdefault(str(loc[0]), _field_problem(model, loc, error))
    name = model.WIRE_NAME
    first = [f"unknown {name} fields {sorted(unknown)}; a {name} has {list(model.model_fields)}"] if unknown else []
    return "; ".join(first + list(problems.values()))


def _field_problem(model: type[_WireModel], loc: tuple, error: Any) -> str:
    field = str(loc[0])
    missing = error["type"] == "missing" and len(loc) == 1
    got = "None" if missing else short_repr(error["input"])
    detail = "the field is missing" if missing else f"{_path(loc)}: {error['msg']}" if len(loc) > 1 else error["msg"]
    return f"{field} must be {model.model_fields[field].description}, got {got} ({detail})"


def _path(loc: tuple) -> str:
    """``error.type``, ``args[2]``, ``kwargs['a b']``: where in a body a problem is."""
    parts = [str(loc[0])]
    for part in loc[1:]:
        is_name = isinstance(part, str) and part.isidentifier()
        parts.append(f".{part}" if is_name else f"[{part}]" if isinstance(part, int) else f"[{short_repr(part)}]")
    return "".join(parts)
