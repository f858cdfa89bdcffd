"""The shared HTTP toolkit: strict JSON, bounded bodies and the one bearer check every server uses."""

from __future__ import annotations

import asyncio

import pytest

from miles_core.http import (
    MAX_INT_DIGITS,
    MAX_JSON_DEPTH,
    HttpError,
    bearer_token_matches,
    parse_json,
    parse_json_object,
    read_body,
)


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 10_000 + b"]" * 10_000,  # RecursionError in the stdlib parser without the depth check
        b'{"a":' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1),
        b"[NaN]",
        b'{"x": Infinity}',
        b"[-Infinity]",
        b"[1e400]",  # overflows to inf in the stdlib parser
        b'{"x": -1.5e309}',
        b"[" + b"9" * 5000 + b"]",  # a ValueError (int max str digits) in the stdlib parser
        b"[" + b"1" * (MAX_INT_DIGITS + 1) + b"]",
        b"\xff\xfe{}",
        b"{",
        b"{} trailing",
    ],
)
def test_hostile_json_is_a_400(raw: bytes) -> None:
    with pytest.raises(HttpError) as caught:
        parse_json(raw)
    assert caught.value.status == 400


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    deep_looking = '"' + "[" * 1000 + '\\"' + "{" * 1000 + '"'
    assert parse_json(f'{{"text": {deep_looking}}}')["text"].startswith("[[[")
    nested = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json(nested) is not None  # exactly the limit is allowed


def test_ordinary_json_parses_unchanged() -> None:
    assert parse_json(b'{"ids": [[1, 2], [3]], "t": 0.5, "n": -12, "s": "\\u00e9"}') == {
        "ids": [[1, 2], [3]],
        "t": 0.5,
        "n": -12,
        "s": "é",
    }


def test_a_body_must_be_an_object() -> None:
    assert parse_json_object(b"") == {}
    with pytest.raises(HttpError, match="must be a JSON object"):
        parse_json_object(b"[1]")


class _Request:
    def __init__(self, chunks: list[bytes], headers: dict[str, str]) -> None:
        self.headers, self._chunks, self.read = headers, chunks, 0

    async def stream(self):
        for chunk in self._chunks:
            self.read += len(chunk)
            yield chunk


def test_a_chunked_body_is_cut_off_at_the_limit_not_read_whole() -> None:
    request = _Request([b"x" * 1024] * 1000, headers={})  # no Content-Length, as with chunked encoding
    with pytest.raises(HttpError) as caught:
        asyncio.run(read_body(request, limit=4096))
    assert caught.value.status == 413
    assert request.read <= 4096 + 1024  # stopped at the first chunk past the limit


@pytest.mark.parametrize("declared", ["99999999", "12abc", "-1", "\uff11\uff12"])
def test_a_declared_length_over_the_limit_or_malformed_is_refused_before_reading(declared: str) -> None:
    request = _Request([b"{}"], headers={"content-length": declared})
    with pytest.raises(HttpError):
        asyncio.run(read_body(request, limit=1000))
    assert request.read == 0


@pytest.mark.parametrize(
    ("header", "accepted"),
    [
        ("Bearer s3cret", True),
        ("bearer s3cret", True),
        ("BEARER   s3cret ", True),
        ("s3cret", False),  # no scheme
        ("Basic s3cret", False),
        ("Bearer ", False),
        ("Bearer s3cre", False),
        ("Bearer s3cret-and-more", False),
        ("", False),
        (None, False),
        ("Bearer \udcff", False),
    ],
)
def test_one_bearer_check(header: str | None, accepted: bool) -> None:
    assert bearer_token_matches(header, "s3cret") is accepted


def test_an_empty_expected_token_never_matches() -> None:
    assert not bearer_token_matches("Bearer ", "")
    assert not bearer_token_matches("Bearer x", "")
