"""OpenAI's Responses API as a session-server dialect: ``POST {base_url}/responses``, what
``openai.AsyncOpenAI(base_url=...).responses.create`` sends.

Taken: ``input`` (a string, or items: messages with ``input_text``/``output_text`` parts, ``function_call``,
``function_call_output``, ``reasoning``), ``instructions`` (the conversation's system message), function ``tools``,
``max_output_tokens``, ``previous_response_id`` (the session's latest answer: ``input`` then holds only the new
items), ``stream``; the fields agents send that change nothing here (``store``, ``temperature``, ``top_p``,
``metadata``, ``include``, ``truncation``, ...) are accepted and ignored, and the session's sampling settings are the
run's. The answer is a ``response`` whose ``output`` holds a ``message`` item with the text and a ``function_call``
item per tool call; a turn cut at the token limit is ``"status": "incomplete"`` with reason ``max_output_tokens``.
``stream: true`` answers in the Responses event stream (``response.created`` ... ``response.completed``, or
``response.incomplete``), as ``client.responses.stream(...)`` reads it.

A ``reasoning`` item resent as input is the client's copy of tokens the session already holds as sampled: it is
taken and not compared (the session keeps the exact ids of every turn).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import pydantic

from miles_core.engines.openai_errors import OpenAIError
from miles_core.rollout.sessions.api import MAX_MESSAGES, StrictBody, canonical_arguments, validated
from miles_core.rollout.sessions.dialects import Dialect, TurnAnswer, TurnRequest, openai_tools, sse, validated_part
from miles_core.rollout.sessions.formats import ChatMessage, ToolCall

if TYPE_CHECKING:
    from miles_core.rollout.sessions.session import Session

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
PART_TYPES = ("input_text", "output_text")


class FunctionTool(StrictBody):
    type: Literal["function"]
    name: str = pydantic.Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(StrictBody):
    """``POST /sessions/<id>/v1/responses`` (see the module docstring); ``input`` is read item by item."""

    model: str = pydantic.Field(max_length=1024)
    input: str | list[dict[str, Any]] = pydantic.Field(max_length=MAX_MESSAGES)
    instructions: str | None = None
    tools: list[FunctionTool] | None = pydantic.Field(default=None, max_length=256)
    tool_choice: Literal["auto"] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = pydantic.Field(default=None, ge=1)
    previous_response_id: str | None = pydantic.Field(default=None, max_length=256)
    stream: bool = False
    # accepted, changing nothing: the run's sampling settings hold; nothing is stored beyond the session
    store: bool | None = None
    temperature: float | None = pydantic.Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = pydantic.Field(default=None, gt=0.0, le=1.0)
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    user: str | None = pydantic.Field(default=None, max_length=1024)
    prompt_cache_key: str | None = pydantic.Field(default=None, max_length=1024)
    service_tier: str | None = pydantic.Field(default=None, max_length=64)


class TextPart(StrictBody):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = pydantic.Field(default=None, max_length=0)
    logprobs: list[Any] | None = None


class MessageItem(StrictBody):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    id: str | None = pydantic.Field(default=None, max_length=256)
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(StrictBody):
    type: Literal["function_call"]
    call_id: str = pydantic.Field(min_length=1, max_length=256)
    name: str = pydantic.Field(min_length=1, max_length=256)
    arguments: str
    id: str | None = pydantic.Field(default=None, max_length=256)
    status: str | None = None


class FunctionCallOutputItem(StrictBody):
    type: Literal["function_call_output"]
    call_id: str = pydantic.Field(min_length=1, max_length=256)
    output: str | list[TextPart]
    id: str | None = pydantic.Field(default=None, max_length=256)
    status: str | None = None


class ReasoningItem(StrictBody):
    type: Literal["reasoning"]
    id: str | None = pydantic.Field(default=None, max_length=256)
    summary: list[dict[str, Any]] = pydantic.Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


ITEM_MODELS: dict[str, type[StrictBody]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class ResponsesDialect(Dialect):
    """OpenAI's Responses API (see the module docstring)."""

    name = "responses"
    id_prefix = "resp_"

    def parse(self, body: dict, session: Session) -> TurnRequest:
        request: ResponsesRequest = validated(ResponsesRequest, body)
        items = [{"role": "user", "content": request.input}] if isinstance(request.input, str) else request.input
        new = messages_of_items(items)
        if request.previous_response_id is None:
            messages = [*_instructions(request.instructions), *new]
        else:
            _check_previous(request, session)
            messages = [*session.messages, *new]
        return TurnRequest(
            messages=messages,
            tools=openai_tools({"function": tool.model_dump(exclude={"type"})} for tool in request.tools or []),
            turn_limit=request.max_output_tokens,
            model=request.model,
            stream=request.stream,
            options={
                "instructions": request.instructions,
                "previous_response_id": request.previous_response_id,
                "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            },
        )

    def answer(self, request: TurnRequest, turn: TurnAnswer) -> dict:
        return self._response(request, turn, _output_items(turn), _status(turn))

    def events(self, request: TurnRequest, turn: TurnAnswer) -> Iterator[str]:
        sequence = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            return sse({"type": kind, "sequence_number": next(sequence), **fields}, event=kind)

        yield event("response.created", response=self._response(request, turn, [], "in_progress"))
        yield event("response.in_progress", response=self._response(request, turn, [], "in_progress"))
        for index, item in enumerate(_output_items(turn)):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                yield event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "content": [], "status": "in_progress"},
                )
                where = {"item_id": item["id"], "output_index": index, "content_index": 0}
                yield event("response.content_part.added", **where, part=part)
                yield event("response.output_text.delta", **where, delta=text, logprobs=[])
                yield event("response.output_text.done", **where, text=text, logprobs=[])
                yield event("response.content_part.done", **where, part={**part, "text": text})
            else:
                yield event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "arguments": "", "status": "in_progress"},
                )
                where = {"item_id": item["id"], "output_index": index}
                yield event("response.function_call_arguments.delta", **where, delta=item["arguments"])
                yield event(
                    "response.function_call_arguments.done", **where, arguments=item["arguments"], name=item["name"]
                )
            yield event("response.output_item.done", output_index=index, item=item)
        status = _status(turn)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield event(kind, response=self.answer(request, turn))

    @staticmethod
    def _response(request: TurnRequest, turn: TurnAnswer, output: list[dict], status: str) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        total = turn.prompt_tokens + turn.completion_tokens
        return {
            "id": turn.answer_id,
            "object": "response",
            "created_at": turn.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": request.options.get("instructions"),
            "model": request.model,
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": request.options.get("previous_response_id"),
            "tool_choice": "auto",
            "tools": request.options.get("tools", []),
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": {},
            "usage": {
                "input_tokens": turn.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": turn.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": total,
            },
        }


def messages_of_items(items: list[dict[str, Any]]) -> list[ChatMessage]:
    """Responses input items as chat messages: an assistant message and the ``function_call`` items after it are one
    assistant turn; a ``function_call_output`` is a tool message; ``reasoning`` items are taken and not kept."""
    messages: list[ChatMessage] = []
    for index, raw in enumerate(items):
        item = _item(raw, index)
        if isinstance(item, MessageItem):
            text = item.content if isinstance(item.content, str) else "".join(part.text for part in item.content)
            messages.append(ChatMessage(role=ROLES[item.role], content=text))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(name=item.name, arguments=canonical_arguments(item.arguments), id=item.call_id)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # the turn's text, then its calls
                messages[-1] = ChatMessage(role="assistant", content=last.content, tool_calls=(*last.tool_calls, call))
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=(call,)))
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else "".join(part.text for part in item.output)
            messages.append(ChatMessage(role="tool", content=output, tool_call_id=item.call_id))
    return messages


def _item(raw: Any, index: int) -> StrictBody:
    if not isinstance(raw, dict):
        raise OpenAIError(400, f"input[{index}] is {type(raw).__name__}, not an item object", param=f"input.{index}")
    kind = raw.get("type", "message" if "role" in raw else None)
    model = ITEM_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise OpenAIError(
            400,
            f"input[{index}] has type {kind!r:.80}: the session server takes the input items {', '.join(ITEM_TYPES)}",
            param=f"input.{index}.type",
            code="unsupported_item_type",
        )
    body = raw if "type" in raw else {**raw, "type": kind}
    if model is MessageItem and isinstance(body.get("content"), list):
        for number, part in enumerate(body["content"]):
            part_type = part.get("type") if isinstance(part, dict) else None
            if part_type not in PART_TYPES:
                raise OpenAIError(
                    400,
                    f"input[{index}].content[{number}] has type {part_type!r:.80}: the session server takes the "
                    f"content parts {', '.join(PART_TYPES)}",
                    param=f"input.{index}.content.{number}.type",
                    code="unsupported_content_type",
                )
    return validated_part(model, body, where=f"input.{index}", kind=kind)


def _instructions(instructions: str | None) -> list[ChatMessage]:
    return [] if instructions is None else [ChatMessage(role="system", content=instructions)]


def _check_previous(request: ResponsesRequest, session: Session) -> None:
    """``previous_response_id`` must be the session's latest answer (a session does not branch that way: fork it)."""
    previous = request.previous_response_id
    if session.answer_ids and previous == session.answer_ids[-1]:
        held = _instructions(request.instructions)
        if held and session.messages[:1] != held:
            raise OpenAIError(400, "instructions differ from the session's system message", param="instructions")
        return
    if previous in session.answer_ids:
        raise OpenAIError(
            400,
            f"previous_response_id {previous!r:.80} is an earlier answer of this session, not its latest: continue "
            "from the latest, or fork the session (POST {base_url}/fork) to branch",
            param="previous_response_id",
            code="previous_response_not_latest",
        )
    raise OpenAIError(
        400,
        f"previous_response_id {previous!r:.80} is no answer of this session (another session's, or none): each "
        "session continues only its own responses",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def _status(turn: TurnAnswer) -> str:
    return "incomplete" if turn.finish_reason == "length" and not turn.calls else "completed"


def _output_items(turn: TurnAnswer) -> list[dict]:
    suffix = turn.answer_id.removeprefix("resp_")
    items: list[dict] = []
    if turn.content or not turn.calls:
        text = {"type": "output_text", "text": turn.content, "annotations": [], "logprobs": []}
        items.append(
            {"id": f"msg_{suffix}", "type": "message", "role": "assistant", "status": "completed", "content": [text]}
        )
    for number, call in enumerate(turn.calls):
        items.append(
            {
                "id": f"fc_{suffix}_{number}",
                "type": "function_call",
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments,
                "status": "completed",
            }
        )
    return items
