"""Prompts and their sources: the embedded task, or a JSONL file of ``{"prompt", "label", "metadata"}`` lines."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from miles_core.errors import MilesError


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str
    label: Any = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


def read_prompts_jsonl(path: str | Path) -> list[Prompt]:
    """Read a JSONL prompt file; a bad line is an error naming the file and the line number."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise MilesError(f"cannot read prompt file {str(path)!r}: {exc.strerror or exc}") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise MilesError(f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise MilesError(f'{path}:{number}: expected an object with a string "prompt", got {line[:80]!r}')
        metadata = record.get("metadata", {})
        if not isinstance(metadata, dict):
            raise MilesError(f'{path}:{number}: "metadata" must be an object')
        prompts.append(Prompt(text=record["prompt"], label=record.get("label"), metadata=metadata))
    if not prompts:
        raise MilesError(f"prompt file {str(path)!r} holds no prompts")
    return prompts
