"""Anthropic's Messages API as a session-server dialect: ``POST {base_url}/messages``, what
``anthropic.AsyncAnthropic(base_url=<the session's URL without /v1>, api_key=...)`` sends
(:func:`~miles_core.rollout.agents.anthropic_base_url` gives that URL).

Taken: ``system`` (a string or text blocks), ``messages`` whose content is a string or blocks (``text``, ``tool_use``
with an ``input`` object, ``tool_result`` answering a ``tool_use`` by its id, and ``thinking`` /
``redacted_thinking`` resent by the client, taken and not compared: the session holds the sampled tokens), ``tools``
(``name``, ``description``, ``input_schema``), ``max_tokens`` (required, as Anthropic requires it),
``tool_choice`` ``auto``, ``stream``; ``temperature``, ``top_p``, ``top_k`` and ``metadata`` are accepted and
ignored (the run's sampling settings hold). The answer is a ``message`` with ``text`` and ``tool_use`` blocks and a
``stop_reason`` (``end_turn``, ``tool_use``, ``max_tokens``); ``stream: true`` answers in Anthropic's event stream
(``message_start``, ``content_block_*``, ``message_delta``, ``message_stop``), as ``client.messages.stream(...)``
reads it. Refusals are in Anthropic's error shape, ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import pydantic
from starlette.responses import JSONResponse, Response

from miles_core.engines.openai_errors import OpenAIError
from miles_core.rollout.sessions.api import MAX_MESSAGES, StrictBody, validated
from miles_core.rollout.sessions.dialects import Dialect, TurnAnswer, TurnRequest, openai_tools, sse, validated_part
from miles_core.rollout.sessions.formats import ChatMessage, ToolCall

if TYPE_CHECKING:
    from miles_core.rollout.sessions.session import Session

BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    502: "api_error",
    503: "overloaded_error",
}
"""Anthropic's error ``type`` per status."""


class TextBlock(StrictBody):
    type: Literal["text"]
    text: str
    citations: list[Any] | None = pydantic.Field(default=None, max_length=0)
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(StrictBody):
    type: Literal["tool_use"]
    id: str = pydantic.Field(min_length=1, max_length=256)
    name: str = pydantic.Field(min_length=1, max_length=256)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(StrictBody):
    type: Literal["tool_result"]
    tool_use_id: str = pydantic.Field(min_length=1, max_length=256)
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(StrictBody):
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


BLOCK_MODELS: dict[str, type[StrictBody]] = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": ThinkingBlock,
}


class MessageParam(StrictBody):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolParam(StrictBody):
    name: str = pydantic.Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(StrictBody):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(StrictBody):
    """``POST /sessions/<id>/v1/messages`` (see the module docstring); the blocks are read one by one."""

    model: str = pydantic.Field(max_length=1024)
    max_tokens: int = pydantic.Field(ge=1)
    messages: list[MessageParam] = pydantic.Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = pydantic.Field(default=None, max_length=256)
    tool_choice: ToolChoice | None = None
    stream: bool = False
    temperature: float | None = pydantic.Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = pydantic.Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = pydantic.Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None


class MessagesDialect(Dialect):
    """Anthropic's Messages API (see the module docstring)."""

    name = "messages"
    id_prefix = "msg_"
    call_id_prefix = "toolu_"

    def parse(self, body: dict, session: Session) -> TurnRequest:
        request: MessagesRequest = validated(MessagesRequest, body)
        messages = _system(request.system)
        for index, message in enumerate(request.messages):
            messages += _messages_of(message, index)
        tools = [{"function": _function(tool)} for tool in request.tools or []]
        return TurnRequest(
            messages=messages,
            tools=openai_tools(tools),
            turn_limit=request.max_tokens,
            model=request.model,
            stream=request.stream,
        )

    def answer(self, request: TurnRequest, turn: TurnAnswer) -> dict:
        return {**self._message(request, turn), "content": _blocks(turn), "stop_reason": _stop_reason(turn)}

    def events(self, request: TurnRequest, turn: TurnAnswer) -> Iterator[str]:
        def event(kind: str, **fields: Any) -> str:
            return sse({"type": kind, **fields}, event=kind)

        start = {**self._message(request, turn), "content": [], "stop_reason": None}
        start["usage"] = {**start["usage"], "output_tokens": 0}
        yield event("message_start", message=start)
        for index, block in enumerate(_blocks(turn)):
            if block["type"] == "text":
                yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                delta = {"type": "text_delta", "text": block["text"]}
            else:
                yield event("content_block_start", index=index, content_block={**block, "input": {}})
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
            yield event("content_block_delta", index=index, delta=delta)
            yield event("content_block_stop", index=index)
        usage = {"output_tokens": turn.completion_tokens}
        yield event("message_delta", delta={"stop_reason": _stop_reason(turn), "stop_sequence": None}, usage=usage)
        yield event("message_stop")

    def error(self, exc: OpenAIError) -> Response:
        kind = ERROR_TYPES.get(exc.status, "api_error")
        return JSONResponse({"type": "error", "error": {"type": kind, "message": str(exc)}}, status_code=exc.status)

    @staticmethod
    def _message(request: TurnRequest, turn: TurnAnswer) -> dict:
        return {
            "id": turn.answer_id,
            "type": "message",
            "role": "assistant",
            "model": request.model,
            "stop_sequence": None,
            "usage": {"input_tokens": turn.prompt_tokens, "output_tokens": turn.completion_tokens},
        }


def _system(system: str | list[TextBlock] | None) -> list[ChatMessage]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "".join(block.text for block in system)
    return [ChatMessage(role="system", content=text)]


def _function(tool: ToolParam) -> dict:
    return {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}


def _messages_of(message: MessageParam, index: int) -> list[ChatMessage]:
    """One Anthropic message as chat messages: an assistant's text and ``tool_use`` blocks are one turn; a user's
    ``tool_result`` blocks are tool messages, its text blocks one user message (in the order they come)."""
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    blocks = [_block(raw, index, number) for number, raw in enumerate(message.content)]
    if message.role == "assistant":
        for number, block in enumerate(blocks):
            if isinstance(block, ToolResultBlock):
                raise OpenAIError(
                    400, "a tool_result block belongs in a user message", param=f"messages.{index}.content.{number}"
                )
        text = "".join(block.text for block in blocks if isinstance(block, TextBlock))
        calls = tuple(
            ToolCall(name=b.name, arguments=_arguments(b.input), id=b.id) for b in blocks if isinstance(b, ToolUseBlock)
        )
        return [ChatMessage(role="assistant", content=text, tool_calls=calls)]
    messages: list[ChatMessage] = []
    for number, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            content = block.content if isinstance(block.content, str) else "".join(b.text for b in block.content)
            messages.append(ChatMessage(role="tool", content=content, tool_call_id=block.tool_use_id))
        elif isinstance(block, TextBlock):
            if messages and messages[-1].role == "user":
                messages[-1] = ChatMessage(role="user", content=messages[-1].content + block.text)
            else:
                messages.append(ChatMessage(role="user", content=block.text))
        else:
            raise OpenAIError(
                400,
                f"messages[{index}].content[{number}]: a {block.type} block belongs in an assistant message",
                param=f"messages.{index}.content.{number}",
            )
    return messages


def _block(raw: Any, index: int, number: int) -> StrictBody:
    where = f"messages.{index}.content.{number}"
    kind = raw.get("type") if isinstance(raw, dict) else None
    model = BLOCK_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise OpenAIError(
            400,
            f"{where}: unknown content block type {kind!r:.80}: the session server takes {', '.join(BLOCK_TYPES)}",
            param=f"{where}.type",
        )
    return validated_part(model, raw, where=where, kind=kind)


def _arguments(value: dict[str, Any]) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def _stop_reason(turn: TurnAnswer) -> str:
    return "tool_use" if turn.calls else ("end_turn" if turn.finish_reason == "stop" else "max_tokens")


def _blocks(turn: TurnAnswer) -> list[dict]:
    blocks: list[dict] = [{"type": "text", "text": turn.content}] if turn.content or not turn.calls else []
    for call in turn.calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)})
    return blocks
