"""SGLang's pause semantics, measured on a real SGLang server and compared with Miles' local engine.

``abort`` ends in-flight requests with finish reason ``abort``; ``retract`` and ``in_place`` hold them (and every new
request) until ``/continue_generation``, after which they finish with all their tokens; a weight update while paused
lets the in-flight request finish afterwards, its ``meta_info.weight_versions`` spans recording where the new version
took over. Each scenario runs against both servers (one of each kind for the module, serving again after every test);
where the local engine differs (see ``LOCAL_ENGINE_DIFFERS``), the test asserts what each one does. The real-SGLang
cases skip, saying why, where SGLang cannot run (``requires_real_sglang``)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from miles_core.engines.client import EngineClient, EngineError
from miles_core.testkit.tiny_models import save_tiny_llama
from miles_core.workers.local_provider import LocalWorkerProvider
from miles_core.workers.specs import CommandWorkerSpec
from tests.sglang.real_sglang import real_sglang_server, requires_real_sglang

pytestmark = pytest.mark.slow
ADMIN = "pause-admin"
CONTEXT = 8192
LONG = 1500
"""Tokens of the in-flight request: long enough that it is still running when the pause comes (seconds on CPU)."""
PROMPT = [5, 9, 13, 17]
GREEDY = {"max_new_tokens": LONG, "temperature": 0.0, "ignore_eos": True}
HELD_S = 2.0
"""How long a paused server is watched for requests it must not finish."""
LOCAL_ENGINE_DIFFERS = {
    "in_place": "a weight update over requests paused in place is taken, and their KV cache recomputed under the new "
    "weights when they resume (SGLang refuses it: 'the cache was not flushed')",
}
"""How the local engine's pause differs from SGLang's, by mode (``miles_core/builtin/local_engine/engine.py``)."""
SERVERS = [pytest.param("sglang", marks=requires_real_sglang), "local"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pause-models")
    return tuple(save_tiny_llama(root / f"model-{seed}", seed=seed, max_position_embeddings=CONTEXT) for seed in (0, 1))


class ServerLoop:
    """One server of a kind for the whole module, started and stopped on its own event loop; each test runs its
    scenario on that loop with a client of the server (starting SGLang takes about half a minute on CPU)."""

    def __init__(self, server: str, run_dir: Path, model: Path) -> None:
        self.loop = asyncio.new_event_loop()
        if server == "sglang":
            self._context = real_sglang_server(run_dir, model, token=ADMIN, **{"engine.max_batch_size": 8})
        else:
            self._context = local_engine_server(run_dir, model)
        self.url = self.loop.run_until_complete(self._context.__aenter__()).url
        self.name = server

    def run(self, scenario: Callable[[EngineClient], Awaitable[None]]) -> None:
        """Run ``scenario(client)``; the server serves again afterwards, whatever the scenario left paused."""

        async def with_client() -> None:
            async with EngineClient(self.url, admin_key=ADMIN, name=self.name) as client:
                try:
                    await scenario(client)
                finally:
                    await client.continue_generation()

        self.loop.run_until_complete(with_client())

    def close(self) -> None:
        self.loop.run_until_complete(self._context.__aexit__(None, None, None))
        self.loop.close()


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerLoop]]:
    """The module's servers by kind, each started on first use."""
    started: dict[str, ServerLoop] = {}
    yield started
    for server in started.values():
        server.close()


@pytest.fixture
def served(
    request: pytest.FixtureRequest, servers: dict[str, ServerLoop], models, tmp_path_factory: pytest.TempPathFactory
) -> ServerLoop:
    """The module's server of the test's kind (its ``server`` parameter), on ``models[0]`` when it started."""
    kind = request.node.callspec.params["server"]
    if kind not in servers:
        servers[kind] = ServerLoop(kind, tmp_path_factory.mktemp(f"pause-{kind}"), models[0])
    return servers[kind]


@contextlib.asynccontextmanager
async def local_engine_server(run_dir: Path, model: Path) -> AsyncIterator:
    argv = [
        sys.executable,
        "-m",
        "miles_core.builtin.local_engine.server",
        "--model-path",
        str(model),
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--admin-api-key",
        "{token}",
    ]
    provider = LocalWorkerProvider(token=ADMIN, run_dir=run_dir)
    try:
        yield await provider.start(
            CommandWorkerSpec(
                name="engine-0", argv=argv, ports=["port"], health_url="http://{host}:{port}/health_generate"
            )
        )
    finally:
        await provider.shutdown()


async def in_flight(client: EngineClient, server: str) -> asyncio.Task:
    """A long greedy request, running on the server once this returns. The local engine is seen running it (its
    count of generated tokens moves; it generates the tiny model's ``LONG`` tokens in about a second, so a fixed wait
    could see it finished); SGLang's CPU engine takes many seconds for them, so a second's wait finds it running."""
    before = await generated_tokens(client) if server == "local" else 0
    task = asyncio.create_task(client.generate(PROMPT, GREEDY))
    if server == "local":
        while await generated_tokens(client) == before and not task.done():
            await asyncio.sleep(0.005)
    else:
        await asyncio.sleep(1.0)
    assert not task.done(), "the long request ended before the pause: make LONG larger"
    return task


async def generated_tokens(client: EngineClient) -> int:
    """The local engine's count of tokens generated so far (``/server_info``), which grows at every decode step."""
    return (await client.server_info())["internal_states"][0]["generated_tokens"]


async def finished_within(task: asyncio.Task, seconds: float) -> bool:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), seconds)
    return task.done()


@pytest.mark.parametrize("server", SERVERS)
def test_pause_abort_ends_in_flight_requests(server: str, served: ServerLoop) -> None:
    async def scenario(client: EngineClient) -> None:
        running = await in_flight(client, server)
        await client.pause_generation("abort")
        aborted = await asyncio.wait_for(running, 60)
        assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(aborted["output_ids"]) < LONG
        await client.continue_generation()
        after = await client.generate(PROMPT, {**GREEDY, "max_new_tokens": 4})
        assert len(after["output_ids"]) == 4  # serving again

    served.run(scenario)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
@pytest.mark.parametrize("server", SERVERS)
def test_pause_retract_and_in_place_hold_requests_until_continue(server: str, mode: str, served: ServerLoop) -> None:
    async def scenario(client: EngineClient) -> None:
        running = await in_flight(client, server)
        await client.pause_generation(mode)
        queued = asyncio.create_task(client.generate(PROMPT, {**GREEDY, "max_new_tokens": 4}))
        assert not await finished_within(queued, HELD_S)  # a new request waits for continue
        assert not running.done()  # the running one too
        await client.continue_generation()
        resumed, short = await asyncio.wait_for(asyncio.gather(running, queued), 300)
        assert resumed["meta_info"]["finish_reason"]["type"] == "length"
        assert len(resumed["output_ids"]) == LONG  # all its tokens
        assert len(short["output_ids"]) == 4

    served.run(scenario)


async def update_from_disk(client: EngineClient, model: Path, version: str) -> dict:
    """``/update_weights_from_disk`` as SGLang answers it (``success`` false is an answer here, not an error)."""
    try:
        return await client.update_weights_from_disk(str(model), weight_version=version)
    except EngineError as exc:
        return {"success": False, "message": str(exc)}


@pytest.mark.parametrize("mode", ["retract", "in_place"])
@pytest.mark.parametrize("server", SERVERS)
def test_a_weight_update_while_paused_then_continue(server: str, mode: str, served: ServerLoop, models) -> None:
    async def scenario(client: EngineClient) -> None:
        before = await client.weight_version()  # the module's server: earlier tests may have updated it
        version = f"paused-{mode}"
        running = await in_flight(client, server)
        await client.pause_generation(mode)
        answer = await update_from_disk(client, models[1], version)
        await client.continue_generation()
        done = await asyncio.wait_for(running, 300)
        assert done["meta_info"]["finish_reason"]["type"] == "length"
        assert len(done["output_ids"]) == LONG
        # SGLang's /model_info takes the new version only from an update it answers with success.
        refused = server == "sglang" and mode == "in_place"  # LOCAL_ENGINE_DIFFERS: the local engine takes it
        assert await client.weight_version() == (before if refused else version)
        if refused:  # the weights changed, but SGLang refuses the update: the paused request's KV cache
            assert not answer["success"]  # stays in its running batch, so the cache is not flushed
            assert "the cache was not flushed" in answer["message"], answer
        else:
            assert answer["success"], answer
        (old, new) = done["meta_info"]["weight_versions"]
        assert old["version"] == before and new["version"] == version, done["meta_info"]["weight_versions"]
        assert old["start"] == 0 < old["end"] == new["start"] < new["end"] == LONG
        assert done["meta_info"]["weight_version"] == version  # the weights it finished under (SGLang: also refused)

    served.run(scenario)
