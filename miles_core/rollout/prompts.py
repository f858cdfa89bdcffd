"""``Prompt``: one prompt of a task or of the user's prompt data (:mod:`miles_core.rollout.prompt_data`)."""

from __future__ import annotations

import dataclasses
from typing import Any

MAX_LINE_BYTES = 16 << 20
"""One prompt line: more than any context length holds, and within the engine's 32 MiB request limit."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt of a task or a prompt file: its text (what the engine sees), the label a reward function compares
    with, and metadata."""

    text: str
    label: Any = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    messages: tuple[dict[str, Any], ...] | None = None
    """The chat messages ``text`` was rendered from with the chat template (``None``: ``text`` is the prompt as
    given); a rendered prompt is encoded without the tokenizer's special tokens: the template holds them."""
    tools: tuple[dict[str, Any], ...] | None = None
    """The tool definitions given to the chat template with ``messages``."""
    origin: str = dataclasses.field(default="", compare=False)
    """Where the prompt comes from, for errors (``"prompts.parquet row 12"``); empty for a task's prompts."""
