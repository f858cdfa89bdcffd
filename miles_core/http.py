"""The one HTTP toolkit every server of the project uses: errors, bounded bodies, strict JSON, the bearer check.

Every server of Miles (the local engine, the worker RPC, the dashboard, the session server) reads requests from
possibly hostile local users. The rules live here once, so a fix reaches every server:

- :class:`HttpError` carries a 4xx status and a message; servers answer it as ``{"error": message}``.
- :func:`read_body` limits the body *stream*, not only its ``Content-Length``: a chunked body is cut off at the
  limit instead of being read whole.
- :func:`parse_json` accepts strict JSON only: no ``NaN``/``Infinity`` (nor ``1e400``, which overflows to
  infinity), integers of at most
  :data:`MAX_INT_DIGITS` digits, nesting at most :data:`MAX_JSON_DEPTH` deep, each key once in an object
  (which of two would count is ambiguous). Anything else is a 400. Files that users name are parsed by it too
  (:mod:`miles_core.user_files`).
- :func:`bearer_token_matches` is the one ``Authorization: Bearer <token>`` check: the scheme is
  case-insensitive (RFC 9110 §11.1), the token is required, and it is compared in constant time.
- An :class:`HttpError` message is at most :data:`MAX_MESSAGE_CHARS` characters, control characters escaped: an
  error never echoes a whole hostile request back, nor writes raw control bytes into a client's terminal or log.
- :class:`BoundedHttpProtocol` is the uvicorn protocol of every server: a request head of at most
  :data:`MAX_HEAD_BYTES` (a larger one is a 431), sent within :data:`HEAD_TIMEOUT_S`, and a body that keeps
  arriving (:data:`BODY_GRACE_S` plus :data:`MIN_BODY_BYTES_PER_S`; a stalled one is a 408). uvicorn bounds
  neither, so a client that sends half a request would hold its connection (and the handler awaiting the body)
  forever.
"""

from __future__ import annotations

import functools
import hmac
import json
import math
import re
import socket
import threading
import time
from typing import Any, Protocol

import uvicorn
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from miles_core.workers.node import url_host

MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects a request may have (Miles' own requests use at most 4)."""

MAX_INT_DIGITS = 64
"""The longest integer literal a request may hold (token ids, sizes and seeds need at most 20 digits)."""


LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "[::1]"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})

MAX_MESSAGE_CHARS = 2000
"""The longest error message a server answers (longer ones are cut, saying how long they were)."""

MAX_HEAD_BYTES = 64 << 10
"""The largest request head (request line and headers) a server reads; Miles' own clients send well under 1 KiB."""

HEAD_TIMEOUT_S = 10.0
"""How long a client may take to send a request head, from connecting (or from its previous request)."""

BODY_GRACE_S = 10.0
"""How long a request body may take before it must keep pace with :data:`MIN_BODY_BYTES_PER_S`."""

MIN_BODY_BYTES_PER_S = 256 << 10
"""The slowest a body may arrive on average after :data:`BODY_GRACE_S` (1 GiB of weights: about 70 min)."""


LINGER_S = 2.0
"""How long a refused connection's further input is read and dropped before it closes (so the answer arrives)."""


class HttpError(Exception):
    """A request the server refuses, with the HTTP status to answer (4xx) and a message saying what to do (made
    safe by :func:`safe_message`)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(safe_message(message))
        self.status = status


async def json_error(request: Request, exc: Exception) -> JSONResponse:
    """A Starlette exception handler: an unknown route (404) or method (405) answered as ``{"error": ...}`` like
    every other refusal, naming the route and the methods it takes."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else {}
    if status == 405:
        allowed = ", ".join(sorted(m.strip() for m in (_header(headers, "allow") or "").split(",")))  # a set's order
        message = f"{request.method[:20]} is not a method of {request.url.path[:200]!r}: use {allowed}"
    elif status == 404:
        message = f"no route {request.url.path[:200]!r}"
    else:
        message = str(exc.detail) if isinstance(exc, HTTPException) else "internal error"
    return JSONResponse({"error": safe_message(message)}, status_code=status, headers=headers)


def _header(headers: dict[str, str], name: str) -> str | None:
    return next((value for key, value in headers.items() if key.lower() == name), None)


JSON_ERRORS = {404: json_error, 405: json_error}
"""``Starlette(exception_handlers=JSON_ERRORS)``: routing's refusals in the servers' answer shape."""


def safe_message(message: str) -> str:
    """``message`` as an error answer may repeat it: control characters (but for newlines and tabs) escaped, at
    most :data:`MAX_MESSAGE_CHARS` characters."""
    cleaned = _CONTROL.sub(lambda match: match.group().encode("unicode_escape").decode("ascii"), str(message))
    if len(cleaned) <= MAX_MESSAGE_CHARS:
        return cleaned
    return f"{cleaned[:MAX_MESSAGE_CHARS]}... (cut: {len(cleaned)} characters)"


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


class StreamingRequest(Protocol):
    """What :func:`read_body` needs of a request: its headers and its body as a stream (Starlette's ``Request``)."""

    @property
    def headers(self) -> Any: ...

    def stream(self) -> Any: ...


async def read_body(request: StreamingRequest, *, limit: int) -> bytes:
    """Read a request body of at most ``limit`` bytes; a larger one (declared or streamed) is a 413."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isascii() or not declared.isdigit():
            raise HttpError(400, f"Content-Length must be a number of bytes, got {declared!r}")
        if int(declared) > limit:
            raise HttpError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HttpError(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # gone (or cut off by BoundedHttpProtocol's deadline): nobody reads the answer
        raise HttpError(400, "the client went away before sending the whole body") from None
    return b"".join(chunks)


def parse_json(
    raw: bytes | str, *, max_depth: int = MAX_JSON_DEPTH, subject: str = "request body", unique_keys: bool = True
) -> Any:
    """Parse strict JSON from a request; malformed, non-finite (also by overflow), huge-integer or too-deep input
    is a 400. ``subject`` names the input in messages (a file reader passes ``"prompts.jsonl:3"``);
    ``unique_keys`` (the default) refuses an object that gives a key twice (JSON would keep the last one silently)."""
    if _nested_deeper_than(raw, max_depth):
        raise HttpError(400, f"{subject} is nested deeper than {max_depth} levels")
    pairs_hook = functools.partial(_unique_object, subject=subject) if unique_keys else None
    try:
        return json.loads(
            raw,
            parse_constant=functools.partial(_refuse_constant, subject=subject),
            parse_int=functools.partial(_bounded_int, subject=subject),
            parse_float=functools.partial(_finite_float, subject=subject),
            object_pairs_hook=pairs_hook,
        )
    except HttpError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise HttpError(400, f"{subject} is not valid JSON: {exc}") from None


def parse_json_object(raw: bytes | str, *, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """:func:`parse_json` for a body that must be a JSON object (an empty body is ``{}``)."""
    if not raw.strip():
        return {}
    body = parse_json(raw, max_depth=max_depth)
    if not isinstance(body, dict):
        raise HttpError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def bearer_token_matches(authorization: str | None, expected: str) -> bool:
    """Whether an ``Authorization`` header presents ``expected`` as a bearer token (scheme case-insensitive)."""
    scheme, _, presented = (authorization or "").strip().partition(" ")
    presented = presented.strip()
    if scheme.lower() != "bearer" or not presented or not expected:
        return False
    return hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), expected.encode())


url_name = url_host
"""``host`` as a URL and a ``Host`` header write it (:func:`miles_core.workers.node.url_host`)."""


def allowed_host_names(host: str) -> frozenset[str]:
    """The names that a request's ``Host`` may give to a server bound to ``host``."""
    names = {*LOOPBACK_NAMES, url_name(host)}
    if host in WILDCARD_HOSTS:  # every interface: this machine's names and addresses
        import psutil  # deferred: only a server bound to every interface lists them

        names |= {url_name(socket.gethostname()), url_name(socket.getfqdn())}
        names |= {
            url_name(a.address.split("%")[0])
            for addresses in psutil.net_if_addrs().values()
            for a in addresses
            if a.family in (socket.AF_INET, socket.AF_INET6)
        }
    return frozenset(names)


def check_browser_request(headers: Any, *, names: frozenset[str], port: int) -> None:
    """Refuse what a web page in a browser could send to a local server: a ``Host`` that is not one of ``names``
    with ``port`` (a page that rebound its own domain name to this address: 421), or an ``Origin`` that is not
    either (a page of another site posting a "simple" request, which needs no preflight: 403). Miles' own clients
    (httpx, the SGLang router) send the ``Host`` of the URL they were given and no ``Origin``."""
    host = headers.get("host")
    served = ", ".join(f"{name}:{port}" for name in sorted(names))
    if not host_header_matches(host, names=names, port=port):
        raise HttpError(421, f"Host {(host or '')[:100]!r} is not a name this server answers ({served})")
    origin = headers.get("origin")
    if origin is not None:
        scheme, _, authority = origin.partition("://")
        if scheme.lower() != "http" or not host_header_matches(authority, names=names, port=port):
            raise HttpError(
                403,
                f"requests from web pages are refused (Origin {origin[:100]!r}): this server is "
                f"for Miles' own clients ({served})",
            )


def host_header_matches(value: str | None, *, names: frozenset[str], port: int) -> bool:
    """Whether the ``Host`` header ``value`` is one of ``names`` with ``port`` (a header without a port means 80)."""
    if not value:
        return False
    value = value.strip().lower()
    if value.endswith("]") or ":" not in value:  # "[::1]" or "localhost": no port
        name, given_port = value, ""
    else:
        name, _, given_port = value.rpartition(":")
        if not re.fullmatch(r"[0-9]{1,5}", given_port):
            return False
    return name in names and (int(given_port) if given_port else 80) == port


def _refuse_constant(name: str, *, subject: str) -> Any:
    raise HttpError(400, f"{subject} is not valid JSON: {name} is not a JSON number")


def _finite_float(literal: str, *, subject: str) -> float:
    value = float(literal)
    if not math.isfinite(value):  # 1e400: valid JSON syntax, but no float holds it
        raise HttpError(400, f"{subject} holds the number {literal[:40]}, too large for a float")
    return value


def _bounded_int(literal: str, *, subject: str) -> int:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        raise HttpError(400, f"{subject} holds an integer of {len(literal)} digits (at most {MAX_INT_DIGITS})")
    return int(literal)


def _unique_object(pairs: list[tuple[str, Any]], *, subject: str) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise HttpError(400, f"{subject} gives the key {key[:80]!r} twice in one object: give each key once")
        seen.add(key)
    return dict(pairs)


def _nested_deeper_than(raw: bytes | str, max_depth: int) -> bool:
    """Whether ``[``/``{`` nest deeper than ``max_depth`` outside strings, found without recursion."""
    text = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
    openers = text.count(b"[") + text.count(b"{")
    if openers <= max_depth:  # the fast path (bytes.count runs at memory speed): it cannot nest deeper
        return False
    depth = deepest = 0
    for match in _STRUCTURE.finditer(text):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif token in (b"]", b"}"):
            depth -= 1
    return deepest > max_depth


_STRUCTURE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
"""A JSON string (skipped whole) or a bracket."""


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds uvicorn lacks: a request head of at most
    :data:`MAX_HEAD_BYTES` (a 431 otherwise), within :data:`HEAD_TIMEOUT_S` of connecting or of the previous
    request; a body that keeps arriving (:data:`BODY_GRACE_S`, then :data:`MIN_BODY_BYTES_PER_S`; a 408
    otherwise). Pass it as ``uvicorn.Config(..., http=BoundedHttpProtocol)``.

    The deadline counts only while the server waits for the client: while reading is paused (the handler has not
    taken the body yet, or a pipelined request waits for the one before), it is put off.
    """

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: Any = None
        self._head_bytes = 0
        self._in_head = True
        self._body_bytes = 0
        self._body_started = 0.0
        self._refused = False
        self._head_size = 0  # the parsed head's bytes (request target and headers)
        self._arm(HEAD_TIMEOUT_S)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the rest of a refused request, read and dropped until the connection closes
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            self._refuse(431, f"request head larger than {MAX_HEAD_BYTES} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_size = True, 0
        if self._deadline is None:  # a request on a kept-alive connection: its head has its own deadline
            self._arm(HEAD_TIMEOUT_S)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._head_size += len(name) + len(value) + 4  # ": " and CRLF

    def on_headers_complete(self) -> None:
        if self._head_size > MAX_HEAD_BYTES:  # a whole head in one read, which data_received could not count
            app, self.app = self.app, _head_too_large
            try:
                super().on_headers_complete()
            finally:
                self.app = app
        else:
            super().on_headers_complete()
        self._in_head, self._head_bytes, self._body_bytes = False, 0, 0
        self._body_started = time.monotonic()
        self._arm(BODY_GRACE_S)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._body_bytes += len(body)
        allowed = BODY_GRACE_S + self._body_bytes / MIN_BODY_BYTES_PER_S
        self._arm(self._body_started + allowed - time.monotonic())

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._deadline is None:
            self._in_head, self._head_bytes = True, 0
            self._arm(HEAD_TIMEOUT_S)  # the next request on this kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(max(seconds, 0.0), self._deadline_passed)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
        self._deadline = None

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the server is not reading: not the client's delay, so start counting anew
            if not self._in_head:  # as if the body so far had come at the minimum pace, ending now
                self._body_started = time.monotonic() - self._body_bytes / MIN_BODY_BYTES_PER_S
            self._arm(HEAD_TIMEOUT_S if self._in_head else BODY_GRACE_S)
        elif self._in_head:
            self.transport.close()  # nothing to answer: no request was made
        else:
            self._refuse(408, "the request body did not arrive in time")

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` unless a response has begun, then close the connection (the handler sees a
        disconnect)."""
        if self.cycle is None or not self.cycle.response_started:
            body = json.dumps({"error": message}).encode()
            head = f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
            head += f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            self.transport.write(head.encode() + body)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the handler's receive() sees a disconnect, its send() writes nothing
            self.cycle.message_event.set()
        # Closing with unread input would reset the connection and lose the answer on its way: say "no more" (FIN),
        # drop what still comes for a moment, then close.
        self._refused = True
        self._disarm()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large"}


async def _head_too_large(scope: dict, receive: Any, send: Any) -> None:
    """The ASGI app that answers a request whose head is larger than :data:`MAX_HEAD_BYTES`."""
    body = json.dumps({"error": f"request head larger than {MAX_HEAD_BYTES} bytes"}).encode()
    headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 431, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BackgroundServer:
    """An ASGI ``app`` served by uvicorn on an already bound ``sock`` with :class:`BoundedHttpProtocol`: in a daemon
    thread (:meth:`start`, inside a training run) or in the calling thread (:meth:`run`); ``what`` names it in
    errors (``"the dashboard server on http://..."``)."""

    def __init__(
        self,
        app: Any,
        sock: socket.socket,
        *,
        what: str,
        thread_name: str,
        keep_alive_s: float = 5,
        start_timeout_s: float = 30.0,
    ) -> None:
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            http=BoundedHttpProtocol,
            timeout_keep_alive=keep_alive_s,
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        self.socket = sock
        self.what = what
        self.start_timeout_s = start_timeout_s
        self.thread = threading.Thread(target=self.run, name=thread_name, daemon=True)

    def start(self) -> None:
        """Serve in the daemon thread; returns once it answers (a :class:`RuntimeError` if it does not start)."""
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError(f"{self.what} did not start within {self.start_timeout_s:.0f} s")

    def run(self) -> None:
        """Serve in this thread until stopped (or until SIGINT or SIGTERM when this is the main thread)."""
        try:
            self.server.run(sockets=[self.socket])
        finally:
            self.socket.close()

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=10)
        self.socket.close()
