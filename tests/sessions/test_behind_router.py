"""Session servers and the rollout's engine client in front of the real sglang-router (the Rust gateway from the
``sglang-router`` package, as ``miles train --sglang-router true`` starts it) with a real local engine behind it.

The router's ``/generate`` takes one ``sampling_params`` object for a batch's prompts and refuses a list with a 422
(seen when session servers were first put in front of it: each session samples with a seed of its own, so a batch of
turns carried one setting per prompt). A client that knows it talks to a router sends one request per distinct
setting, at once, and gets every answer back in its prompt's place."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from miles_core.engines.client import EngineClient
from miles_core.engines.generate_types import SamplingParams
from miles_core.rollout.sessions.server import SessionLimits, session_server_spec
from miles_core.run_setup import default_model
from miles_core.workers.local_provider import LocalWorkerProvider
from miles_core.workers.specs import CommandWorkerSpec

pytestmark = pytest.mark.slow

TOKEN = "router-session-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DIGIT_FORMAT = "miles_core.builtin.chat_formats:DigitChatFormat"
STARTUP_TIMEOUT_S = 300.0
SESSIONS = 6


class RouterStack:
    """One local engine, the real sglang-router with it registered, and two session servers in front of the router:
    one told it is a router, one not (the way every session server was before)."""

    def __init__(self, run_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.provider = LocalWorkerProvider(token=TOKEN, run_dir=run_dir)
        self.model = default_model(run_dir, seed=0)
        engine = [sys.executable, "-m", "miles_core.builtin.local_engine.server", "--model-path", str(self.model)]
        engine += ["--host", "{host}", "--port", "{port}", "--admin-api-key", "{token}", "--cpu-threads", "1"]
        self.engine = self._start(
            CommandWorkerSpec(name="engine-0", argv=engine, ports=["port"], health_url="http://{host}:{port}/health")
        )
        router = [sys.executable, "-m", "sglang_router.launch_router", "--host", "{host}", "--port", "{port}"]
        router += ["--prometheus-host", "{host}", "--prometheus-port", "{prometheus}", "--worker-urls", self.engine]
        router += ["--log-level", "warn", "--health-check-interval-secs", "1"]
        self.router = self._start(
            CommandWorkerSpec(
                name="router", argv=router, ports=["port", "prometheus"], health_url="http://{host}:{port}/health"
            )
        )
        self._wait_until_the_router_routes()
        self.sessions = self._start(self._session_spec("sessions-router", engine_is_router=True))
        self.naive_sessions = self._start(self._session_spec("sessions-naive", engine_is_router=False))

    def _session_spec(self, name: str, *, engine_is_router: bool) -> CommandWorkerSpec:
        limits = SessionLimits(max_sessions=2 * SESSIONS, max_request_bytes=64 << 10, max_session_tokens=400)
        return session_server_spec(
            startup_timeout_s=STARTUP_TIMEOUT_S,
            name=name,
            engine_url=self.router,
            model_path=str(self.model),
            chat_format=DIGIT_FORMAT,
            limits=limits,
            engine_is_router=engine_is_router,
        )

    def _wait_until_the_router_routes(self) -> None:
        """The router checks its worker before it routes to it (503 until then)."""
        deadline = time.monotonic() + 60
        body = {"input_ids": [2, 5, 3], "sampling_params": {"max_new_tokens": 1}}
        while httpx.post(f"{self.router}/generate", json=body, timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "the router never routed to its engine"
            time.sleep(0.5)

    def _start(self, spec: CommandWorkerSpec) -> str:
        info = self.loop.run_until_complete(self.provider.start(spec))
        assert info.url is not None
        return info.url

    def stop(self) -> None:
        try:
            self.loop.run_until_complete(self.provider.shutdown())
        finally:
            self.loop.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterStack]:
    started = RouterStack(tmp_path_factory.mktemp("router-sessions"))
    yield started
    started.stop()


def test_the_router_refuses_a_batch_with_a_setting_per_prompt(stack: RouterStack) -> None:
    """What the client works around: the router's schema, not Miles'. If a later router accepts lists, this fails
    and the per-setting requests can go."""
    body = {"input_ids": [[2, 5, 3], [2, 5]], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]}
    answer = httpx.post(f"{stack.router}/generate", json=body, timeout=30)
    assert answer.status_code == 422 and "sampling_params" in answer.text


def test_a_router_client_sends_a_batch_of_mixed_settings_and_gets_each_answer_in_place(stack: RouterStack) -> None:
    """Greedy, a different ``max_new_tokens`` per prompt: each answer is the one its prompt gets alone, in its
    prompt's place (the settings repeat, so prompts of one setting share a request)."""
    lengths = [1, 4, 2, 4, 1, 3]
    prompts = [[2, 5, 3, *[4 + i] * (i + 1)] for i in range(len(lengths))]
    params = [SamplingParams(temperature=0.0, max_new_tokens=n) for n in lengths]

    async def ask() -> tuple[list, list]:
        async with EngineClient(stack.router, name="router", is_router=True) as client:
            mixed = await client.generate_outputs(prompts, params)
            alone = [await client.generate_outputs(p, one) for p, one in zip(prompts, params, strict=True)]
            return mixed, alone

    mixed, alone = asyncio.run(ask())
    assert all(len(output.output_ids) <= n for output, n in zip(mixed, lengths, strict=True))
    assert [o.output_ids for o in mixed] == [o.output_ids for o in alone]  # greedy: each prompt's own answer
    assert len({tuple(o.output_ids) for o in alone}) > 1  # the answers differ, so their order is checked


def chat(base_url: str) -> str:
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as client:
        answer = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "73915:"}])
    return answer.choices[0].message.content or ""


def open_sessions(url: str) -> list[str]:
    urls = []
    for seed in range(SESSIONS):  # a seed per session, as the rollout gives them: one setting per turn
        body = {"messages": [{"role": "user", "content": "73915:"}], "sampling": {"max_tokens": 4, "seed": seed}}
        response = httpx.post(f"{url}/sessions", json={**body, "engine_url": None}, headers=AUTH, timeout=60)
        assert response.status_code == 200, response.text
        urls.append(response.json()["base_url"])
    return urls


def test_concurrent_session_turns_through_the_router_all_generate(stack: RouterStack) -> None:
    """Six sessions' turns at once (the server batches turns that arrive within milliseconds): through a session
    server that knows its engine is a router, every turn is answered; through one that does not, the batched turns
    fail with the router's 422 (answered 502 to the agent)."""
    with concurrent.futures.ThreadPoolExecutor(SESSIONS) as pool:
        answers = list(pool.map(chat, open_sessions(stack.sessions)))
    assert len(answers) == SESSIONS and all(isinstance(text, str) for text in answers)
    with concurrent.futures.ThreadPoolExecutor(SESSIONS) as pool:
        naive = list(pool.map(lambda base: _status_of(chat, base), open_sessions(stack.naive_sessions)))
    assert 502 in naive, naive  # at least one batch of several settings reached the router


def test_a_session_names_the_router_itself(stack: RouterStack) -> None:
    """The rollout names each session's engine: ``engine_is_router`` travels with ``engine_url``."""
    body = {"messages": [{"role": "user", "content": "73915:"}], "sampling": {"max_tokens": 3, "seed": 7}}
    bases = []
    for seed in range(SESSIONS):
        named = {**body, "sampling": {"max_tokens": 3, "seed": seed}, "engine_url": stack.router}
        response = httpx.post(
            f"{stack.naive_sessions}/sessions", json={**named, "engine_is_router": True}, headers=AUTH, timeout=60
        )
        assert response.status_code == 200, response.text
        bases.append(response.json()["base_url"])
    with concurrent.futures.ThreadPoolExecutor(SESSIONS) as pool:
        answers = list(pool.map(chat, bases))
    assert len(answers) == SESSIONS


def _status_of(call, *args) -> int:
    try:
        call(*args)
    except openai.APIStatusError as exc:
        return exc.status_code
    return 200
