"""Token-in-token-out (TITO) chat formats: a conversation as token ids, grown turn by turn without retokenizing.

A multi-turn rollout alternates between the model (an assistant turn, generated as token ids) and its environment
(tool results, user messages, given as text). Decoding the model's ids to text and encoding the whole conversation
again would change them: a tokenizer that merges ``"1"`` ``"2"`` into ``"12"`` re-encodes two generated tokens as
one, and the trainer would then score ids the engine never sampled. A :class:`ChatFormat` therefore never
re-renders an assistant turn: :meth:`ChatFormat.append` adds the tokens of the *new* messages after the exact ids of
the conversation so far.

The tokens it adds are what the format's whole-conversation rendering (:meth:`ChatFormat.render_messages`) puts
after the messages already held. That is only sound for a format whose rendering of ``k + 1`` messages starts with
its rendering of ``k`` messages (*append-only*); :meth:`ChatFormat.append` checks it on every call, and a format that
breaks it (Qwen3's official template drops the ``<think>`` block of earlier turns once a new user message comes)
raises :class:`ChatFormatError` naming the format and the first differing position, instead of silently
retokenizing. :func:`check_append_only` checks a whole conversation at once.

Tool calls are parsed from the output *ids* (:meth:`ChatFormat.parse_tool_calls`): the delimiters are found as
token ids, so a tool call's text that happens to appear inside ordinary content is not a call.

The formats themselves (the embedded default's, Qwen3's) are built-in plugins, in
:mod:`miles_core.builtin.chat_formats`.
"""

from __future__ import annotations

import dataclasses
import itertools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from miles_core.errors import MilesError

ROLES = ("system", "user", "assistant", "tool")
"""The roles a :class:`ChatMessage` may have (OpenAI's ``developer`` is read as ``system``)."""


class ChatFormatError(MilesError):
    """A conversation the format cannot render as tokens: an unknown character or role, a tokenizer without the
    format's special tokens, or a rendering that is not append-only (its message names the format and the first
    differing token position)."""


class ChatFormatWarning(UserWarning):
    """A conversation the format renders, but not as the session holds it: a chat template that re-renders earlier
    turns differently once later messages follow (their reasoning dropped, whitespace changed). ``summary`` names the
    format and the turn (the same for every session it happens in), ``detail`` shows the two texts. The session keeps
    its tokens as sampled and records the warning in its trajectory's ``notes``; the run reports each summary once."""

    def __init__(self, summary: str, detail: str) -> None:
        super().__init__(f"{summary}: {detail}")
        self.summary, self.detail = summary, detail


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One tool call: the function's ``name`` and its ``arguments`` as a JSON text (OpenAI's
    ``tool_calls[i].function``); ``id`` is the call's id in the OpenAI answer (empty until the server gives one)."""

    name: str
    arguments: str
    id: str = ""


@dataclasses.dataclass(frozen=True)
class ChatMessage:
    """One chat message as the formats see it: ``role`` one of :data:`ROLES`, ``content`` text, the assistant's
    ``tool_calls``, a tool result's ``tool_call_id``, an optional author ``name``, and the assistant's
    ``reasoning`` for a format that writes it apart from the content (Inkling's thinking blocks; the others keep
    reasoning inside ``content`` as the model wrote it)."""

    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ChatFormatError(f"message role {self.role!r} is not one of {', '.join(ROLES)}")


Tool = Mapping[str, Any]
"""A tool as OpenAI's ``tools`` list gives it: ``{"type": "function", "function": {"name", "description",
"parameters"}}``."""


def tool_name(tool: Tool) -> str:
    """The function name of an OpenAI tool entry."""
    return str(tool.get("function", {}).get("name", ""))


class ChatFormat(ABC):
    """How one model family turns a conversation into token ids and back (see the module docstring).

    A subclass implements :meth:`render_messages` (the whole conversation, as the model's chat template renders
    it), :meth:`close_turn` (what ends a generated assistant turn the way the rendering ends it) and
    :meth:`parse_tool_calls`; :meth:`render` and :meth:`append` are built on them, with the append-only check.
    """

    name: str = "?"

    @abstractmethod
    def render_messages(
        self, messages: Sequence[ChatMessage], *, tools: Sequence[Tool] = (), add_generation_prompt: bool
    ) -> list[int]:
        """The token ids of ``messages`` (and the tools' description, if the format has one), followed by the
        prompt of an assistant turn when ``add_generation_prompt``."""

    @abstractmethod
    def close_turn(self, generated: Sequence[int]) -> list[int]:
        """The tokens to put after a generated assistant turn (the engine's output ids, ``generated``) so that it
        ends as :meth:`render_messages` ends an assistant message: usually the end-of-turn token when the engine
        stopped at the length limit, and whatever the template writes after it."""

    @abstractmethod
    def parse_tool_calls(self, output_ids: Sequence[int], *, tools: Sequence[Tool] = ()) -> tuple[str, list[ToolCall]]:
        """The content text and the tool calls of one generated assistant turn, found on its token ids. A call the
        format cannot read (malformed JSON, say) stays in the content as text, as SGLang's parsers keep it."""

    def render(self, messages: Sequence[ChatMessage], *, tools: Sequence[Tool] = ()) -> list[int]:
        """The prompt ids of a conversation: its messages, then the generation prompt of the assistant."""
        return self.render_messages(messages, tools=tools, add_generation_prompt=True)

    def append(
        self,
        ids_so_far: Sequence[int],
        new_messages: Sequence[ChatMessage],
        *,
        history: Sequence[ChatMessage],
        tools: Sequence[Tool] = (),
    ) -> list[int]:
        """``ids_so_far`` (the exact ids of ``history``: its assistant turns as the engine generated them), then the
        tokens that close its last assistant turn, the tokens of ``new_messages`` and the generation prompt.

        The tokens added are those the rendering of ``history + new_messages`` has after the rendering of
        ``history``; a rendering that does not start with it is a :class:`ChatFormatError` (not append-only)."""
        before = self.render_messages(history, tools=tools, add_generation_prompt=False)
        after = self.render_messages([*history, *new_messages], tools=tools, add_generation_prompt=True)
        position = first_difference(before, after)
        if position is not None:
            raise ChatFormatError(
                f"chat format {self.name!r} is not append-only: its rendering of {len(history) + len(new_messages)} "
                f"messages differs from its rendering of the first {len(history)} at token {position} "
                f"({_around(before, position)} became {_around(after, position)}); appending would silently "
                "retokenize the conversation: use a format whose rendering only appends (TITO)"
            )
        bridge = self.close_turn(ids_so_far) if history and history[-1].role == "assistant" else []
        return [*ids_so_far, *bridge, *after[len(before) :]]


def first_difference(prefix: Sequence[int], ids: Sequence[int]) -> int | None:
    """The first position where ``ids`` does not continue ``prefix`` (``None``: ``ids`` starts with it)."""
    for position, token in enumerate(prefix):
        if position >= len(ids) or ids[position] != token:
            return position
    return None


def _around(ids: Sequence[int], position: int) -> str:
    return str(list(ids[max(0, position - 2) : position + 3]))


def check_append_only(fmt: ChatFormat, messages: Sequence[ChatMessage], *, tools: Sequence[Tool] = ()) -> None:
    """Check that ``fmt`` renders ``messages`` append-only at the points where a session grows the conversation:
    each assistant message begins where the generation prompt before it ends, and the rendering up to each later
    turn (and of the whole) starts with the rendering up to the assistant message before it. (Between two turns a
    format may join messages, as Qwen3 joins consecutive tool results in one block: they are appended together.)
    The first break is a :class:`ChatFormatError` naming the format, the messages and the token position."""
    turns = [index for index, message in enumerate(messages) if message.role == "assistant"]
    for index in turns:
        prompt = fmt.render_messages(messages[:index], tools=tools, add_generation_prompt=True)
        after = fmt.render_messages(messages[: index + 1], tools=tools, add_generation_prompt=False)
        _check_prefix(fmt, prompt, after, f"assistant message {index} does not begin after its generation prompt")
    boundaries = [0, *(index + 1 for index in turns), len(messages)]
    for start, stop in itertools.pairwise(boundaries):
        if stop > start:
            before = fmt.render_messages(messages[:start], tools=tools, add_generation_prompt=False)
            after = fmt.render_messages(messages[:stop], tools=tools, add_generation_prompt=False)
            what = f"adding messages {start} to {stop - 1} ({messages[stop - 1].role} last) changes the first {start}"
            _check_prefix(fmt, before, after, what)


def _check_prefix(fmt: ChatFormat, before: list[int], after: list[int], what: str) -> None:
    position = first_difference(before, after)
    if position is not None:
        raise ChatFormatError(
            f"chat format {fmt.name!r} is not append-only: {what} at token {position} "
            f"({_around(before, position)} became {_around(after, position)})"
        )
