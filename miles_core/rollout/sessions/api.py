"""The session server's request bodies (pydantic, unknown fields refused by name) and their conversion to the
formats' :class:`~miles_core.rollout.sessions.formats.ChatMessage`.

The chat body is OpenAI's ``/v1/chat/completions`` schema as the ``openai`` client and agent frameworks send it:
``tools`` and the ``tool`` role are taken, and an assistant message resent as the client received it (with
``refusal``, ``annotations``, ``audio``, ``function_call`` set to null) is accepted.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import pydantic

from miles_core.engines.openai_errors import validated_body
from miles_core.rollout.sessions.formats import ChatMessage, ToolCall

MAX_MESSAGES = 4096
"""The most messages one request (or a session's prompt) may hold."""


class StrictBody(pydantic.BaseModel):
    """A request body or part of one: unknown fields refused by name, no coercion, no NaN, immutable."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class FunctionCall(StrictBody):
    name: str = pydantic.Field(min_length=1, max_length=256)
    arguments: str
    parsed_arguments: Any = None  # what the openai client's stream helper adds to a call it read (ignored)


class ToolCallBody(StrictBody):
    id: str = pydantic.Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # what the openai client's stream helper keeps of a streamed call (ignored)


class MessageBody(StrictBody):
    """One message of OpenAI's chat schema (``developer`` is read as ``system``)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = pydantic.Field(default=None, max_length=256)
    tool_calls: list[ToolCallBody] | None = pydantic.Field(default=None, max_length=256)
    tool_call_id: str | None = pydantic.Field(default=None, max_length=256)
    # what the openai client resends of an answer it received; only null (an answer of this server has no other)
    refusal: None = None
    annotations: list[Any] | None = pydantic.Field(default=None, max_length=0)
    audio: None = None
    function_call: None = None

    def to_message(self) -> ChatMessage:
        """The message as the formats see it: text content, canonical tool-call arguments."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        calls = tuple(
            ToolCall(name=c.function.name, arguments=canonical_arguments(c.function.arguments), id=c.id)
            for c in self.tool_calls or []
        )
        role = "system" if self.role == "developer" else self.role
        return ChatMessage(role=role, content=content, tool_calls=calls, tool_call_id=self.tool_call_id, name=self.name)


class FunctionSpec(StrictBody):
    name: str = pydantic.Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(StrictBody):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(StrictBody):
    include_usage: bool = False


class SessionChatRequest(StrictBody):
    """``POST /sessions/<id>/v1/chat/completions``. The session's sampling settings are the run's: the request's
    ``temperature``, ``top_p`` and ``seed`` are accepted (agents send them) and ignored, and ``max_tokens`` (or
    ``max_completion_tokens``) can only lower the session's limit for this turn. ``stream: true`` answers in
    OpenAI's chunk events (``stream_options.include_usage`` adds the usage chunk)."""

    model: str = pydantic.Field(max_length=1024)
    messages: list[MessageBody] = pydantic.Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[ToolSpec] | None = pydantic.Field(default=None, max_length=256)
    tool_choice: Literal["auto"] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = pydantic.Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = pydantic.Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    max_tokens: int | None = pydantic.Field(default=None, ge=1)
    max_completion_tokens: int | None = pydantic.Field(default=None, ge=1)
    n: Literal[1] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = pydantic.Field(default=None, max_length=1024)

    def turn_limit(self) -> int | None:
        """The request's own limit on the turn's new tokens, if it gives one."""
        limits = [v for v in (self.max_tokens, self.max_completion_tokens) if v is not None]
        return min(limits) if limits else None


class SamplingSettings(StrictBody):
    """A session's sampling settings (the run's): every turn is sampled with them; turn 0 with ``seed``, later ones
    with seeds mixed from it and the turn (:func:`~miles_core.rollout.sessions.server.turn_seed`)."""

    max_tokens: int = pydantic.Field(default=64, ge=1)
    temperature: float = pydantic.Field(default=1.0, ge=0.0)
    top_p: float = pydantic.Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = pydantic.Field(default=-1, ge=-1)
    seed: int | None = pydantic.Field(default=None, ge=0, le=2**62)


class CreateSessionRequest(StrictBody):
    """``POST /sessions``: the prompt's messages (the conversation every chat request must start with), the
    sampling settings, metadata (kept with the trajectory) and the engine to generate with."""

    messages: list[MessageBody] = pydantic.Field(default_factory=list, max_length=MAX_MESSAGES)
    sampling: SamplingSettings = SamplingSettings()
    metadata: dict[str, Any] = pydantic.Field(default_factory=dict)
    engine_url: str | None = pydantic.Field(default=None, pattern=r"^https?://[^/\s]+/?$", max_length=1024)
    """The engine (or router) that generates the session's turns; ``None``: the server's ``--engine-url``. The
    rollout names one per session, so that a restarted engine's new address is used from its next session on."""
    engine_is_router: bool = False
    """``engine_url`` is an sglang-router: it takes a batch only with one ``sampling_params`` for all its prompts
    (a list is a 422), so turns of different settings (every session has its own seed) go to it one request each."""


def canonical_arguments(arguments: str) -> str:
    """Tool-call arguments as one JSON text whatever the client's spacing (an agent may re-serialize them); text
    that is not JSON is kept as it is."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False, sort_keys=True)
    except (ValueError, RecursionError):
        return arguments


def validated(model: type[StrictBody], body: dict) -> Any:
    """``body`` as ``model``, or an OpenAI 400 naming the field at fault (:func:`validated_body`)."""
    return validated_body(model, body, server="the session server does not take it")


def first_mismatch(held: ChatMessage, given: ChatMessage) -> str | None:
    """The first field in which a resent message differs from the one the session holds (``None``: equal; the
    ids the server gave its tool calls are compared too, so a client may not swap two calls' results)."""
    for field in ("role", "content", "name", "tool_call_id"):
        if getattr(held, field) != getattr(given, field):
            return field
    if len(held.tool_calls) != len(given.tool_calls):
        return "tool_calls"
    for index, (a, b) in enumerate(zip(held.tool_calls, given.tool_calls, strict=True)):
        if (a.id, a.name, canonical_arguments(a.arguments)) != (b.id, b.name, b.arguments):
            return f"tool_calls.{index}"
    return None
