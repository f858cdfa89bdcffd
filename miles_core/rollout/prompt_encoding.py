"""Prompts into token ids, checked: not empty, within the model's vocabulary, leaving room in its context.

A run checks a bounded prefix of its prompts before any worker starts (a wrong tokenizer or too-long prompts are an
error in seconds), and the executor checks every prompt again when it encodes it: a prompt file of millions of rows
is not encoded whole at start.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from miles_core.errors import MilesError
from miles_core.rollout.prompts import Prompt


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """The token ids of ``prompt``: a rendered chat prompt without the tokenizer's special tokens (its template
    wrote them), any other with them, as the tokenizer adds them."""
    if prompt.messages is not None:
        return list(tokenizer.encode(prompt.text, add_special_tokens=False))
    return list(tokenizer.encode(prompt.text))


@dataclasses.dataclass(frozen=True)
class PromptEncoder:
    """Encodes prompts with ``tokenizer`` and checks the ids against the model: ``vocab_size`` and ``context``
    (``None``: unknown, not checked) and the ``max_new_tokens`` a response needs. ``source`` names the tokenizer in
    errors; ``files_hint`` says which tokenizer files were read (an empty encoding is often another model's
    tokenizer)."""

    tokenizer: Any
    source: str = "the tokenizer"
    vocab_size: int | None = None
    context: int | None = None
    max_new_tokens: int = 0
    files_hint: str = ""

    def ids(self, prompt: Prompt, *, where: str) -> list[int]:
        """``prompt``'s checked token ids; ``where`` names it in errors (``"train prompt 3"``)."""
        where = f"{where} ({prompt.text[:60]!r}{', ' + prompt.origin if prompt.origin else ''})"
        try:
            ids = encode_prompt(self.tokenizer, prompt)
        except Exception as exc:  # tokenizers raise many types (a character outside the vocabulary, ...)
            raise MilesError(f"{self.source} cannot encode {where}: {type(exc).__name__}: {exc}") from None
        if not ids:
            hint = "the prompt is empty: give it some text" if not prompt.text.strip() else self.files_hint
            raise MilesError(f"{self.source} encodes {where} to no token ids: {hint}")
        if self.vocab_size is not None and max(ids) >= self.vocab_size:
            raise MilesError(
                f"{self.source} encodes {where} to token id {max(ids)}, beyond the model's "
                f"vocab_size {self.vocab_size}: the tokenizer is another model's"
            )
        if self.context is not None and len(ids) + self.max_new_tokens > self.context:
            raise MilesError(
                f"{self.source} encodes {where} to {len(ids)} token ids, and with rollout.max_new_tokens "
                f"(--rollout-max-new-tokens) {self.max_new_tokens} that is more than the model's context "
                f"length {self.context}: shorten the prompt or ask for fewer new tokens"
            )
        return ids
