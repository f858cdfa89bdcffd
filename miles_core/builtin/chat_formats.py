"""The built-in chat formats (the ``chat_formats`` registry's ``default`` and ``qwen3``): the embedded default's
digit format and Qwen3's, each a :class:`~miles_core.rollout.sessions.formats.ChatFormat` (see that module for the
contract: token in, token out, append-only)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from miles_core.default.tokenizer import CHARACTERS, SPECIALS
from miles_core.http import HttpError, parse_json
from miles_core.rollout.sessions.formats import ChatFormat, ChatFormatError, ChatMessage, Tool, ToolCall, tool_name


def _single_argument(tool: Tool | None) -> str:
    """The parameter a digit tool call's argument goes to: the tool's only parameter, else ``"input"``."""
    properties = ((tool or {}).get("function", {}).get("parameters") or {}).get("properties") or {}
    return next(iter(properties)) if len(properties) == 1 else "input"


class DigitChatFormat(ChatFormat):
    """The embedded default's format, for its digit tokenizer (:mod:`miles_core.default.tokenizer`), which has no
    chat template and no role tokens: the format uses the tokens it has.

    - A message is ``<bos> R : content <eos>``, where the digit ``R`` names the role (``0`` system, ``1`` user,
      ``2`` assistant, ``3`` tool); the generation prompt is ``<bos> 2 :``, and the model ends its turn with
      ``<eos>`` (a turn cut at the length limit is closed with one, loss mask 0).
    - Content is digits and ``:`` only (the tokenizer's alphabet); other characters are a :class:`ChatFormatError`.
    - The first ``:`` token in an assistant turn starts its tool calls: ``:K:A`` (repeatable) calls tool number
      ``K`` of the request's ``tools`` with the argument digits ``A``, given as ``{"PARAM": "A"}`` where ``PARAM``
      is the tool's only parameter (``"input"`` when it has none or several). What precedes is the content. The
      tool's position is the model's name for it, which differs from the callable's name (the tools list maps
      one to the other); without ``tools`` the name is the number itself.
    """

    name = "default"
    ROLE_DIGITS = {"system": "0", "user": "1", "assistant": "2", "tool": "3"}

    def __init__(self, tokenizer: Any = None) -> None:
        self.pad, self.eos, self.bos = (SPECIALS.index(t) for t in ("<pad>", "<eos>", "<bos>"))
        self.ids = {char: index + len(SPECIALS) for index, char in enumerate(CHARACTERS)}
        self.chars = {index: char for char, index in self.ids.items()}
        self.colon = self.ids[":"]
        if tokenizer is not None:
            self._check_tokenizer(tokenizer)

    def _check_tokenizer(self, tokenizer: Any) -> None:
        try:  # DigitTokenizer's encode takes add_bos; an HF tokenizer (the default's files) add_special_tokens
            ids = list(tokenizer.encode(CHARACTERS, add_special_tokens=False))
        except TypeError:
            ids = list(tokenizer.encode(CHARACTERS, add_bos=False))
        if ids != [self.ids[char] for char in CHARACTERS] or getattr(tokenizer, "eos_token_id", None) != self.eos:
            raise ChatFormatError(
                f"chat format 'default' is for the embedded default's digit tokenizer ({CHARACTERS!r} as ids 3-13, "
                f"<eos> 1); this tokenizer encodes {CHARACTERS!r} as {ids[:20]}: pick the chat format of its model"
            )

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` (digits and ``:``)."""
        unknown = sorted(set(text) - set(self.ids))
        if unknown:
            raise ChatFormatError(
                f"chat format 'default' can only write {CHARACTERS!r}; the text {text[:80]!r} has {unknown[:10]}"
            )
        return [self.ids[char] for char in text]

    def decode(self, ids: Sequence[int]) -> str:
        """The characters of ``ids`` (special tokens skipped)."""
        return "".join(self.chars.get(token, "") for token in ids)

    def render_messages(
        self, messages: Sequence[ChatMessage], *, tools: Sequence[Tool] = (), add_generation_prompt: bool
    ) -> list[int]:
        ids: list[int] = []
        for message in messages:
            ids += [self.bos, self.ids[self.ROLE_DIGITS[message.role]], self.colon, *self.encode(message.content)]
            for call in message.tool_calls:
                ids += [self.colon, *self.encode(self._tool_number(call.name, tools)), self.colon]
                ids += self.encode(self._argument_digits(call))
            ids.append(self.eos)
        if add_generation_prompt:
            ids += [self.bos, self.ids[self.ROLE_DIGITS["assistant"]], self.colon]
        return ids

    def close_turn(self, generated: Sequence[int]) -> list[int]:
        return [] if generated and generated[-1] == self.eos else [self.eos]

    def parse_tool_calls(self, output_ids: Sequence[int], *, tools: Sequence[Tool] = ()) -> tuple[str, list[ToolCall]]:
        ids = list(output_ids)
        if self.eos in ids:
            ids = ids[: ids.index(self.eos)]
        ids = [token for token in ids if token in self.chars]  # <bos>/<pad> sampled mid-turn carry no text
        if self.colon not in ids:
            return self.decode(ids), []
        start = ids.index(self.colon)
        parts = self.decode(ids[start + 1 :]).split(":")
        if len(parts) % 2 or not all(parts):
            return self.decode(ids), []  # not a well-formed :K:A sequence: plain content
        calls = []
        for number, argument in zip(parts[::2], parts[1::2], strict=True):
            tool = tools[int(number)] if int(number) < len(tools) else None
            name = tool_name(tool) if tool is not None else number
            calls.append(ToolCall(name=name, arguments=json.dumps({_single_argument(tool): argument})))
        return self.decode(ids[:start]), calls

    def _tool_number(self, name: str, tools: Sequence[Tool]) -> str:
        for index, tool in enumerate(tools):
            if tool_name(tool) == name:
                return str(index)
        if name.isascii() and name.isdigit():
            return name
        raise ChatFormatError(
            f"chat format 'default' names a tool by its position in tools; {name!r} is not one of "
            f"{[tool_name(t) for t in tools]}"
        )

    def _argument_digits(self, call: ToolCall) -> str:
        try:
            arguments = json.loads(call.arguments)
        except ValueError:
            arguments = None
        values = list(arguments.values()) if isinstance(arguments, dict) else []
        if len(values) != 1 or not str(values[0]).isdigit():
            raise ChatFormatError(
                f"chat format 'default' writes a tool call's one digit-string argument; {call.name!r} has "
                f"arguments {call.arguments[:80]!r}"
            )
        return str(values[0])


QWEN3_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN3_TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


class Qwen3ChatFormat(ChatFormat):
    """Qwen3's chat format: ``<|im_start|>ROLE\\ncontent<|im_end|>\\n`` per message, the tools described in the
    system message, tool calls as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` in the
    assistant's turn, consecutive tool results in one ``user`` message as ``<tool_response>`` blocks, and
    ``<|im_start|>assistant\\n`` as the generation prompt (``enable_thinking=False`` adds Qwen3's empty think block).

    It renders as Qwen3's official template does, but for the assistant's reasoning, which makes it append-only: an
    assistant message is its content as generated, ``<think>`` block included, wherever it stands (the official
    template drops the block of a turn once a new user message follows it, and writes an empty one into the last
    turn, which would change tokens the model generated). Reasoning is not split into ``reasoning_content``.

    The tokenizer must have ``<|im_start|>``, ``<|im_end|>``, ``<tool_call>`` and ``</tool_call>`` as single tokens
    (Qwen3's do); the tool-call delimiters are found as those ids in the output.
    """

    name = "qwen3"
    TOKENS = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")

    def __init__(self, tokenizer: Any, *, enable_thinking: bool = True) -> None:
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        advice = "use the tokenizer of a Qwen3 checkpoint, or another chat format"
        ids = {token: single_token_id(tokenizer, token, chat_format="qwen3", advice=advice) for token in self.TOKENS}
        self.im_start, self.im_end = ids["<|im_start|>"], ids["<|im_end|>"]
        self.call_start, self.call_end = ids["<tool_call>"], ids["</tool_call>"]
        self.newline = list(tokenizer.encode("\n", add_special_tokens=False))
        end_ids = {self.im_end, *token_ids_if_single(tokenizer, "<|endoftext|>")}
        self.hermes = HermesToolCalls(tokenizer, call_start=self.call_start, call_end=self.call_end, end_ids=end_ids)

    def render_text(
        self, messages: Sequence[ChatMessage], *, tools: Sequence[Tool] = (), add_generation_prompt: bool
    ) -> str:
        """The conversation as Qwen3's template writes it (before tokenization)."""
        parts: list[str] = []
        first_system = bool(messages) and messages[0].role == "system"
        if tools:
            system = messages[0].content + "\n\n" if first_system else ""
            described = "".join("\n" + json.dumps(dict(tool), ensure_ascii=False) for tool in tools)
            parts.append(
                f"<|im_start|>system\n{system}{QWEN3_TOOLS_PREAMBLE}{described}{QWEN3_TOOLS_POSTAMBLE}<|im_end|>\n"
            )
        elif first_system:
            parts.append(f"<|im_start|>system\n{messages[0].content}<|im_end|>\n")
        for index, message in enumerate(messages):
            if index == 0 and first_system:
                continue
            if message.role in ("user", "system"):
                parts.append(f"<|im_start|>{message.role}\n{message.content}<|im_end|>\n")
            elif message.role == "assistant":
                parts.append(f"<|im_start|>assistant\n{message.content}{self._calls_text(message)}<|im_end|>\n")
            else:  # tool: consecutive results share one user message
                previous_tool = index > 0 and messages[index - 1].role == "tool"
                next_tool = index + 1 < len(messages) and messages[index + 1].role == "tool"
                parts.append(
                    ("" if previous_tool else "<|im_start|>user")
                    + f"\n<tool_response>\n{message.content}\n</tool_response>"
                    + ("" if next_tool else "<|im_end|>\n")
                )
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n" + ("" if self.enable_thinking else "<think>\n\n</think>\n\n"))
        return "".join(parts)

    @staticmethod
    def _calls_text(message: ChatMessage) -> str:
        text = ""
        for index, call in enumerate(message.tool_calls):
            if index or message.content:
                text += "\n"
            text += f'<tool_call>\n{{"name": "{call.name}", "arguments": {call.arguments}}}\n</tool_call>'
        return text

    def render_messages(
        self, messages: Sequence[ChatMessage], *, tools: Sequence[Tool] = (), add_generation_prompt: bool
    ) -> list[int]:
        text = self.render_text(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def close_turn(self, generated: Sequence[int]) -> list[int]:
        ended = bool(generated) and generated[-1] == self.im_end
        return [*([] if ended else [self.im_end]), *self.newline]

    def parse_tool_calls(self, output_ids: Sequence[int], *, tools: Sequence[Tool] = ()) -> tuple[str, list[ToolCall]]:
        return self.hermes.parse(output_ids)


class HermesToolCalls:
    """Tool calls as Hermes-style templates write them (Qwen2.5, Qwen3, Hermes): ``<tool_call>`` JSON
    ``{"name": ..., "arguments": {...}}`` ``</tool_call>``, found on token ids (the tokenizer must hold both tags as
    single tokens), so that the tags spelled out in ordinary text are not a call."""

    def __init__(self, tokenizer: Any, *, call_start: int, call_end: int, end_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.call_start, self.call_end, self.end_ids = call_start, call_end, end_ids

    def parse(self, output_ids: Sequence[int]) -> tuple[str, list[ToolCall]]:
        """The content text and the tool calls of a generated turn; an unreadable call stays in the content."""
        ids = list(output_ids)
        while ids and ids[-1] in self.end_ids:
            ids.pop()
        content: list[list[int]] = [[]]
        calls: list[ToolCall] = []
        position = 0
        while position < len(ids):
            if ids[position] == self.call_start and self.call_end in ids[position + 1 :]:
                end = ids.index(self.call_end, position + 1)
                call = self._read_call(ids[position + 1 : end])
                if call is None:  # unreadable: it stays in the content as text
                    content[-1] += ids[position : end + 1]
                else:
                    calls.append(call)
                    content.append([])
                position = end + 1
            else:
                content[-1].append(ids[position])
                position += 1
        text = "".join(self.tokenizer.decode(piece, skip_special_tokens=False) for piece in content)
        return (text.strip() if calls else text), calls

    def _read_call(self, ids: list[int]) -> ToolCall | None:
        try:
            body = parse_json(self.tokenizer.decode(ids, skip_special_tokens=False), subject="tool call")
        except HttpError:
            return None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return None
        arguments = body.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        return ToolCall(name=body["name"], arguments=json.dumps(arguments, ensure_ascii=False))


def single_token_id(tokenizer: Any, token: str, *, chat_format: str, advice: str) -> int:
    """``token``'s id in ``tokenizer``; a :class:`ChatFormatError` (naming the format, the ids, and ``advice``) when
    the tokenizer does not hold it as one token."""
    encoded = list(tokenizer.encode(token, add_special_tokens=False))
    if len(encoded) != 1:
        raise ChatFormatError(
            f"chat format {chat_format!r} needs {token!r} as one token; this tokenizer encodes it as {encoded[:8]}: "
            + advice
        )
    return encoded[0]


def token_ids_if_single(tokenizer: Any, token: str) -> list[int]:
    """``token``'s id if the tokenizer has it as one token (else none)."""
    encoded = list(tokenizer.encode(token, add_special_tokens=False))
    return encoded if len(encoded) == 1 else []
