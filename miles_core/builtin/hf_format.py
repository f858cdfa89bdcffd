"""The ``hf`` chat format: any checkpoint's own chat template (its tokenizer's ``chat_template``), token in, token out.

A conversation is rendered with ``tokenizer.apply_chat_template`` and encoded; a session then grows it by the tokens
the template writes *after* what the session holds. At each turn the format checks, on the text, that the
template's rendering of the whole conversation extends the tokens already held (the sampled turns, exactly, and the
messages appended between them). A template that re-renders earlier turns differently once later messages follow
(Qwen3's drops the reasoning of turns before the last user message; others change whitespace) fails that check. The
format then keeps the held tokens as they are, finds where the new messages begin in the template's rendering (the
end of the held text aligned with it, so the split falls at the template's own message boundary) and appends from
there, and it warns (:class:`~miles_core.rollout.sessions.formats.ChatFormatWarning`) naming the turn that differs
and the two texts: the trainer still trains on exactly what was sampled. A template that renders append-only (Qwen2.5's,
Llama 3's) never warns.

A generated turn ends as the template ends an assistant message (the text after an assistant message's content, found
once by rendering a probe message). Tool calls are read in the convention of the family: Hermes-style
``<tool_call>`` JSON blocks (Qwen2.5, Qwen3, Hermes) when the template writes them and the tokenizer holds the tags as
single tokens. For another convention, subclass :class:`HfChatFormat`, override :meth:`HfChatFormat.parse_tool_calls`
and register the class under its own name (``provide_chat_formats``): a parser plugin.
"""

from __future__ import annotations

import difflib
import json
import warnings
from collections.abc import Sequence
from typing import Any

from miles_core.builtin.chat_formats import HermesToolCalls, token_ids_if_single
from miles_core.rollout.sessions.formats import ChatFormat, ChatFormatError, ChatFormatWarning, ChatMessage, Tool

PROBE = "MILESPROBE"
"""The content of the probe messages that find the template's assistant-turn ends and generation prompt."""
SHOWN_CHARACTERS = 60
"""How much of the two texts a warning shows from where they differ."""


class HfChatFormat(ChatFormat):
    """The checkpoint's own chat template as a token-in-token-out format (see the module docstring)."""

    name = "hf"

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatFormatError(
                "chat format 'hf' renders with the checkpoint's chat template, and this tokenizer has none "
                "(tokenizer_config.json or chat_template.jinja): pick the chat format of its family"
            )
        self.tokenizer = tokenizer
        self.tool_calls: HermesToolCalls | None = None  # the probes below render without tools
        self.end_text = self._assistant_end_text()
        self.end_ids = self.encode(self.end_text)
        self.turn_end_ids = self._turn_end_ids()  # what a generated turn may end with, stripped from its content
        self.generation_text = self._generation_prompt_text()
        self.tool_calls = self._tool_call_reader()

    # -- rendering ---------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, with no special tokens added (the template writes its own)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` as written: special tokens kept, no clean-up of spaces (which would make the held text
        differ from the template's where nothing differs)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def render_text(
        self, messages: Sequence[ChatMessage], *, tools: Sequence[Tool] = (), add_generation_prompt: bool
    ) -> str:
        """The conversation as the checkpoint's template writes it."""
        if tools and self.tool_calls is None:
            raise ChatFormatError(
                "chat format 'hf' cannot read tool calls of this model: its chat template writes no Hermes-style "
                "<tool_call> blocks (or its tokenizer splits the tags); register a subclass of HfChatFormat with its "
                "family's parse_tool_calls, or ask without tools"
            )
        try:
            return self.tokenizer.apply_chat_template(
                [template_message(message) for message in messages],
                tools=list(tools) or None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as exc:  # jinja2's TemplateError, or the template's own raise_exception
            message = f"chat format 'hf': the checkpoint's chat template refused the conversation: {exc}"
            raise ChatFormatError(message) from None

    def render_messages(
        self, messages: Sequence[ChatMessage], *, tools: Sequence[Tool] = (), add_generation_prompt: bool
    ) -> list[int]:
        return self.encode(self.render_text(messages, tools=tools, add_generation_prompt=add_generation_prompt))

    def close_turn(self, generated: Sequence[int]) -> list[int]:
        ended = bool(generated) and bool(self.end_ids) and generated[-1] == self.end_ids[0]
        return list(self.end_ids[1:] if ended else self.end_ids)

    def parse_tool_calls(self, output_ids: Sequence[int], *, tools: Sequence[Tool] = ()) -> tuple[str, list]:
        if self.tool_calls is not None:
            return self.tool_calls.parse(output_ids)
        ids = list(output_ids)
        while ids and ids[-1] in self.turn_end_ids:
            ids.pop()
        return self.decode(ids), []

    # -- growing a session -------------------------------------------------------------------------------------

    def append(
        self,
        ids_so_far: Sequence[int],
        new_messages: Sequence[ChatMessage],
        *,
        history: Sequence[ChatMessage],
        tools: Sequence[Tool] = (),
    ) -> list[int]:
        """The held ids, closed, then the new messages as the template writes them after the held conversation.
        Where the template's rendering does not extend the held text, a :class:`ChatFormatWarning` names the turn
        and the held tokens are kept (see the module docstring)."""
        bridge = self.close_turn(ids_so_far) if history and history[-1].role == "assistant" else []
        held = [*ids_so_far, *bridge]
        held_text = self.decode(held)
        after_text = self.render_text([*history, *new_messages], tools=tools, add_generation_prompt=True)
        if after_text.startswith(held_text):
            return [*held, *self.encode(after_text[len(held_text) :])]
        differs_at = first_text_difference(held_text, after_text)
        start = self._continuation_start(held_text, after_text, differs_at)
        warnings.warn(
            ChatFormatWarning(
                f"chat format 'hf': the checkpoint's chat template renders {self._where(held_text, differs_at)} "
                "differently once later messages follow",
                f"it writes {after_text[differs_at : differs_at + SHOWN_CHARACTERS]!r} where the session holds "
                f"{held_text[differs_at : differs_at + SHOWN_CHARACTERS]!r}; the session keeps the tokens as sampled "
                "(the trainer trains on them, the next turn continues them), not the template's re-rendering",
            ),
            stacklevel=2,
        )
        return [*held, *self.encode(after_text[start:])]

    def _continuation_start(self, held_text: str, after_text: str, differs_at: int) -> int:
        """Where the new messages begin in ``after_text``: just after the part aligned with the end of the held text
        (which ends with an assistant turn's end, the template's message boundary)."""
        held_tail, after_tail = held_text[differs_at:], after_text[differs_at:]
        matcher = difflib.SequenceMatcher(None, held_tail, after_tail, autojunk=False)
        blocks = [block for block in matcher.get_matching_blocks() if block.size]
        if blocks and blocks[-1].a + blocks[-1].size == len(held_tail) and blocks[-1].size >= len(self.end_text):
            return differs_at + blocks[-1].b + blocks[-1].size
        raise ChatFormatError(
            "chat format 'hf': the checkpoint's chat template renders the conversation so differently from the "
            f"tokens held (from character {differs_at}: {after_text[differs_at : differs_at + 40]!r} where the "
            f"session holds {held_text[differs_at : differs_at + 40]!r}) that the new messages cannot be placed "
            "after them: pick a chat format written for this family"
        )

    def _where(self, held_text: str, position: int) -> str:
        """The part of the held conversation at ``position``: the prompt, a turn (from its generation prompt on), or
        the messages after one."""
        starts = _occurrences(held_text, self.generation_text) if self.generation_text else []
        turns = sum(start <= position for start in starts)
        if turns == 0:
            return "the prompt (before the first turn)"
        since = held_text[starts[turns - 1] + len(self.generation_text) : position]
        return f"the messages after turn {turns}" if self.end_text and self.end_text in since else f"turn {turns}"

    # -- what the template writes, found once ------------------------------------------------------------------

    def _assistant_end_text(self) -> str:
        probe = [ChatMessage("user", "x"), ChatMessage("assistant", PROBE)]
        text = self.render_text(probe, add_generation_prompt=False)
        if PROBE not in text:
            raise ChatFormatError(
                "chat format 'hf': the checkpoint's chat template does not write an assistant message's content: "
                "it cannot render multi-turn sessions"
            )
        return text[text.rindex(PROBE) + len(PROBE) :]

    def _generation_prompt_text(self) -> str:
        probe = [ChatMessage("user", "x")]
        closed = self.render_text(probe, add_generation_prompt=False)
        opened = self.render_text(probe, add_generation_prompt=True)
        return opened[len(closed) :] if opened.startswith(closed) else ""

    def _turn_end_ids(self) -> set[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return {*self.end_ids[:1], *([eos] if isinstance(eos, int) else [])}

    def _tool_call_reader(self) -> HermesToolCalls | None:
        """Hermes-style tool calls when the template writes them and the tokenizer holds their tags as tokens."""
        if "<tool_call>" not in str(self.tokenizer.chat_template):
            return None
        start = token_ids_if_single(self.tokenizer, "<tool_call>")
        end = token_ids_if_single(self.tokenizer, "</tool_call>")
        if not start or not end:
            return None
        return HermesToolCalls(self.tokenizer, call_start=start[0], call_end=end[0], end_ids=self.turn_end_ids)


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as HF chat templates read it: OpenAI's shape, a tool call's arguments as a mapping (what the
    templates' ``tojson`` expects), the reasoning as ``reasoning_content``."""
    entry: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        entry["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        entry["name"] = message.name
    if message.reasoning:
        entry["reasoning_content"] = message.reasoning
    return entry


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _occurrences(text: str, part: str) -> list[int]:
    """Where ``part`` starts in ``text``, each time."""
    found, start = [], text.find(part)
    while start >= 0:
        found.append(start)
        start = text.find(part, start + 1)
    return found


def first_text_difference(held: str, after: str) -> int:
    """The first character where ``after`` does not continue ``held`` (``held`` is known not to be its prefix)."""
    for position, (mine, theirs) in enumerate(zip(held, after, strict=False)):
        if mine != theirs:
            return position
    return min(len(held), len(after))
