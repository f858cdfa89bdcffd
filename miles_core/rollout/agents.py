"""Agents (``--rollout-agent NAME|module:function``, registered through ``provide_agents``): the code that plays one
rollout sample as a conversation with the policy.

An agent is ``async def agent(*, base_url: str, prompt: str, metadata: dict) -> float | list[float] | None``.
``base_url`` is its session's OpenAI-compatible endpoint on a session server (``openai.AsyncOpenAI(base_url=...,
api_key=...)``, any key: the session id in the URL is the secret; :func:`session_client` makes one cheaply), which
also answers Anthropic's Messages (:func:`session_anthropic_client`);
``prompt`` and ``metadata`` are the prompt's (a copy). It talks to the policy as many turns as it likes, playing the
tools and the environment itself, and returns the sample's reward, or ``None`` to have the run's reward function
score the last assistant turn. An agent that branches (:func:`fork_session`) returns one reward per session (or one
for all). What is trained on is what the session server recorded: the exact ids of every turn, the policy's tokens
with loss mask 1, everything the agent added with 0.

A failure to reach the policy (an OpenAI or Anthropic API error, an HTTP error: an engine died mid-session) makes the
rollout play the sample again in a new session once the engines are back; any other exception is the agent's defect
and stops the run, naming the agent and the sample. A sample is trained on only when its agent returned.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import sys
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from miles_core.errors import ConfigError
from miles_core.targets import describe_callable, registered_or_target

if TYPE_CHECKING:
    from miles_core.config.build import MilesConfig

AgentFn = Callable[..., Awaitable[Any]]
SESSION_API_KEY = "miles-session"
"""The API key agents give their OpenAI client (the session server asks for none on its chat route)."""
POLICY_MODEL = "policy"
"""The model name agents ask for (the session server serves the run's policy under any name)."""


@dataclasses.dataclass(frozen=True)
class Agent:
    """A loaded agent: its name in errors and metrics, and the coroutine function."""

    name: str
    run: AgentFn


def load_agent(name: str, registry: Any) -> Agent:
    """The agent ``name``: a registered one, else a ``module:function`` target; checked to be an async function
    taking ``base_url``, ``prompt`` and ``metadata`` by keyword, now rather than at the first sample."""
    function = registered_or_target(name, registry, flag="--rollout-agent", kind="agent")
    label = name if describe_callable(function) == name else f"{name} ({describe_callable(function)})"
    if not inspect.iscoroutinefunction(function):
        raise ConfigError(f"--rollout-agent {label} is {function!r:.80}, not an async function (async def agent(...))")
    try:
        inspect.signature(function).bind(base_url="", prompt="", metadata={})
    except TypeError as exc:
        raise ConfigError(
            f"--rollout-agent {label} cannot be called as agent(*, base_url, prompt, metadata): {exc}"
        ) from None
    return Agent(label, function)


def agent_for_task(task: str, agent: str | None, registry: Any) -> Agent | None:
    """``--rollout-agent`` when given, else the agent registered under the task's name (a multi-turn task names its
    agent as it names its reward), else ``None``: the batched single-turn generation."""
    if agent is not None:
        return load_agent(agent, registry)
    if task in registry:
        return load_agent(task, registry)
    return None


def chat_format_target(config: MilesConfig, registry: Any) -> str:
    """The ``module:attribute`` of the run's chat format (:func:`session_chat_format`, looked up in the chat-format
    registry): what a session server is started with, so that it imports that class and no plugin."""
    return registry.get_or_raise(session_chat_format(config)).target_text


def session_chat_format(config: MilesConfig) -> str:
    """``--rollout-chat-format``, else ``default`` for the embedded default model; a ``--model`` needs one."""
    if config.rollout.chat_format is not None:
        return config.rollout.chat_format
    if config.model.path is None:
        return "default"
    raise ConfigError(
        "an agent run with --model needs --rollout-chat-format NAME (`miles plugins` lists the chat formats, e.g. "
        "qwen3): the session servers render the model's conversations as its chat template does"
    )


def is_session_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the policy could not be reached (worth playing the sample again), not an agent defect."""
    import httpx  # deferred, as openai below: only agent runs need them

    from miles_core.engines.client import EngineError
    from miles_core.rollout.sessions.pool import SessionError

    kinds: tuple[type[BaseException], ...] = (httpx.HTTPError, EngineError, SessionError, OSError, TimeoutError)
    for sdk in ("openai", "anthropic"):  # each client's request errors; a client never imported raised none
        module = sys.modules.get(sdk)
        if module is not None:
            kinds += (module.APIError,)
    return isinstance(exc, kinds)


_shared_http: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Any]] = weakref.WeakKeyDictionary()


def _loop_http(sdk: str, make: Callable[[], Any]) -> Any:
    """This event loop's HTTP client for ``sdk`` (``"httpx"`` for openai and the session routes, ``"anthropic"``),
    made by ``make`` when there is none or it was closed: one per SDK, since anthropic's may be of another HTTP
    package (anthropic 2 takes only ``httpx2`` clients; openai takes either)."""
    clients = _shared_http.setdefault(asyncio.get_running_loop(), {})
    http = clients.get(sdk)
    if http is None or http.is_closed:
        http = clients[sdk] = make()
    return http


def _httpx_client() -> Any:
    import httpx  # deferred, as openai: only agent runs import them

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    return _loop_http("httpx", lambda: httpx.AsyncClient(limits=limits, timeout=600.0, trust_env=False))


def session_client(base_url: str) -> Any:
    """An ``openai.AsyncOpenAI`` client of a session at ``base_url``, over one HTTP client shared by every agent of
    this event loop (making an HTTP client costs about 45 ms of CPU on these machines, its TLS context: a client per
    sample cost more than the generation). Not to be closed by the agent; :func:`close_session_clients` closes them."""
    import openai  # deferred: only agent runs import it

    return openai.AsyncOpenAI(base_url=base_url, api_key=SESSION_API_KEY, http_client=_httpx_client())


def anthropic_base_url(base_url: str) -> str:
    """What ``anthropic.AsyncAnthropic(base_url=...)`` is given for the session at ``base_url``: the URL without its
    ``/v1``, since the anthropic client posts to ``{base_url}/v1/messages``."""
    return base_url.removesuffix("/v1")


def session_anthropic_client(base_url: str) -> Any:
    """An ``anthropic.AsyncAnthropic`` client of the session at ``base_url`` (its OpenAI-style URL, as agents are
    given it), over one HTTP client shared by every agent of this event loop, as :func:`session_client`."""
    import anthropic  # deferred: only the agents that speak Anthropic's Messages import it

    http = _loop_http("anthropic", lambda: anthropic.DefaultAsyncHttpxClient(timeout=600.0, trust_env=False))
    return anthropic.AsyncAnthropic(base_url=anthropic_base_url(base_url), api_key=SESSION_API_KEY, http_client=http)


async def fork_session(base_url: str) -> str:
    """Branch the session at ``base_url`` as it is now; the branch's ``base_url``. Each branch becomes a sample of
    its own (sharing the sample's index, told apart by ``occurrence``); the agent then returns one reward per session,
    the first session's first and then its branches' in the order they were made (or one reward for all)."""
    answer = await _httpx_client().post(f"{base_url}/fork")
    answer.raise_for_status()
    return answer.json()["base_url"]


async def close_session_clients() -> None:
    """Close this event loop's shared HTTP clients of :func:`session_client` and :func:`session_anthropic_client`
    (the run calls it when it ends)."""
    for http in _shared_http.pop(asyncio.get_running_loop(), {}).values():
        await http.aclose()


async def single_turn(*, base_url: str, prompt: str, metadata: dict[str, Any]) -> None:
    """The simplest agent: one user message, one answer, scored by the run's reward function."""
    client = session_client(base_url)
    await client.chat.completions.create(model=POLICY_MODEL, messages=[{"role": "user", "content": prompt}])
    return None
