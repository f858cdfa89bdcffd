"""The client dialects a session server speaks: one assistant turn, asked and answered in each API's own shape.

An agent framework talks to the model through an SDK; the session server answers that SDK as its own API would
while keeping the session token-in-token-out (:mod:`miles_core.rollout.sessions.formats`). A :class:`Dialect`
translates one request body into a :class:`TurnRequest` (the whole conversation as
:class:`~miles_core.rollout.sessions.formats.ChatMessage` s, the tools in OpenAI's function shape, the turn's token
limit) and one generated turn (:class:`TurnAnswer`) into the dialect's answer: a JSON body, or the dialect's own
server-sent event stream. The session, the history check and the generation are the server's and the same for all.

The dialects (each a route under a session's ``base_url``):

- ``chat_completions``: OpenAI's Chat Completions, ``POST .../v1/chat/completions``
  (:mod:`~miles_core.rollout.sessions.chat_completions`);
- ``responses``: OpenAI's Responses, ``POST .../v1/responses``
  (:mod:`~miles_core.rollout.sessions.responses_api`);
- ``messages``: Anthropic's Messages, ``POST .../v1/messages``, what ``anthropic.AsyncAnthropic(base_url=...)``
  posts to when given the session's URL without ``/v1`` (:mod:`~miles_core.rollout.sessions.anthropic_messages`).

A streamed answer is the whole turn's events sent when the turn is generated (the session server samples a turn in
one engine request, batched with other sessions' turns): each SDK's stream reader takes it as a stream.
"""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pydantic
from starlette.responses import JSONResponse, Response, StreamingResponse

from miles_core.engines.openai_errors import OpenAIError, error_response
from miles_core.rollout.sessions.formats import ChatMessage, Tool, ToolCall

if TYPE_CHECKING:
    from miles_core.rollout.sessions.session import Session


@dataclasses.dataclass(frozen=True)
class TurnRequest:
    """One request for an assistant turn, whatever its dialect: the whole conversation the client sent (the
    session's messages first), the tools in OpenAI's ``{"type": "function", "function": {...}}`` shape, the
    request's own limit on the turn's new tokens, and whether it asked for a stream."""

    messages: list[ChatMessage]
    tools: list[Tool]
    turn_limit: int | None
    model: str
    stream: bool = False
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What the dialect needs again to answer (OpenAI's ``stream_options.include_usage``, the Responses API's
    echoed fields)."""


@dataclasses.dataclass(frozen=True)
class TurnAnswer:
    """One generated assistant turn: its text, its tool calls (ids given by the server), why it ended (``"stop"``:
    the model ended its turn; ``"length"``: the token limit), and the token counts; ``answer_id`` is the id of the
    dialect's answer (``chatcmpl-...``, ``resp_...``, ``msg_...``)."""

    answer_id: str
    content: str
    calls: list[ToolCall]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    created: int


class Dialect(ABC):
    """One client API of the session server (see the module docstring)."""

    name: str = "?"
    id_prefix: str = "?"
    """The prefix of the answer ids (``chatcmpl-``, ``resp_``, ``msg_``)."""
    call_id_prefix: str = "call_"
    """The prefix of the tool-call ids the server gives (``toolu_`` for Anthropic's clients)."""

    @abstractmethod
    def parse(self, body: dict, session: Session) -> TurnRequest:
        """The request ``body`` as a :class:`TurnRequest` (an :class:`OpenAIError` 400 naming the field at fault);
        ``session`` is the session it asks a turn of (for dialects whose requests refer to earlier answers)."""

    @abstractmethod
    def answer(self, request: TurnRequest, turn: TurnAnswer) -> dict:
        """The dialect's JSON answer of ``turn``."""

    @abstractmethod
    def events(self, request: TurnRequest, turn: TurnAnswer) -> Iterator[str]:
        """The dialect's server-sent events of ``turn``, each a whole ``event:``/``data:`` block."""

    def error(self, exc: OpenAIError) -> Response:
        """A refusal in the dialect's error shape (OpenAI's by default)."""
        return error_response(exc.status, str(exc), param=exc.param, code=exc.code)

    def response(self, request: TurnRequest, turn: TurnAnswer) -> Response:
        """The HTTP answer of ``turn``: the JSON body, or the event stream when the request asked for one."""
        if request.stream:
            return StreamingResponse(
                list(self.events(request, turn)),  # made whole first: a defect is a 500, not a stream cut short
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        return JSONResponse(self.answer(request, turn))


def sse(data: Any, *, event: str | None = None) -> str:
    """One server-sent event: ``event: NAME`` (when given) and ``data: JSON``."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"


def validated_part(model: type[pydantic.BaseModel], raw: dict, *, where: str, kind: str) -> Any:
    """One item or content block of a request as ``model``, or a 400 naming it (``where``: ``input.3``) and its
    field. Null fields are left out first: a client resends an item it received with its own model's fields, null
    where this server's answer had none."""
    try:
        return model.model_validate({key: value for key, value in raw.items() if value is not None})
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"])
        raise OpenAIError(400, f"{where} ({kind}).{field}: {error['msg']}", param=f"{where}.{field}") from None


def arguments_object(arguments: str, *, param: str) -> dict:
    """A tool call's arguments, which must be a JSON object's text (a 400 naming ``param`` otherwise)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise OpenAIError(
            400, f"{param}: a tool call's arguments must be a JSON object, got {arguments[:80]!r}", param=param
        )
    return value


def check_new_messages(messages: Sequence[ChatMessage], *, first_new: int) -> None:
    """The checks of a request's new messages (``messages[first_new:]``; the session's own were checked by
    equality): a tool call's arguments are a JSON object, and every tool result answers a call an assistant message
    before it made, by the call's id. A result for an unknown call (another session's, a mistyped id) is a 400, not
    a message the policy would read as the answer to its own call. (The session's prompt, the run's, is taken as it
    is.)"""
    made: set[str] = set()
    for index, message in enumerate(messages):
        for number, call in enumerate(message.tool_calls):
            if index >= first_new:
                arguments_object(call.arguments, param=f"messages.{index}.tool_calls.{number}.arguments")
            made.add(call.id)
        named = message.tool_call_id is not None  # a tool message naming no call is taken as before (Chat Completions)
        if index >= first_new and message.role == "tool" and named and message.tool_call_id not in made:
            raise OpenAIError(
                400,
                f"a tool result (message {index} of the conversation) answers call {str(message.tool_call_id)[:64]!r}, "
                "which no assistant turn of this session made: answer the calls of the session's own turns, by their "
                "ids",
                param=f"messages.{index}",
                code="unknown_tool_call",
            )


def openai_tools(tools: Iterable[Tool]) -> list[Tool]:
    """Tools as the chat formats read them (OpenAI's function shape, ``None`` fields left out)."""
    return [
        {"type": "function", "function": {key: value for key, value in tool["function"].items() if value is not None}}
        for tool in tools
    ]
