"""Files that a user names (a config file, a prompt file, the files of a model directory), read within bounds.

Every such path may name something that is not a small text file: a FIFO (reading it waits for a writer forever),
a device (``/dev/zero`` never ends), a directory, a symlink loop, a file of gigabytes, binary or UTF-16 bytes.
The rules live here once, so that every reader refuses all of them the same way, before reading, with a
:class:`~miles_core.errors.ConfigError` that names the file and says what to give instead:

- :func:`check_regular_file`: the path is a regular file of at most ``limit`` bytes (``os.stat`` follows symlinks;
  a loop is an error naming it).
- :func:`read_bytes` / :func:`read_text`: read it without waiting on a FIFO swapped in after the check, and
  without reading more than ``limit + 1`` bytes of a file that grows; the text is UTF-8 (a BOM is dropped).
- :func:`parse_json_text`: strict JSON (:func:`miles_core.http.parse_json`: no NaN/Infinity, bounded integers
  and nesting; here also no duplicate keys, which would silently keep the last value).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from miles_core.errors import ConfigError
from miles_core.http import HttpError, parse_json


def check_regular_file(path: str | Path, *, what: str, expected: str, limit: int, hint: str = "") -> os.stat_result:
    """``os.stat`` of ``path`` when it is a regular file of at most ``limit`` bytes; a :class:`ConfigError`
    otherwise. ``what`` names the file in errors (``"prompt file 'p.jsonl'"``), ``expected`` says what to give
    (``"a JSONL file"``), ``hint`` why a large one is refused (``"a config is a small YAML file"``)."""
    try:
        info = os.stat(path)
    except (OSError, ValueError) as exc:  # ValueError: a NUL character in the path
        raise ConfigError(f"cannot read {what}: {_reason(exc)}; give {expected}") from None
    _check_stat(info, what=what, expected=expected, limit=limit, hint=hint)
    return info


def read_bytes(path: str | Path, *, what: str, expected: str, limit: int, hint: str = "") -> bytes:
    """The bytes of the regular file ``path`` (:func:`check_regular_file`), at most ``limit`` of them."""
    check_regular_file(path, what=what, expected=expected, limit=limit, hint=hint)
    try:
        # O_NONBLOCK: should the path become a FIFO after the check, opening it must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as file:
            _check_stat(os.fstat(file.fileno()), what=what, expected=expected, limit=limit, hint=hint)
            raw = file.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what}: {_reason(exc)}; give {expected}") from None
    if len(raw) > limit:  # it grew after the check
        raise ConfigError(f"{what} is larger than {limit} bytes{_hint(hint)}")
    return raw


def read_text(path: str | Path, *, what: str, expected: str, limit: int, hint: str = "") -> str:
    """The UTF-8 text of the regular file ``path`` (:func:`read_bytes`)."""
    return decode_utf8(read_bytes(path, what=what, expected=expected, limit=limit, hint=hint), what=what)


def decode_utf8(raw: bytes, *, what: str) -> str:
    """``raw`` as UTF-8 text (a BOM dropped); binary, UTF-16/UTF-32 and invalid bytes are refused naming the line."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in raw:
        raise ConfigError(f"{what} is binary or UTF-16/UTF-32, not UTF-8 text; save it as UTF-8")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{what} is not UTF-8 text (byte {raw[exc.start]:#04x} at line {line}); save it as UTF-8"
        ) from None


def parse_json_text(text: str, *, what: str) -> Any:
    """Strict JSON (see the module docstring); a :class:`ConfigError` starts with ``what`` (``"p.jsonl:3"``)."""
    try:
        return parse_json(text, subject=what, unique_keys=True)
    except HttpError as exc:
        raise ConfigError(str(exc)) from None


def _check_stat(info: os.stat_result, *, what: str, expected: str, limit: int, hint: str) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{what} is a directory; give {expected}")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{what} is not a regular file (a FIFO, device or socket); give {expected}")
    if info.st_size > limit:
        raise ConfigError(f"{what} is {info.st_size} bytes, more than the {limit} allowed{_hint(hint)}")


def _hint(hint: str) -> str:
    return f"; {hint}" if hint else ""


def _reason(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
