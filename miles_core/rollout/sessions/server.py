"""The session server: one session per rollout sample, an OpenAI-compatible chat endpoint per session for any
black-box agent, token-in-token-out across turns, and the session's trajectory (exact ids, loss mask, logprobs).

Routes (every one answers only loopback ``Host`` names and no web page's ``Origin``, as every Miles server):

- ``POST /sessions`` (bearer: the run's token) ``{"messages", "sampling", "metadata", "engine_url",
  "engine_is_router"}`` creates a session (generating with ``engine_url``, an engine or the router; default:
  ``--engine-url``) and
  answers ``{"session_id", "base_url"}``; ``base_url`` is ``http://HOST:PORT/sessions/<id>/v1``, what an
  ``openai.OpenAI(base_url=...)`` client is given.
- ``POST /sessions/<id>/v1/chat/completions``: OpenAI's chat schema (``tools`` passed to the chat format). It needs
  no bearer (agents are black boxes): the session id is the secret (``secrets.token_urlsafe``, 192 bits). The
  request resends the conversation, which must start with the session's (else a 400 naming the message and field
  that differ); its new messages are appended as tokens (loss mask 0) to the session's exact ids, the engine's
  native ``/generate`` samples the turn from those ids (with the turns other sessions asked within milliseconds, in
  one batched request: :class:`~miles_core.rollout.sessions.batching.TurnBatcher`), and the turn's ids and logprobs
  are recorded (mask 1).
  The answer is OpenAI's: the content and the ``tool_calls`` parsed from the output ids.
- ``POST /sessions/<id>/v1/responses`` (OpenAI's Responses API) and ``POST /sessions/<id>/v1/messages``
  (Anthropic's Messages API): the same turn asked and answered in those clients' dialects, streamed or not
  (:mod:`~miles_core.rollout.sessions.dialects`); a session may be spoken to in any of them, turn by turn.
- ``GET /sessions/<id>/trajectory`` (bearer) answers the :class:`~miles_core.rollout.sessions.session.Trajectory`;
  ``DELETE /sessions/<id>`` (bearer) ends the session and answers its final trajectory (and, as ``branches``,
  those of the forks made from it). ``POST /sessions/<id>/v1/fork`` (no bearer) branches a session: a new session
  with the conversation so far, whose own turns follow, for agents that explore several continuations.
  ``GET /sessions/<id>/v1/models`` lists one model, for agents that look first; ``GET /health`` answers 200 while
  the server serves.

Bounded: at most ``max_sessions`` sessions (a 429 beyond), ``max_request_bytes`` per request (a 413), at most
``max_session_tokens`` per session (a 400 when a request's context would not fit), and a session idle for
``idle_timeout_s`` is dropped (its id then answers 404 saying it expired). A failed generation (the engine gone, an
aborted request) answers 502/503 and leaves the session as it was: the agent may resend the request.

``miles train --rollout-agent`` starts instances through the worker provider (:func:`session_server_spec`,
:class:`~miles_core.rollout.sessions.pool.SessionServers`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from miles_core.engines.client import EngineClient
from miles_core.engines.generate_types import SamplingParams
from miles_core.engines.openai_errors import OpenAIError, error_response
from miles_core.errors import EngineError, MilesError
from miles_core.http import (
    JSON_ERRORS,
    WILDCARD_HOSTS,
    BoundedHttpProtocol,
    HttpError,
    allowed_host_names,
    bearer_token_matches,
    check_browser_request,
    parse_json_object,
    read_body,
    url_name,
)
from miles_core.models.checkpoint_dir import CONTEXT_LENGTH_KEYS, read_model_config
from miles_core.rollout.sessions.anthropic_messages import MessagesDialect
from miles_core.rollout.sessions.api import CreateSessionRequest, first_mismatch, validated
from miles_core.rollout.sessions.batching import TurnBatcher
from miles_core.rollout.sessions.chat_completions import ChatCompletionsDialect
from miles_core.rollout.sessions.dialects import Dialect, TurnAnswer, TurnRequest, check_new_messages
from miles_core.rollout.sessions.formats import ChatFormat, ChatFormatError, ChatMessage
from miles_core.rollout.sessions.responses_api import ResponsesDialect
from miles_core.rollout.sessions.session import Session
from miles_core.targets import import_target
from miles_core.workers.node import node_address
from miles_core.workers.process import listening_socket
from miles_core.workers.rpc.wire import TOKEN_ENV
from miles_core.workers.specs import SESSION_SERVER, CommandWorkerSpec

log = logging.getLogger(__name__)

SERVED_MODEL = "policy"
"""The model name ``/v1/models`` lists (a chat request may name any model: the session serves the run's policy)."""

CHAT_COMPLETIONS = ChatCompletionsDialect()
DIALECTS: dict[str, Dialect] = {
    "chat/completions": CHAT_COMPLETIONS,
    "responses": ResponsesDialect(),
    "messages": MessagesDialect(),
}
"""The dialects by their route under a session's ``base_url`` (:mod:`~miles_core.rollout.sessions.dialects`)."""

EXPIRED_IDS_KEPT = 4096
"""How many expired session ids are remembered, so that their 404 can say they expired."""


@dataclasses.dataclass(frozen=True)
class SessionLimits:
    """The server's bounds (see the module docstring)."""

    max_sessions: int = 1024
    max_request_bytes: int = 8 << 20
    max_session_tokens: int = 32768
    idle_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_request_bytes", "max_session_tokens"):
            if getattr(self, name) < 1:
                raise MilesError(f"session server: {name} must be at least 1, got {getattr(self, name)}")
        if not self.idle_timeout_s > 0:
            raise MilesError(f"session server: idle_timeout_s must be above 0, got {self.idle_timeout_s}")


class SessionServer:
    """The session server's state and routes: sessions by id, the chat format, the engine client."""

    def __init__(
        self,
        *,
        fmt: ChatFormat,
        engine_url: str,
        token: str,
        host: str,
        port: int,
        limits: SessionLimits = SessionLimits(),
        engine_timeout_s: float = 600.0,
        engine_is_router: bool = False,
    ) -> None:
        if not token:
            raise MilesError(f"the session server needs the run's token (--token or ${TOKEN_ENV}) for its routes")
        self.fmt, self.token, self.host, self.port, self.limits = fmt, token, host, port, limits
        self.engine_url, self.engine_timeout_s = engine_url.rstrip("/"), engine_timeout_s
        self.engine_is_router = engine_is_router
        self.engines: dict[tuple[str, bool], TurnBatcher] = {}  # by URL and kind: --engine-url's, those sessions named
        self.served_names = allowed_host_names(host)
        self.sessions: dict[str, Session] = {}
        self.expired: collections.OrderedDict[str, float] = collections.OrderedDict()

    def app(self) -> Starlette:
        """The ASGI app (serve it with ``http=BoundedHttpProtocol``)."""
        routes = [
            Route("/health", self._endpoint(self.health, auth=False), methods=["GET"]),
            Route("/sessions", self._endpoint(self.create, auth=True), methods=["POST"]),
            Route("/sessions/{sid}", self._endpoint(self.delete, auth=True), methods=["DELETE"]),
            Route("/sessions/{sid}/trajectory", self._endpoint(self.trajectory, auth=True), methods=["GET"]),
            *(
                Route(
                    f"/sessions/{{sid}}/v1/{path}",
                    self._endpoint(self._turn_route(d), auth=False, dialect=d),
                    methods=["POST"],
                )
                for path, d in DIALECTS.items()
            ),
            Route("/sessions/{sid}/v1/models", self._endpoint(self.models, auth=False), methods=["GET"]),
            Route("/sessions/{sid}/v1/fork", self._endpoint(self.fork, auth=False), methods=["POST"]),
        ]
        handlers = {status: _openai_route_error for status in JSON_ERRORS}
        return Starlette(routes=routes, exception_handlers=handlers, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            for batcher in self.engines.values():
                await batcher.aclose()
                await batcher.client.aclose()

    def _engine_of(self, session: Session) -> TurnBatcher:
        """The client of the engine ``session`` generates with: one per URL, kept while the server runs (only the
        run's token creates sessions, so there are as many as the addresses its engines had)."""
        if session.engine_url is None:
            url, is_router = self.engine_url, self.engine_is_router
        else:
            url, is_router = session.engine_url.rstrip("/"), session.engine_is_router
        batcher = self.engines.get((url, is_router))
        if batcher is None:
            client = EngineClient(
                url, name=f"session-engine-{len(self.engines)}", timeout_s=self.engine_timeout_s, is_router=is_router
            )
            batcher = self.engines[(url, is_router)] = TurnBatcher(client)
        return batcher

    @property
    def base(self) -> str:
        """The server's URL as its sessions' ``base_url`` names it (a wildcard bind: this machine's name)."""
        host = socket.gethostname() if self.host in WILDCARD_HOSTS else self.host
        return f"http://{url_name(host)}:{self.port}"

    def _endpoint(
        self, handler: Callable[[Request], Awaitable[Any]], *, auth: bool, dialect: Dialect = CHAT_COMPLETIONS
    ) -> Callable:
        """``handler`` behind the browser check, the bearer check (``auth``) and the error shape (``dialect``'s)."""

        async def endpoint(request: Request) -> Response:
            try:
                check_browser_request(request.headers, names=self.served_names, port=self.port)
                if auth and not bearer_token_matches(request.headers.get("authorization"), self.token):
                    raise OpenAIError(401, "this route needs 'Authorization: Bearer <the run's token>'")
                self._expire_idle()
                result = await handler(request)
            except OpenAIError as exc:
                return dialect.error(exc)
            except HttpError as exc:
                return dialect.error(OpenAIError(exc.status, str(exc)))
            except Exception as exc:  # a defect, not the caller's fault: say so, keep serving
                log.exception("session server: %s failed", request.url.path)
                return dialect.error(
                    OpenAIError(500, f"internal error in {request.url.path}: {type(exc).__name__}: {exc}")
                )
            return result if isinstance(result, Response) else JSONResponse(result)

        return endpoint

    async def _body(self, request: Request) -> dict:
        return parse_json_object(await read_body(request, limit=self.limits.max_request_bytes))

    def _expire_idle(self) -> None:
        """Drop the sessions idle for longer than the timeout (a session in the middle of a turn is not idle)."""
        now = time.monotonic()
        for sid in [s.id for s in self.sessions.values() if not s.busy]:
            if now - self.sessions[sid].last_used > self.limits.idle_timeout_s:
                del self.sessions[sid]
                self.expired[sid] = now
        while len(self.expired) > EXPIRED_IDS_KEPT:
            self.expired.popitem(last=False)

    def _session(self, sid: str) -> Session:
        session = self.sessions.get(sid)
        if session is not None:
            return session
        if sid in self.expired:
            raise OpenAIError(
                404,
                f"session {sid[:64]!r} expired after {self.limits.idle_timeout_s:g} s without a request: "
                "create a new one with POST /sessions",
                code="session_expired",
            )
        raise OpenAIError(404, f"no session {sid[:64]!r}: create one with POST /sessions", code="unknown_session")

    # -- routes -----------------------------------------------------------------------------------------------

    async def health(self, request: Request) -> dict:
        return {"status": "ok"}

    async def models(self, request: Request) -> dict:
        """OpenAI's model list, for agents that look before they talk: one model (any name is accepted)."""
        self._session(request.path_params["sid"])
        card = {"id": SERVED_MODEL, "object": "model", "created": 0, "owned_by": "miles"}
        return {"object": "list", "data": [card]}

    def _check_room(self) -> None:
        if len(self.sessions) >= self.limits.max_sessions:
            raise OpenAIError(
                429,
                f"the session server holds {len(self.sessions)} sessions, its limit: end finished ones with "
                "DELETE /sessions/<id> (idle ones expire), or start more session servers",
                code="too_many_sessions",
            )

    async def create(self, request: Request) -> dict:
        body: CreateSessionRequest = validated(CreateSessionRequest, await self._body(request))
        self._check_room()
        messages = [m.to_message() for m in body.messages]
        sid = secrets.token_urlsafe(24)
        self.sessions[sid] = Session(
            sid,
            messages=messages,
            sampling=body.sampling.model_dump(),
            metadata=body.metadata,
            engine_url=body.engine_url,
            engine_is_router=body.engine_is_router,
        )
        return {"session_id": sid, "base_url": f"{self.base}/sessions/{sid}/v1"}

    async def fork(self, request: Request) -> dict:
        """``POST {base_url}/fork``: a branch of the session as it is now (no bearer: the session id is the secret,
        as for its chat route); it counts as a session."""
        session = self._session(request.path_params["sid"])
        self._check_room()
        sid = secrets.token_urlsafe(24)
        self.sessions[sid] = session.fork(sid)
        session.last_used = time.monotonic()
        return {"session_id": sid, "base_url": f"{self.base}/sessions/{sid}/v1"}

    async def delete(self, request: Request) -> dict:
        """End a session and the forks made from it (and from those); the answer carries their final trajectories,
        the session's first and then its forks' in the order they were made (one request for the rollout)."""
        sid = request.path_params["sid"]
        session = self._session(sid)
        family = [s for s in self.sessions.values() if s.root == sid and s.id != sid] if session.root == sid else []
        for ended in [session, *family]:
            del self.sessions[ended.id]
        branches = [branch.trajectory().to_json() for branch in family]
        return {"session_id": sid, "deleted": True, "trajectory": session.trajectory().to_json(), "branches": branches}

    async def trajectory(self, request: Request) -> dict:
        return self._session(request.path_params["sid"]).trajectory().to_json()

    def _turn_route(self, dialect: Dialect) -> Callable[[Request], Awaitable[Response]]:
        """The route of one assistant turn asked in ``dialect``."""

        async def turn(request: Request) -> Response:
            session = self._session(request.path_params["sid"])
            body = await self._body(request)
            if session.busy:
                raise OpenAIError(409, "a request of this session is still running: send one turn at a time")
            session.busy = True
            try:
                asked = dialect.parse(body, session)
                return dialect.response(asked, await self._turn(session, asked, dialect))
            finally:
                session.busy = False
                session.last_used = time.monotonic()

        return turn

    async def _turn(self, session: Session, asked: TurnRequest, dialect: Dialect) -> TurnAnswer:
        """One assistant turn: check the history, append the new messages, generate, record."""
        new_messages = self._new_messages(session, asked.messages)
        check_new_messages(asked.messages, first_new=len(session.messages))
        tools = list(asked.tools)
        if session.tools is not None and tools != session.tools:
            raise OpenAIError(
                400, "tools differ from the session's first turn: give the same tools every turn", param="tools"
            )
        try:
            input_ids = session.input_ids(self.fmt, new_messages, tools=tools)
        except ChatFormatError as exc:
            raise OpenAIError(400, str(exc), param="messages", code="chat_format") from None
        params = self._sampling(session, asked.turn_limit, len(input_ids))
        try:
            output = await self._engine_of(session).generate(input_ids, params)
        except EngineError as exc:
            raise OpenAIError(
                502, f"the engine failed; the session is unchanged, send the request again: {exc}"
            ) from None
        if output.aborted:
            raise OpenAIError(
                503, "the engine aborted the generation (a weight update); the session is unchanged: send it again"
            )
        content, calls = self.fmt.parse_tool_calls(output.output_ids, tools=tools)
        calls = [dataclasses.replace(call, id=f"{dialect.call_id_prefix}{uuid.uuid4().hex[:24]}") for call in calls]
        answer_id = f"{dialect.id_prefix}{uuid.uuid4().hex}"
        session.record_turn(
            input_ids=input_ids,
            tools=tools,
            new_messages=new_messages,
            output_ids=output.output_ids,
            logprobs=output.logprobs,
            assistant=ChatMessage(role="assistant", content=content, tool_calls=tuple(calls)),
            finish_reason=output.finish_reason,
            weight_version=output.weight_version,
            answer_id=answer_id,
        )
        return TurnAnswer(
            answer_id=answer_id,
            content=content,
            calls=calls,
            finish_reason=output.finish_reason,
            prompt_tokens=len(input_ids),
            completion_tokens=len(output.output_ids),
            created=int(time.time()),
        )

    def _new_messages(self, session: Session, messages: list[ChatMessage]) -> list[ChatMessage]:
        """The request's messages after the session's, which it must resend unchanged."""
        held = session.messages
        for index, (mine, given) in enumerate(zip(held, messages, strict=False)):
            field = first_mismatch(mine, given)
            if field is not None:
                raise OpenAIError(
                    400,
                    f"messages[{index}] ({given.role}) differs from the session's conversation in {field}: resend "
                    f"the session's {len(held)} messages unchanged (the answers as they were given) and add new ones "
                    "after them",
                    param=f"messages.{index}.{field}",
                    code="history_mismatch",
                )
        # the first turn may generate from the session's prompt alone; a later one answers something new
        if len(messages) < len(held) or (len(messages) == len(held) and session.turns):
            raise OpenAIError(
                400,
                f"the request holds {len(messages)} messages and the session {len(held)}: resend the session's "
                "conversation and add at least one new message after it",
                param="messages",
                code="history_mismatch",
            )
        return messages[len(held) :]

    def _sampling(self, session: Session, turn_limit: int | None, context: int) -> SamplingParams:
        """The session's sampling settings for a turn that starts from ``context`` ids, at most ``turn_limit`` new
        tokens when the request gives a limit (it can only lower the session's)."""
        limit, room = session.sampling["max_tokens"], self.limits.max_session_tokens - context
        if turn_limit is not None:
            limit = min(limit, turn_limit)
        if room < 1 or (turn_limit is not None and turn_limit > room):
            raise OpenAIError(
                400,
                f"the session's context would overflow: {context} tokens with this request's messages, "
                f"{turn_limit or limit} more asked, at most {self.limits.max_session_tokens} a session",
                param="messages",
                code="context_length_exceeded",
            )
        return SamplingParams(
            max_new_tokens=min(limit, room),
            temperature=session.sampling["temperature"],
            top_p=session.sampling["top_p"],
            top_k=session.sampling["top_k"],
            sampling_seed=turn_seed(session.sampling["seed"], len(session.turns)),
        )


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of a session's turn ``turn`` (the same again when a failed turn is resent). Turn 0 uses
    ``seed`` itself (a one-turn session samples as ``/generate`` with that seed would); later turns a seed mixed from
    both. Not ``seed + turn``: the rollout gives consecutive seeds to a group's samples, and where the policy's
    distribution is flat the seed alone picks the tokens, so the second turn of one sample repeated the first turn
    of the next."""
    if seed is None or turn == 0:
        return seed
    return (seed * 1_000_003 + turn * 7_919) % (1 << 62)


async def _openai_route_error(request: Request, exc: Exception) -> Response:
    """An unknown route (404) or method (405), said as :func:`~miles_core.http.json_error` says it, in OpenAI's
    error shape like every other answer of this server."""
    plain = await JSON_ERRORS[404](request, exc)  # json_error: the message naming the route or the methods taken
    answer = error_response(plain.status_code, json.loads(plain.body)["error"])
    if "allow" in plain.headers:
        answer.headers["allow"] = plain.headers["allow"]
    return answer


def session_server_spec(
    *,
    startup_timeout_s: float,
    name: str,
    engine_url: str,
    model_path: str,
    chat_format: str,
    limits: SessionLimits = SessionLimits(),
    engine_is_router: bool = False,
) -> CommandWorkerSpec:
    """The command worker of one session server in front of ``engine_url`` (an engine or the router), on a free
    port; the provider gives it the run's token in ``$MILES_RUN_TOKEN``. ``startup_timeout_s`` is the run's engine start
    timeout (``engine.startup_timeout_s``); ``chat_format`` is the format's ``module:attribute``
    (:func:`~miles_core.rollout.agents.chat_format_target`)."""
    argv = [
        sys.executable,
        "-m",
        "miles_core.rollout.sessions.server",
        "--engine-url",
        engine_url,
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--chat-format",
        chat_format,
        "--model-path",
        model_path,
        "--max-sessions",
        str(limits.max_sessions),
        "--max-request-bytes",
        str(limits.max_request_bytes),
        "--max-session-tokens",
        str(limits.max_session_tokens),
        "--idle-timeout-s",
        str(limits.idle_timeout_s),
        *(["--engine-is-router"] if engine_is_router else []),
    ]
    return CommandWorkerSpec(
        name=name,
        argv=argv,
        ports=["port"],
        health_url="http://{host}:{port}/health",
        startup_timeout_s=startup_timeout_s,
        num_cpus=0,
        role=SESSION_SERVER,
    )


def model_context_length(model_path: str) -> int | None:
    """The model's context length from its ``config.json`` (``None`` when it names none)."""
    config = read_model_config(Path(model_path))
    lengths = [config.get(key) for key in CONTEXT_LENGTH_KEYS]
    return next((n for n in lengths if isinstance(n, int) and not isinstance(n, bool) and n > 0), None)


def load_chat_format(target: str, model_path: str) -> ChatFormat:
    """The chat format class at ``target`` (``module:attribute``, as the driver resolved the run's chat format from
    the registry) made for the tokenizer of ``model_path``."""
    from miles_core.models.hf_checkpoint import load_tokenizer  # deferred: imports transformers

    return import_target(target, what=f"--chat-format {target!r}")(load_tokenizer(Path(model_path)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles_core.rollout.sessions.server", description=__doc__)
    parser.add_argument("--engine-url", required=True, help="an engine's (or the router's) URL")
    parser.add_argument(
        "--engine-is-router", action="store_true", help="--engine-url is an sglang-router (one request per setting)"
    )
    parser.add_argument("--host", default=node_address(), help="address to bind (default: this node's address)")
    parser.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
    parser.add_argument(
        "--chat-format", required=True, help="the chat format class, module:attribute (the driver resolves the name)"
    )
    parser.add_argument("--model-path", required=True, help="the model directory whose tokenizer the format uses")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV), help=f"the run's token (default: ${TOKEN_ENV})")
    defaults = SessionLimits()
    parser.add_argument("--max-sessions", type=int, default=defaults.max_sessions)
    parser.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes)
    parser.add_argument(
        "--max-session-tokens",
        type=int,
        default=defaults.max_session_tokens,
        help="at most this many tokens a session (and at most the model's context length)",
    )
    parser.add_argument("--idle-timeout-s", type=float, default=defaults.idle_timeout_s)
    args = parser.parse_args(argv)
    try:
        fmt = load_chat_format(args.chat_format, args.model_path)
        context = model_context_length(args.model_path)  # a session never outgrows the model's context
        limits = SessionLimits(
            max_sessions=args.max_sessions,
            max_request_bytes=args.max_request_bytes,
            max_session_tokens=min(args.max_session_tokens, context or args.max_session_tokens),
            idle_timeout_s=args.idle_timeout_s,
        )
        sock = listening_socket(args.host, args.port)
    except MilesError as exc:
        print(f"session server: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except OSError as exc:
        print(f"session server: error: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        raise SystemExit(2) from None
    port = sock.getsockname()[1]
    try:
        server = SessionServer(
            fmt=fmt,
            engine_url=args.engine_url,
            token=args.token or "",
            host=args.host,
            port=port,
            limits=limits,
            engine_is_router=args.engine_is_router,
        )
    except MilesError as exc:
        print(f"session server: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    print(
        f"session server: serving {server.base} (chat format {fmt.name!r}, at most {limits.max_session_tokens} "
        "tokens a session)",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(server.app(), log_level="warning", access_log=False, http=BoundedHttpProtocol)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
