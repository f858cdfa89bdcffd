"""The local engine's OpenAI-compatible routes: ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``,
as SGLang serves them, so that OpenAI clients (the ``openai`` package, ``sglang.bench_serving --backend
sglang-oai``) work against the local engine.

What is implemented, and what is refused rather than faked:

- Bodies are pydantic models that refuse unknown fields by name. Of the fields clients send by default, only
  ``user`` is accepted and ignored (it changes no output); ``model`` may name anything, as in SGLang: the engine
  serves one model. SGLang's extensions ``ignore_eos``, ``top_k`` and ``stop_token_ids`` are implemented.
- ``stream: true`` is server-sent events in OpenAI's chunk format, ``data: [DONE]`` last, each chunk sent as soon as
  its tokens are sampled (:meth:`LocalEngine.stream`); ``stream_options.include_usage`` adds the usage chunk.
- ``stop`` strings end the generation in the engine as soon as the decoded output holds one; the text is cut
  before it, and a streamed text holds back what may be the start of a stop string. The usage and the logprobs
  count the tokens up to the one that completed the stop string.
- ``logprobs`` (completions: an integer, the alternatives per position; chat: ``logprobs: true`` and
  ``top_logprobs``) are of the distribution each token was sampled from (``log_softmax(logits / temperature)``,
  raw logits when greedy), as the native route reports them. Prompt logprobs (``echo``) are not computed: refused.
- ``n`` > 1, ``best_of`` > 1, penalties, ``logit_bias``, ``suffix``, ``echo``, a ``response_format`` other than
  text, tools: refused with a 400 naming the field.
- Chat completions apply the checkpoint tokenizer's chat template. A tokenizer without one (the embedded default's
  digit tokenizer has none) is a 400 saying so: the engine does not invent a template the model never saw.
- Every refusal has OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with a 4xx status; the
  ``Host``/``Origin`` rules and body bounds are the native routes'. These are data-plane routes like
  ``/generate``: they need no key, and an ``Authorization`` header (the ``openai`` client always sends one) is
  ignored.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal, Protocol

import pydantic
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from miles_core.builtin.local_engine.engine import LocalEngine, TokenUpdate
from miles_core.builtin.local_engine.sampling import (
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from miles_core.builtin.local_engine.serving import (
    MAX_PROMPTS_PER_REQUEST,
    ROUTE_BODY_BYTES,
    held_back,
    unless_client_leaves,
    visible_text,
)
from miles_core.engines.openai_errors import ERROR_TYPES, OpenAIError, error_response, validated_body
from miles_core.errors import MilesError
from miles_core.http import HttpError, check_browser_request, parse_json_object, read_body, safe_message

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's (and SGLang's) ``max_tokens`` of a completion that names none."""

log = logging.getLogger(__name__)


# -- request bodies ---------------------------------------------------------------------------------------------


class _Body(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body):
    """The fields both routes take."""

    model: str = pydantic.Field(max_length=1024)
    temperature: float | None = pydantic.Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = pydantic.Field(default=None, gt=0.0, le=1.0)
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = pydantic.Field(default=None, ge=0, le=MAX_SEED)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = pydantic.Field(default=None, max_length=1024)  # ignored: it changes no output
    # SGLang's extensions
    ignore_eos: bool = False
    top_k: int = pydantic.Field(default=-1, ge=-1)
    stop_token_ids: list[int] | None = pydantic.Field(default=None, max_length=1024)


class CompletionRequest(_Common):
    """``/v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids or a list of such lists."""

    prompt: str | list[Any]
    max_tokens: int | None = pydantic.Field(default=None, ge=0)
    logprobs: int | None = pydantic.Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = pydantic.Field(default=None, max_length=256)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ResponseFormat(_Body):
    type: Literal["text"]


class ChatCompletionRequest(_Common):
    """``/v1/chat/completions``."""

    messages: list[ChatMessage] = pydantic.Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)
    max_tokens: int | None = pydantic.Field(default=None, ge=0)
    max_completion_tokens: int | None = pydantic.Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = pydantic.Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None


def _validated(model: type[_Body], body: dict) -> Any:
    """``body`` as ``model``, or an OpenAI 400 naming the field at fault (:func:`validated_body`)."""
    return validated_body(model, body, server="the local engine does not implement it")


def _refuse_unsupported(body: _Common) -> None:
    """What would change the output in a way the local engine cannot: each a 400 naming the field."""
    if body.n not in (None, 1):
        raise OpenAIError(
            400,
            f"n={body.n}: the local engine returns one choice per prompt; send n requests "
            "(with different seeds) instead",
            param="n",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0.0):
            raise OpenAIError(400, f"{name} is not implemented by the local engine: leave it 0", param=name)
    if body.logit_bias:
        raise OpenAIError(400, "logit_bias is not implemented by the local engine", param="logit_bias")
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stops) > MAX_STOP_STRINGS:
        raise OpenAIError(400, f"stop holds {len(stops)} strings, at most {MAX_STOP_STRINGS}", param="stop")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise OpenAIError(
                400,
                "echo=true is not supported: the local engine computes no prompt logprobs; prepend the prompt yourself",
                param="echo",
            )
        if body.best_of not in (None, 1):
            raise OpenAIError(400, f"best_of={body.best_of}: only 1 is supported", param="best_of")
        if body.suffix is not None:
            raise OpenAIError(400, "suffix (insertion) is not supported by the local engine", param="suffix")


def _sampling(body: _Common, max_tokens: int | None) -> SamplingParams:
    """The engine's sampling parameters for an OpenAI body (``max_tokens`` None: the engine's default, which
    shrinks to what fits in the context)."""
    fields: dict[str, Any] = {
        "top_k": body.top_k,
        "ignore_eos": body.ignore_eos,
        "stop": [body.stop] if isinstance(body.stop, str) else list(body.stop or []),
    }
    for name, value in (
        ("max_new_tokens", max_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("sampling_seed", body.seed),
        ("stop_token_ids", body.stop_token_ids),
    ):
        if value is not None:
            fields[name] = value
    try:
        return SamplingParams.model_validate(fields)
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(map(str, error["loc"]))
        raise OpenAIError(400, f"{where}: {error['msg']}", param=str(error["loc"][0])) from None


def _prompts(prompt: str | list[Any], tokenizer: Any) -> list[list[int]]:
    """A completion's prompts as token-id lists."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        prompt = [prompt]  # one prompt
    if not prompt or len(prompt) > MAX_PROMPTS_PER_REQUEST:
        raise OpenAIError(
            400, f"prompt must hold 1 to {MAX_PROMPTS_PER_REQUEST} prompts, got {len(prompt)}", param="prompt"
        )
    rows = []
    for item in prompt:
        if isinstance(item, str):
            if tokenizer is None:
                raise OpenAIError(
                    400, "this model directory has no tokenizer: send the prompt as token ids", param="prompt"
                )
            rows.append(tokenizer.encode(item))
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            rows.append(item)
        else:
            raise OpenAIError(
                400,
                "prompt must be a string, a list of strings, a non-empty list of token ids, or a "
                f"list of such lists; got an element {item!r:.80}",
                param="prompt",
            )
    return rows


def _finish_reason(result: GenerationResult) -> str:
    kind = result.finish_reason.get("type")
    if kind == "abort":
        raise OpenAIError(
            503,
            f"generation was aborted ({result.finish_reason.get('message', 'no reason')}): "
            "the engine is pausing or updating its weights; send the request again",
        )
    return "stop" if kind == "stop" else "length"


class _TextDelta:
    """The text a stream has sent, and what it may send next."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]) -> None:
        self.decode, self.stops, self.sent = decode, stops, ""

    def update(self, output_ids: list[int]) -> str:
        text = self.decode(output_ids)
        return self._advance(text[: held_back(text, self.stops)])

    def final(self, result: GenerationResult) -> str:
        return self._advance(visible_text(self.decode(result.output_ids), result.finish_reason))

    def _advance(self, visible: str) -> str:
        if len(visible) <= len(self.sent) or not visible.startswith(self.sent):
            return ""  # nothing new (a decoding that changed what was sent cannot be taken back)
        delta, self.sent = visible[len(self.sent) :], visible
        return delta


def _sse(payload: dict | str) -> bytes:
    return b"data: " + (payload if isinstance(payload, str) else json.dumps(payload)).encode() + b"\n\n"


class EngineServer(Protocol):
    """What the OpenAI routes use of the server that mounts them
    (:class:`~.server.LocalEngineServer`): its engine, its address, and generation counted
    in its requests in flight."""

    engine: LocalEngine
    port: int
    served_names: frozenset[str]

    async def generate_counted(self, requests: list[GenerationRequest]) -> list[GenerationResult]: ...

    def stream_tokens(self, request: GenerationRequest) -> AsyncIterator[TokenUpdate | GenerationResult]: ...


class OpenAIRoutes:
    """The OpenAI-compatible routes of a local engine server."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self.engine = server.engine

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self._endpoint(self.models, None), methods=["GET"]),
            Route("/v1/completions", self._endpoint(self.completions, CompletionRequest), methods=["POST"]),
            Route("/v1/chat/completions", self._endpoint(self.chat, ChatCompletionRequest), methods=["POST"]),
        ]

    @property
    def model_id(self) -> str:
        return self.engine.model_path  # SGLang's served model name defaults to the model path

    def _endpoint(self, handler: Callable[..., Awaitable[Any]], model: type[_Body] | None) -> Callable:
        async def endpoint(request: Request) -> Response:
            try:
                check_browser_request(request.headers, names=self.server.served_names, port=self.server.port)
                if model is None:
                    result = await handler()
                else:
                    raw = await read_body(request, limit=ROUTE_BODY_BYTES["/generate"])
                    body = _validated(model, parse_json_object(raw))
                    _refuse_unsupported(body)
                    result = await unless_client_leaves(request, handler(body))
            except OpenAIError as exc:
                result = error_response(exc.status, str(exc), param=exc.param, code=exc.code)
            except HttpError as exc:
                result = error_response(exc.status, str(exc))
            except (MilesError, ValueError) as exc:  # the engine's admission: context length, token ids
                result = error_response(400, f"{type(exc).__name__}: {exc}")
            except Exception as exc:  # a defect, not the caller's fault: say so, keep serving
                log.exception("local engine: %s failed", request.url.path)
                result = error_response(500, f"internal error in {request.url.path}: {type(exc).__name__}: {exc}")
            if not isinstance(result, Response):
                result = JSONResponse(result)
            result.headers["X-Weight-Version"] = self.engine.weight_version
            return result

        return endpoint

    async def models(self) -> dict:
        card = {
            "id": self.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "miles",
            "root": self.model_id,
            "max_model_len": self.engine.context_length,
        }
        return {"object": "list", "data": [card]}

    # -- completions ------------------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest) -> Any:
        max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        params = _sampling(body, max_tokens)
        top = body.logprobs or 0
        requests = [
            self.engine.admit(GenerationRequest(ids, params, top_logprobs_num=top))
            for ids in _prompts(body.prompt, self.engine.tokenizer)
        ]
        reply = _Reply(self, body, kind="text_completion", top=top if body.logprobs is not None else None)
        if body.stream:
            if len(requests) > 1:
                raise OpenAIError(400, "stream=true takes one prompt: send one request per prompt", param="prompt")
            return reply.stream(requests[0])
        results = await self.server.generate_counted(requests)
        return reply.whole(requests, results)

    # -- chat -------------------------------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest) -> Any:
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
            raise OpenAIError(
                400, "max_tokens and max_completion_tokens differ: give one of them", param="max_completion_tokens"
            )
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else 0
        request = self.engine.admit(
            GenerationRequest(self._chat_prompt(body.messages), _sampling(body, max_tokens), top_logprobs_num=top)
        )
        reply = _Reply(self, body, kind="chat.completion", top=top if body.logprobs else None)
        if body.stream:
            return reply.stream(request)
        results = await self.server.generate_counted([request])
        return reply.whole([request], results)

    def _chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        """The messages through the tokenizer's chat template, as token ids."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            where = "has no tokenizer" if tokenizer is None else "has a tokenizer without a chat template"
            raise OpenAIError(
                400,
                f"/v1/chat/completions needs a chat template, and the model directory "
                f"{self.engine.model_path} {where}: use /v1/completions with a prompt, or serve "
                "a checkpoint whose tokenizer_config.json has a chat_template",
                param="messages",
                code="no_chat_template",
            )
        conversation = [
            {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.text(),
                **({"name": m.name} if m.name else {}),
            }
            for m in messages
        ]
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja's TemplateError, or raise_exception() of the template itself
            raise OpenAIError(400, f"the model's chat template refused the messages: {exc}", param="messages") from None
        return tokenizer.encode(text, add_special_tokens=False)


class _Reply:
    """Builds one answer (whole or streamed) of a completion or chat completion."""

    def __init__(self, routes: OpenAIRoutes, body: _Common, *, kind: str, top: int | None) -> None:
        self.routes, self.engine, self.body, self.kind = routes, routes.engine, body, kind
        self.top = top  # alternatives per position; None: no logprobs at all
        self.id = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])

    def _envelope(self, kind: str, choices: list[dict], usage: dict | None) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.body.model,
            "choices": choices,
            "usage": usage,
        }

    @staticmethod
    def _usage(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def whole(self, requests: list[GenerationRequest], results: list[GenerationResult]) -> dict:
        choices = []
        for index, result in enumerate(results):
            text = visible_text(self.engine.decode(result.output_ids), result.finish_reason)
            choice: dict[str, Any] = {
                "index": index,
                "finish_reason": _finish_reason(result),
                "logprobs": self._logprobs(result.output_ids, 0, result.logprobs, result.top_logprobs),
            }
            if self.kind == "chat.completion":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        usage = self._usage(sum(len(r.input_ids) for r in requests), sum(len(r.output_ids) for r in results))
        return self._envelope(self.kind, choices, usage)

    def _logprobs(
        self, output_ids: list[int], start: int, lps: list[float], tops: list[list[tuple[float, int]]]
    ) -> dict | None:
        """The logprobs of ``output_ids[start:]`` (``lps`` and ``tops`` are theirs) in the route's format."""
        if self.top is None:
            return None
        ids = output_ids[start:]
        known = self.engine.tokenizer is not None

        def text(t: int) -> str:
            return self.engine.decode([t]) if known else f"token_id:{t}"

        if self.kind == "chat.completion":
            content = [
                {
                    "token": text(t),
                    "logprob": lp,
                    "bytes": list(text(t).encode()),
                    "top_logprobs": [
                        {"token": text(a), "logprob": alp, "bytes": list(text(a).encode())}
                        for alp, a in (tops[i] if i < len(tops) else [])
                    ],
                }
                for i, (t, lp) in enumerate(zip(ids, lps, strict=True))
            ]
            return {"content": content, "refusal": None}
        # where each token's text begins in the completion's text: the length of the output decoded up to it
        offsets = [len(self.engine.decode(output_ids[:i])) if known else 0 for i in range(start, len(output_ids))]
        return {
            "tokens": [text(t) for t in ids],
            "token_logprobs": lps,
            "top_logprobs": [{text(a): alp for alp, a in position} for position in tops] if self.top else None,
            "text_offset": offsets,
        }

    def stream(self, request: GenerationRequest) -> StreamingResponse:
        return StreamingResponse(self._events(request), media_type="text/event-stream")

    async def _events(self, request: GenerationRequest) -> AsyncIterator[bytes]:
        """The chunks of one choice as its tokens are sampled, the usage chunk if asked for, ``[DONE]``; a failure
        once the answer has begun is an ``error`` event (as SGLang sends it), not a cut connection."""
        try:
            async for chunk in self._chunks(request):
                yield chunk
        except Exception as exc:  # a defect: the 200 is sent already, so say it in the stream
            log.exception("local engine: a %s stream failed", self.kind)
            yield _sse(
                {
                    "error": {
                        "message": safe_message(f"internal error: {type(exc).__name__}: {exc}"),
                        "type": "internal_error",
                        "param": None,
                        "code": "500",
                    }
                }
            )
        yield _sse("[DONE]")

    async def _chunks(self, request: GenerationRequest) -> AsyncIterator[bytes]:
        chat = self.kind == "chat.completion"
        kind = "chat.completion.chunk" if chat else "text_completion"
        delta, count = _TextDelta(self.engine.decode, self.stops), 0  # count: the tokens sent so far
        ids: list[int] = []
        if chat:
            yield _sse(
                self._envelope(kind, [self._chunk_choice({"role": "assistant", "content": ""}, None, None)], None)
            )
        async for item in self.routes.server.stream_tokens(request):
            if isinstance(item, TokenUpdate):
                ids += item.output_ids
                text = delta.update(ids)
                logprobs = self._logprobs(ids, count, item.logprobs, item.top_logprobs)
                count += len(item.output_ids)
                if text or logprobs is not None:
                    yield _sse(self._envelope(kind, [self._chunk_choice(text, logprobs, None)], None))
                continue
            try:
                reason = _finish_reason(item)
            except OpenAIError as exc:
                yield _sse({"error": {"message": str(exc), "type": ERROR_TYPES[503], "param": None, "code": "503"}})
                break
            logprobs = None
            if len(item.output_ids) > count:  # tokens the updates did not carry (there should be none)
                logprobs = self._logprobs(item.output_ids, count, item.logprobs[count:], item.top_logprobs[count:])
            yield _sse(self._envelope(kind, [self._chunk_choice(delta.final(item), logprobs, reason)], None))
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                yield _sse(self._envelope(kind, [], self._usage(len(request.input_ids), len(item.output_ids))))

    def _chunk_choice(self, content: str | dict, logprobs: dict | None, finish_reason: str | None) -> dict:
        if self.kind == "chat.completion":
            delta = content if isinstance(content, dict) else ({"content": content} if content else {})
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": 0, "text": content, "logprobs": logprobs, "finish_reason": finish_reason}
