"""The Inkling chat format (``--rollout-chat-format inkling``): Thinking Machines' Inkling models write a
conversation with special tokens, never with text markers, and their turns are parsed on token ids.

A message is a role's start token (``<|message_system|>``, ``<|message_user|>``, ``<|message_model|>``,
``<|message_tool|>``), a content-kind token (``<|content_text|>``, ``<|content_thinking|>``,
``<|content_invoke_tool_json|>``, ``<|content_xml|>``), the content, and ``<|end_message|>``; an assistant turn ends
with ``<|content_model_end_sampling|>``. Rendered in order: the tools' declaration (one system block of compact JSON),
the thinking-effort system block before the first non-system message, then each message (an assistant's reasoning,
text and each tool call as blocks of their own), and ``<|message_model|>`` as the generation prompt.

Content text is encoded with the tokenizer's special tokens split (``split_special_tokens``): text that spells a
marker is ordinary tokens, never the marker's id, so the parser, which works on ids alone, cannot be fooled by it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from miles_core.builtin.chat_formats import single_token_id
from miles_core.rollout.sessions.formats import ChatFormat, ChatFormatError, ChatMessage, Tool, ToolCall

MESSAGE_STARTS = {
    "system": "<|message_system|>",
    "user": "<|message_user|>",
    "assistant": "<|message_model|>",
    "tool": "<|message_tool|>",
}
"""Each role's message-start token: the boundaries at which a token-in-token-out comparator splits."""
TEXT, THINKING, TOOL_JSON, XML = (
    "<|content_text|>",
    "<|content_thinking|>",
    "<|content_invoke_tool_json|>",
    "<|content_xml|>",
)
END_MESSAGE = "<|end_message|>"
END_SAMPLING = "<|content_model_end_sampling|>"
SPECIAL_TOKENS = (*MESSAGE_STARTS.values(), TEXT, THINKING, TOOL_JSON, XML, END_MESSAGE, END_SAMPLING)
"""The tokens a tokenizer must hold, each as one id, for this format."""

THINKING_EFFORT_LEVELS = {"none": 0.0, "minimal": 0.1, "low": 0.2, "medium": 0.7, "high": 0.9, "max": 0.99}
DEFAULT_THINKING_EFFORT = 0.9
TOOL_KEYS = ("description", "name", "parameters", "type")
"""What of an OpenAI tool entry the declaration keeps (the function's fields and the entry's ``type``)."""


@dataclasses.dataclass(frozen=True)
class InklingTurn:
    """One sampled assistant turn, read from its ids: its reasoning, its answer text and its tool calls."""

    thinking: str
    text: str
    tool_calls: tuple[ToolCall, ...]


def thinking_effort_text(effort: float | str) -> str:
    """The effort as the thinking-effort block writes it: a number in [0, 0.99] (a named level's), ``0`` for none."""
    value = THINKING_EFFORT_LEVELS.get(effort) if isinstance(effort, str) else effort
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 0.99:
        levels = ", ".join(THINKING_EFFORT_LEVELS)
        raise ChatFormatError(f"Inkling's thinking effort {effort!r} is not a number in [0, 0.99] nor one of {levels}")
    return f"{value:g}"


def declared_tools(tools: Sequence[Tool]) -> str:
    """The tools' declaration: a compact JSON list, keys sorted, each tool reduced to :data:`TOOL_KEYS`."""
    reduced = []
    for tool in tools:
        function = tool.get("function", tool)
        entry = {**{key: function[key] for key in TOOL_KEYS if key in function}, "type": tool.get("type", "function")}
        reduced.append(entry)
    return json.dumps(reduced, sort_keys=True, separators=(",", ":"))


def call_arguments(call: ToolCall) -> dict[str, Any]:
    """A tool call's arguments as the object the format writes (they must be a JSON object)."""
    try:
        arguments = json.loads(call.arguments or "{}")
    except json.JSONDecodeError as exc:
        raise ChatFormatError(f"tool call {call.name!r}: arguments are not JSON ({exc.msg})") from None
    if not isinstance(arguments, dict):
        kind = type(arguments).__name__
        raise ChatFormatError(f"tool call {call.name!r}: arguments must be a JSON object, not a JSON {kind}")
    return arguments


class InklingChatFormat(ChatFormat):
    """Inkling's format over a tokenizer that has :data:`SPECIAL_TOKENS` as single tokens; ``thinking_effort`` is the
    number (or named level) of the thinking-effort block, 0.9 by default."""

    name = "inkling"

    def __init__(self, tokenizer: Any, *, thinking_effort: float | str = DEFAULT_THINKING_EFFORT) -> None:
        self.tokenizer = tokenizer
        self.effort = thinking_effort_text(thinking_effort)
        advice = "use an Inkling checkpoint's tokenizer, or another chat format"
        self.ids = {
            token: single_token_id(tokenizer, token, chat_format="inkling", advice=advice) for token in SPECIAL_TOKENS
        }
        self.starts = {role: self.ids[token] for role, token in MESSAGE_STARTS.items()}
        self.end_message, self.end_sampling = self.ids[END_MESSAGE], self.ids[END_SAMPLING]
        self.kinds = {self.ids[kind] for kind in (TEXT, THINKING, TOOL_JSON, XML)}

    def text_ids(self, text: str) -> list[int]:
        """``text`` as ordinary tokens: a marker spelled in it is not the marker's id."""
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def _block(self, role: str, kind: str, text: str, *, label: str = "") -> list[int]:
        return [self.starts[role], *self.text_ids(label), self.ids[kind], *self.text_ids(text), self.end_message]

    def render_messages(
        self, messages: Sequence[ChatMessage], *, tools: Sequence[Tool] = (), add_generation_prompt: bool
    ) -> list[int]:
        ids: list[int] = []
        if tools:
            ids += self._block("system", XML, declared_tools(tools), label="tool_declare")
        effort_written = False
        called: dict[str, str] = {}  # tool-call id -> the function's name, for tool results that give only the id
        for message in messages:
            if message.role != "system" and not effort_written:
                ids += self._effort_block()
                effort_written = True
            ids += self._message(message, called)
        if not effort_written:
            ids += self._effort_block()
        if add_generation_prompt:
            ids.append(self.starts["assistant"])
        return ids

    def _effort_block(self) -> list[int]:
        return self._block("system", TEXT, f"Thinking effort level: {self.effort}")

    def _message(self, message: ChatMessage, called: dict[str, str]) -> list[int]:
        if message.role == "tool":
            name = message.name or called.get(message.tool_call_id or "")
            if not name:
                raise ChatFormatError(
                    f"a tool result (tool_call_id {message.tool_call_id!r}) names no tool: Inkling writes the tool's "
                    "name, so give `name` or the id of an earlier assistant tool call"
                )
            return self._block("tool", TEXT, message.content, label=name)
        if message.role != "assistant":
            return self._block(message.role, TEXT, message.content) if message.content else []
        ids: list[int] = []
        if message.reasoning:
            ids += self._block("assistant", THINKING, message.reasoning)
        if message.content:
            ids += self._block("assistant", TEXT, message.content)
        for call in message.tool_calls:
            body = json.dumps({"name": call.name, "args": call_arguments(call)}, sort_keys=True, separators=(",", ":"))
            ids += self._block("assistant", TOOL_JSON, body, label=call.name)
            if call.id:
                called[call.id] = call.name
        return [*ids, self.end_sampling] if ids else ids

    def close_turn(self, generated: Sequence[int]) -> list[int]:
        """Nothing after a turn the model ended; at the length limit, the open block closed and the turn ended."""
        if generated and generated[-1] == self.end_sampling:
            return []
        closed = bool(generated) and generated[-1] == self.end_message
        return [*([] if closed else [self.end_message]), self.end_sampling]

    def parse_turn(self, output_ids: Sequence[int]) -> InklingTurn:
        """The reasoning, text and tool calls of one sampled turn (the ids after the ``<|message_model|>`` prompt),
        split at the message-start and content-kind ids alone. A tool-call block whose JSON does not read as
        ``{"name": ..., "args": {...}}`` stays in the text, as written."""
        thinking: list[str] = []
        text: list[str] = []
        calls: list[ToolCall] = []
        for block in self._model_blocks(list(output_ids)):
            kind = next((index for index, token in enumerate(block) if token in self.kinds), None)
            if kind is None:
                text.append(self._decode(block))
                continue
            label, body = block[:kind], block[kind + 1 :]
            if block[kind] == self.ids[THINKING]:
                thinking.append(self._decode(body))
            elif block[kind] == self.ids[TOOL_JSON] and (call := self._read_call(body)) is not None:
                calls.append(call)
            elif block[kind] == self.ids[TOOL_JSON]:
                text.append(self._decode(label) + self._decode(body))
            else:
                text.append(self._decode(body))
        return InklingTurn("".join(thinking), "".join(text), tuple(calls))

    def _model_blocks(self, ids: list[int]) -> list[list[int]]:
        """The turn's blocks: split at ``<|message_model|>``, each up to its ``<|end_message|>``; the turn ends at
        ``<|content_model_end_sampling|>`` or at another role's message start (which a model turn does not hold)."""
        other_starts = {token for role, token in self.starts.items() if role != "assistant"}
        blocks: list[list[int]] = [[]]
        closed = False
        for token in ids:
            if token == self.end_sampling or token in other_starts:
                break
            if token == self.starts["assistant"]:
                blocks.append([])
                closed = False
            elif token == self.end_message:
                closed = True
            elif not closed:
                blocks[-1].append(token)
        return [block for block in blocks if block]

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _read_call(self, ids: Sequence[int]) -> ToolCall | None:
        try:
            body = json.loads(self._decode(ids))
        except json.JSONDecodeError:
            return None
        readable = isinstance(body, dict) and isinstance(body.get("name"), str) and isinstance(body.get("args"), dict)
        if not readable:
            return None
        return ToolCall(name=body["name"], arguments=json.dumps(body["args"], ensure_ascii=False))

    def parse_tool_calls(self, output_ids: Sequence[int], *, tools: Sequence[Tool] = ()) -> tuple[str, list[ToolCall]]:
        turn = self.parse_turn(output_ids)
        return turn.text, list(turn.tool_calls)
