"""The one HTTP toolkit every server of the project uses: errors, bounded bodies, strict JSON, the bearer check.

Every server of Miles (the local engine, the worker RPC, the dashboard, the session server) reads requests from
possibly hostile local users. The rules live here once, so a fix reaches every server:

- :class:`HttpError` carries a 4xx status and a message; servers answer it as ``{"error": message}``.
- :func:`read_body` limits the body *stream*, not only its ``Content-Length``: a chunked body is cut off at the
  limit instead of being read whole.
- :func:`parse_json` accepts strict JSON only: no ``NaN``/``Infinity`` (nor ``1e400``, which overflows to
  infinity), integers of at most
  :data:`MAX_INT_DIGITS` digits, nesting at most :data:`MAX_JSON_DEPTH` deep (and, on request, each key once).
  Anything else is a 400. Files that users name are parsed by it too (:mod:`miles_core.user_files`).
- :func:`bearer_token_matches` is the one ``Authorization: Bearer <token>`` check: the scheme is
  case-insensitive (RFC 9110 §11.1), the token is required, and it is compared in constant time.
"""

from __future__ import annotations

import functools
import hmac
import json
import math
import re
from typing import Any, Protocol

MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects a request may have (Miles' own requests use at most 4)."""

MAX_INT_DIGITS = 64
"""The longest integer literal a request may hold (token ids, sizes and seeds need at most 20 digits)."""


class HttpError(Exception):
    """A request the server refuses, with the HTTP status to answer (4xx) and a message saying what to do."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(
    raw: bytes | str, *, max_depth: int = MAX_JSON_DEPTH, subject: str = "request body", unique_keys: bool = False
) -> Any:
    """Parse strict JSON from a request; malformed, non-finite (also by overflow), huge-integer or too-deep input
    is a 400. ``subject`` names the input in messages (a file reader passes ``"prompts.jsonl:3"``);
    ``unique_keys`` refuses an object that gives a key twice (JSON keeps the last one silently)."""
    if _nested_deeper_than(raw, max_depth):
        raise HttpError(400, f"{subject} is nested deeper than {max_depth} levels")
    pairs_hook = functools.partial(_unique_object, subject=subject) if unique_keys else None
    try:
        return json.loads(raw, parse_constant=functools.partial(_refuse_constant, subject=subject),
                          parse_int=functools.partial(_bounded_int, subject=subject),
                          parse_float=functools.partial(_finite_float, subject=subject),
                          object_pairs_hook=pairs_hook)  # fmt: skip
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
            raise HttpError(400, f"{subject} gives the key {key[:80]!r} twice; give each key once")
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
