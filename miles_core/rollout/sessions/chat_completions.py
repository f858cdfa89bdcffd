"""OpenAI's Chat Completions as a session-server dialect: ``POST {base_url}/chat/completions``, what
``openai.AsyncOpenAI(base_url=...).chat.completions.create`` sends (the body: :class:`~miles_core.rollout.sessions.api.
SessionChatRequest`). ``stream: true`` answers in ``chat.completion.chunk`` events and ``data: [DONE]``, as
``client.chat.completions.stream(...)`` reads them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from miles_core.engines.openai_errors import OpenAIError
from miles_core.rollout.sessions.api import SessionChatRequest, validated
from miles_core.rollout.sessions.dialects import Dialect, TurnAnswer, TurnRequest, sse

if TYPE_CHECKING:
    from miles_core.rollout.sessions.session import Session


class ChatCompletionsDialect(Dialect):
    """OpenAI's Chat Completions (see the module docstring)."""

    name = "chat_completions"
    id_prefix = "chatcmpl-"

    def parse(self, body: dict, session: Session) -> TurnRequest:
        request: SessionChatRequest = validated(SessionChatRequest, body)
        if request.stream_options is not None and not request.stream:
            raise OpenAIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        messages = [message.to_message() for message in request.messages]
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        return TurnRequest(
            messages=messages,
            tools=[tool.model_dump(exclude_none=True) for tool in request.tools or []],
            turn_limit=request.turn_limit(),
            model=request.model,
            stream=request.stream,
            options={"include_usage": include_usage},
        )

    def answer(self, request: TurnRequest, turn: TurnAnswer) -> dict:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": turn.content if turn.content or not turn.calls else None,
        }
        if turn.calls:
            message["tool_calls"] = [_call(call) for call in turn.calls]
        return {
            **self._head(request, turn, "chat.completion"),
            "choices": [{"index": 0, "message": message, "finish_reason": _finish(turn), "logprobs": None}],
            "usage": _usage(turn),
        }

    def events(self, request: TurnRequest, turn: TurnAnswer) -> Iterator[str]:
        head = self._head(request, turn, "chat.completion.chunk")

        def chunk(delta: dict, finish: str | None = None) -> str:
            return sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

        yield chunk({"role": "assistant", "content": ""})
        if turn.content:
            yield chunk({"content": turn.content})
        for index, call in enumerate(turn.calls):
            yield chunk({"tool_calls": [{"index": index, **_call(call)}]})
        yield chunk({}, _finish(turn))
        if request.options.get("include_usage"):
            yield sse({**head, "choices": [], "usage": _usage(turn)})
        yield sse("[DONE]")

    @staticmethod
    def _head(request: TurnRequest, turn: TurnAnswer, kind: str) -> dict:
        return {"id": turn.answer_id, "object": kind, "created": turn.created, "model": request.model}


def _call(call: Any) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _finish(turn: TurnAnswer) -> str:
    return "tool_calls" if turn.calls else ("stop" if turn.finish_reason == "stop" else "length")


def _usage(turn: TurnAnswer) -> dict:
    total = turn.prompt_tokens + turn.completion_tokens
    return {"prompt_tokens": turn.prompt_tokens, "completion_tokens": turn.completion_tokens, "total_tokens": total}
