"""Prompts and their sources: the embedded task, or a JSONL file of ``{"prompt", "label", "metadata"}`` lines.

A prompt file is read as every file a user names is (:mod:`miles_core.user_files`): a regular UTF-8 file within
:data:`MAX_FILE_BYTES`, each line strict JSON. A line is refused, naming the file and the line, when it is not an
object, gives a key twice or a key other than ``prompt``, ``label`` and ``metadata`` (a misspelt ``"lable"`` would
otherwise leave every label ``None``), or has an empty ``prompt``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from miles_core.errors import ConfigError
from miles_core.user_files import parse_json_text, read_text

MAX_FILE_BYTES = 1 << 30
"""A prompt file is read whole: 1 GiB holds millions of prompts and bounds the memory it costs."""
MAX_LINE_BYTES = 16 << 20
"""One prompt line: more than any context length holds, and within the engine's 32 MiB request limit."""
KEYS = ("prompt", "label", "metadata")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt of a task or a JSONL file: its text, the label a reward function compares with, and metadata."""

    text: str
    label: Any = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


def read_prompts_jsonl(path: str | Path) -> list[Prompt]:
    """Read a JSONL prompt file; a bad file or line is a :class:`ConfigError` naming the file (and line)."""
    what = f"prompt file {str(path)!r}"
    text = read_text(
        path,
        what=what,
        expected='a JSONL file (one {"prompt": ...} object per line)',
        limit=MAX_FILE_BYTES,
        hint="split the prompts into several runs",
    )
    prompts = [
        _prompt(line, where=f"{path}:{number}") for number, line in enumerate(text.split("\n"), start=1) if line.strip()
    ]
    if not prompts:
        raise ConfigError(f'{what} holds no prompts; write one {{"prompt": ...}} object per line')
    return prompts


def _prompt(line: str, *, where: str) -> Prompt:
    if len(line) > MAX_LINE_BYTES:  # characters: at least as many bytes
        raise ConfigError(f"{where}: a line of {len(line)} characters, more than the {MAX_LINE_BYTES} allowed")
    record = parse_json_text(line, what=where)
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise ConfigError(f'{where}: expected an object with a string "prompt", got {_excerpt(line)}')
    unknown = sorted(set(record) - set(KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {_excerpt(unknown[0])}; a line has the keys {', '.join(KEYS)}")
    if not record["prompt"]:
        raise ConfigError(f'{where}: "prompt" is empty; give it some text')
    metadata = record.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ConfigError(f'{where}: "metadata" must be an object, got {type(metadata).__name__}')
    return Prompt(text=record["prompt"], label=record.get("label"), metadata=metadata)


def _excerpt(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
