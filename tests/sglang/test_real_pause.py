"""SGLang's pause semantics, measured on a real SGLang server and compared with Miles' local engine.

``abort`` ends in-flight requests with finish reason ``abort``; ``retract`` and ``in_place`` hold them (and every new
request) until ``/continue_generation``, after which they finish with all their tokens; a weight update from disk
while paused ``in_place`` lets the in-flight request finish afterwards, its ``meta_info.weight_versions`` segments
recording where the new version took over. Each scenario runs against both servers; where the local engine differs
(see ``LOCAL_ENGINE_DIFFERS``), the test asserts what each one does. The real-SGLang cases skip, saying why, where
SGLang cannot run (``requires_real_sglang``)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
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
    "retract": "the running batch runs to its end during the pause (only queued requests are held)",
    "in_place": "the running batch runs to its end during the pause (only queued requests are held)",
}
"""How the local engine's pause differs from SGLang's, by mode (``miles_core/engines/local_engine.py``)."""
SERVERS = [pytest.param("sglang", marks=requires_real_sglang), "local"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pause-models")
    return tuple(save_tiny_llama(root / f"model-{seed}", seed=seed, max_position_embeddings=CONTEXT)
                 for seed in (0, 1))  # fmt: skip


@contextlib.asynccontextmanager
async def served(server: str, run_dir: Path, model: Path) -> AsyncIterator[EngineClient]:
    """A client of a fresh server of kind ``server`` on ``model``."""
    if server == "sglang":
        context = real_sglang_server(run_dir, model, token=ADMIN, **{"engine.max_batch_size": 8})
    else:
        context = local_engine_server(run_dir, model)
    async with context as info, EngineClient(info.url, admin_key=ADMIN, name=server) as client:
        yield client


@contextlib.asynccontextmanager
async def local_engine_server(run_dir: Path, model: Path) -> AsyncIterator:
    argv = [sys.executable, "-m", "miles_core.engines.local_server", "--model-path", str(model), "--host", "{host}",
            "--port", "{port}", "--admin-api-key", "{token}"]  # fmt: skip
    provider = LocalWorkerProvider(token=ADMIN, run_dir=run_dir)
    try:
        yield await provider.start(CommandWorkerSpec(name="engine-0", argv=argv, ports=["port"],
                                                     health_url="http://{host}:{port}/health_generate"))  # fmt: skip
    finally:
        await provider.shutdown()


async def in_flight(client: EngineClient) -> asyncio.Task:
    """A long greedy request, running on the server once this returns."""
    task = asyncio.create_task(client.generate(PROMPT, GREEDY))
    await asyncio.sleep(1.0)
    assert not task.done(), "the long request ended before the pause: make LONG larger"
    return task


async def finished_within(task: asyncio.Task, seconds: float) -> bool:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), seconds)
    return task.done()


@pytest.mark.parametrize("server", SERVERS)
def test_pause_abort_ends_in_flight_requests(server: str, models, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with served(server, tmp_path, models[0]) as client:
            running = await in_flight(client)
            await client.pause_generation("abort")
            aborted = await asyncio.wait_for(running, 60)
            assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
            assert len(aborted["output_ids"]) < LONG
            await client.continue_generation()
            after = await client.generate(PROMPT, {**GREEDY, "max_new_tokens": 4})
            assert len(after["output_ids"]) == 4  # serving again

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["retract", "in_place"])
@pytest.mark.parametrize("server", SERVERS)
def test_pause_retract_and_in_place_hold_requests_until_continue(server: str, mode: str, models,
                                                                 tmp_path: Path) -> None:  # fmt: skip
    async def scenario() -> None:
        async with served(server, tmp_path, models[0]) as client:
            running = await in_flight(client)
            await client.pause_generation(mode)
            queued = asyncio.create_task(client.generate(PROMPT, {**GREEDY, "max_new_tokens": 4}))
            assert not await finished_within(queued, HELD_S)  # a new request waits for continue
            if server == "local":  # LOCAL_ENGINE_DIFFERS: its running batch finishes while paused
                assert await finished_within(running, 120)
            else:
                assert not running.done()
            await client.continue_generation()
            resumed, short = await asyncio.wait_for(asyncio.gather(running, queued), 300)
            assert resumed["meta_info"]["finish_reason"]["type"] == "length"
            assert len(resumed["output_ids"]) == LONG  # all its tokens
            assert len(short["output_ids"]) == 4

    asyncio.run(scenario())


async def update_from_disk(client: EngineClient, model: Path, version: str) -> dict:
    """``/update_weights_from_disk`` as SGLang answers it (``success`` false is an answer here, not an error)."""
    try:
        return await client.update_weights_from_disk(str(model), weight_version=version)
    except EngineError as exc:
        return {"success": False, "message": str(exc)}


@pytest.mark.parametrize("mode", ["retract", "in_place"])
@pytest.mark.parametrize("server", SERVERS)
def test_a_weight_update_while_paused_then_continue(server: str, mode: str, models, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with served(server, tmp_path, models[0]) as client:
            running = await in_flight(client)
            await client.pause_generation(mode)
            answer = await update_from_disk(client, models[1], "1")
            await client.continue_generation()
            done = await asyncio.wait_for(running, 300)
            assert done["meta_info"]["finish_reason"]["type"] == "length"
            assert len(done["output_ids"]) == LONG
            # SGLang's /model_info takes the new version only from an update it answers with success.
            refused = server == "sglang" and mode == "in_place"
            assert await client.weight_version() == ("default" if refused else "1")
            if server == "local":  # the update waits for the running batch: it ran on the old weights alone
                assert answer["success"], answer
                assert "weight_versions" not in done["meta_info"]
                return
            if refused:  # the weights changed, but SGLang refuses the update: the paused request's KV cache
                assert not answer["success"]  # stays in its running batch, so the cache is not flushed
                assert "the cache was not flushed" in answer["message"], answer
            else:
                assert answer["success"], answer
            (old, new) = done["meta_info"]["weight_versions"]
            assert old["version"] == "default" and new["version"] == "1", done["meta_info"]["weight_versions"]
            assert old["start"] == 0 < old["end"] == new["start"] < new["end"] == LONG

    asyncio.run(scenario())
