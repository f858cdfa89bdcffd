"""Chat prompts: messages rendered into the engine's prompt text by the tokenizer's chat template.

``--rollout-apply-chat-template`` decides which prompts are rendered: ``None`` (auto) renders message lists and
leaves strings as they are; ``true`` also wraps each string as one user message; ``false`` refuses message lists.
``--rollout-chat-template-kwargs`` reach the template (``{enable_thinking: false}``), and
``--rollout-chat-template-file`` replaces the tokenizer's template. A rendered prompt is encoded with
``add_special_tokens=False`` (:func:`miles_core.rollout.prompt_encoding.encode_prompt`): the template writes BOS
itself, so the ids equal ``apply_chat_template(..., tokenize=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from miles_core.errors import ConfigError
from miles_core.rollout.prompts import Prompt
from miles_core.user_files import read_text

MAX_TEMPLATE_BYTES = 1 << 20
"""A chat template file: a Jinja template of a few kilobytes; a megabyte is surely a wrong file."""


class ChatRenderer:
    """Renders chat messages with a tokenizer's chat template, as the rollout config asks."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        apply: bool | None = None,
        kwargs: Mapping[str, Any] | None = None,
        template_file: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.apply = apply
        self.kwargs = dict(kwargs or {})
        self.template = _read_template(template_file) if template_file else None

    @classmethod
    def from_config(cls, tokenizer: Any, rollout: Any) -> ChatRenderer:
        """The renderer of ``rollout`` (:class:`~miles_core.config.sections.RolloutSection`)."""
        return cls(
            tokenizer,
            apply=rollout.apply_chat_template,
            kwargs=rollout.chat_template_kwargs,
            template_file=rollout.chat_template_file,
        )

    def has_template(self) -> bool:
        return self.template is not None or bool(getattr(self.tokenizer, "chat_template", None))

    def check(self, *, has_messages: bool, what: str) -> None:
        """A :class:`ConfigError` at start when prompts must be rendered (``what`` has message prompts, or
        ``--rollout-apply-chat-template true``) and there is no chat template to render them with."""
        if (has_messages or self.apply) and not self.has_template():
            reason = (
                "holds chat-message prompts"
                if has_messages
                else "is to be rendered (--rollout-apply-chat-template true)"
            )
            raise ConfigError(
                f"{what} {reason}, but the tokenizer has no chat template: give one with "
                "--rollout-chat-template-file FILE.jinja, or give the prompts as strings"
            )

    def prompt(
        self,
        value: str | Sequence[Mapping[str, Any]],
        *,
        label: Any,
        metadata: dict[str, Any],
        tools: Sequence[Mapping[str, Any]] | None,
        origin: str,
    ) -> Prompt:
        """The :class:`Prompt` of a checked prompt value (a string, or a list of messages)."""
        if isinstance(value, str) and not self.apply:
            return Prompt(text=value, label=label, metadata=metadata, origin=origin)
        if not isinstance(value, str) and self.apply is False:
            raise ConfigError(
                f"{origin}: the prompt is a list of chat messages and --rollout-apply-chat-template is false; "
                "give it as a string or let the template render it"
            )
        messages = ({"role": "user", "content": value},) if isinstance(value, str) else tuple(map(dict, value))
        tool_list = tuple(map(dict, tools)) if tools is not None else None
        return Prompt(
            text=self.render(messages, tools=tool_list, origin=origin),
            label=label,
            metadata=metadata,
            messages=messages,
            tools=tool_list,
            origin=origin,
        )

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Any = None, origin: str = "") -> str:
        """The template's rendering of ``messages`` with the generation prompt; a template that fails is a
        :class:`ConfigError` naming the prompt."""
        if not self.has_template():
            raise ConfigError(f"{origin}: a chat prompt, but the tokenizer has no chat template")
        extra = {"chat_template": self.template} if self.template is not None else {}
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True, tools=tools, **extra, **self.kwargs
            )
        except Exception as exc:  # a Jinja error, a template raising on a bad message ...
            raise ConfigError(
                f"{origin}: the chat template cannot render the prompt: {type(exc).__name__}: {exc}"
            ) from None


def _read_template(path: str) -> str:
    return read_text(
        path,
        what=f"chat template file {path!r} (--rollout-chat-template-file)",
        expected="a Jinja chat template file",
        limit=MAX_TEMPLATE_BYTES,
    )
