"""The local engine as a real server process speaking SGLang's HTTP API, launched through the worker runtime."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import transformers

from miles_core.engines.client import EngineClient, EngineError
from miles_core.engines.weights import broadcast, new_weight_update_group
from miles_core.testkit.tiny_models import perturbed_state, save_tiny_llama
from miles_core.workers.errors import WorkerStartError
from miles_core.workers.local_provider import LocalWorkerProvider
from miles_core.workers.process import free_ports
from miles_core.workers.specs import CommandWorkerSpec

ADMIN = "engine-admin-key"
pytestmark = pytest.mark.slow


def engine_spec(name: str, model_path: Path) -> CommandWorkerSpec:
    argv = [
        sys.executable,
        "-m",
        "miles_core.builtin.local_engine.server",
        "--model-path",
        str(model_path),
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--random-seed",
        "3",
    ]
    return CommandWorkerSpec(
        name=name, argv=argv, ports=["port"], health_url="http://{host}:{port}/health_generate", startup_timeout_s=120
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One engine process for the module (the provider's token is the engine's admin key)."""
    provider = LocalWorkerProvider(token=ADMIN, run_dir=tmp_path_factory.mktemp("engine-run"))
    info = asyncio.run(provider.start(engine_spec("engine-0", model_dir)))
    yield info
    asyncio.run(provider.shutdown())


def run(coro):
    return asyncio.run(coro)


def reference_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[len(prompt) - 1 + i, token].item() for i, token in enumerate(output)]


def test_generate_matches_the_model(engine, model_dir: Path) -> None:
    async def scenario() -> None:
        async with EngineClient(engine.url, admin_key=ADMIN) as client:
            started = time.perf_counter()
            single = await client.generate([5, 6, 7], {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 1})
            round_trip = time.perf_counter() - started
            batch = await client.generate([[5, 6, 7], [9]], [{"max_new_tokens": 4}, {"max_new_tokens": 2}])
        meta = single["meta_info"]
        assert 0 < meta["e2e_latency"] < round_trip  # SGLang's key: the engine's own part of the round trip
        assert len(single["output_ids"]) == meta["completion_tokens"] <= 6
        assert meta["prompt_tokens"] == 3 and meta["weight_version"] == "default"
        assert meta["finish_reason"]["type"] in ("length", "stop")
        tokens = [t for _, t, _ in meta["output_token_logprobs"]]
        assert tokens == single["output_ids"]
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
        expected = reference_logprobs(model, [5, 6, 7], tokens)
        actual = [lp for lp, _, _ in meta["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(actual, expected, strict=True)) < 1e-4
        assert [len(item["output_ids"]) <= n for item, n in zip(batch, [4, 2], strict=True)] == [True, True]

    run(scenario())


def test_per_request_seed_is_reproducible(engine) -> None:
    async def scenario() -> None:
        async with EngineClient(engine.url) as client:
            params = {"max_new_tokens": 12, "sampling_seed": 42, "ignore_eos": True}
            first = await client.generate([3, 4], params)
            crowded = await asyncio.gather(
                *(client.generate([3, 4], {**params, "sampling_seed": s}) for s in (42, 7, 8))
            )
        assert crowded[0]["output_ids"] == first["output_ids"]  # batched with others, same seed, same tokens
        assert crowded[1]["output_ids"] != first["output_ids"]

    run(scenario())


def test_stop_token_and_greedy(engine) -> None:
    async def scenario() -> None:
        async with EngineClient(engine.url) as client:
            greedy = await client.generate([8, 9], {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
            stop_at = greedy["output_ids"][2]
            stopped = await client.generate(
                [8, 9], {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [stop_at], "ignore_eos": True}
            )
        first_stop = greedy["output_ids"].index(stop_at)
        assert stopped["output_ids"] == greedy["output_ids"][: first_stop + 1]
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}

    run(scenario())


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "beam_width": 3}}, "beam_width"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": []}, "input_ids must be a non-empty list"),
        ({"input_ids": [[1], "x"]}, "input_ids must be a non-empty list"),
        ({"text": "hello"}, "no tokenizer"),
        ({"input_ids": [[1], [2]], "stream": True}, "stream=true takes one prompt"),
        ({"input_ids": [1], "lora_path": "adapter"}, "lora_path 'adapter' names no loaded adapter"),
        ({}, "send input_ids"),
    ],
)
def test_bad_generate_requests_are_400(engine, body: dict, message: str) -> None:
    response = httpx.post(f"{engine.url}/generate", json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]


def test_control_routes_need_the_admin_key(engine) -> None:
    for path in ("/update_weights_from_disk", "/pause_generation", "/update_weight_version", "/flush_cache"):
        response = httpx.post(f"{engine.url}{path}", json={}, headers={"Authorization": "Bearer nope"})
        assert response.status_code == 401, path
    assert httpx.post(f"{engine.url}/generate", content=b"{oops").status_code == 400


def test_weight_updates_from_disk_and_tensor(engine, model_dir: Path, tmp_path: Path) -> None:
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()

    async def scenario() -> None:
        async with EngineClient(engine.url, admin_key=ADMIN) as client:
            state = perturbed_state(base, seed=1)
            base.load_state_dict(state)
            base.save_pretrained(tmp_path / "v1")
            await client.update_weights_from_disk(str(tmp_path / "v1"), weight_version="1")
            await check_serves(client, base, "1")

            state = perturbed_state(base, seed=2)
            base.load_state_dict(state)
            await client.update_weights_from_tensor(state, weight_version="2")
            await check_serves(client, base, "2")

            bad = {**state, "model.norm.weight": torch.zeros(3)}
            with pytest.raises(EngineError, match=r"model\.norm\.weight: shape \(3,\), model has \(64,\)"):
                await client.update_weights_from_tensor(bad, weight_version="3")
            with pytest.raises(EngineError, match=r"is not a directory holding \.safetensors"):
                await client.update_weights_from_disk(str(tmp_path / "missing"), weight_version="3")
            await check_serves(client, base, "2")  # nothing of the failed updates was loaded

            response = await client._http.post(
                "/update_weights_from_tensor",
                json={"serialized_named_tensors": ["gASVAAAAAAAAAAAu"], "weight_version": "4"},
            )  # a pickle, base64
            assert response.status_code == 400 and "not safetensors data" in response.json()["message"]

    run(scenario())


async def check_serves(client: EngineClient, model: torch.nn.Module, version: str) -> None:
    out = await client.generate([4, 5, 6], {"max_new_tokens": 5, "sampling_seed": 9, "ignore_eos": True})
    assert out["meta_info"]["weight_version"] == version
    assert await client.weight_version() == version
    tokens = out["output_ids"]
    expected = reference_logprobs(model, [4, 5, 6], tokens)
    actual = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(actual, expected, strict=True)) < 1e-4


def test_weight_update_over_a_gloo_group(engine, model_dir: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    state = perturbed_state(model, seed=5)
    model.load_state_dict(state)
    (port,) = free_ports(1)

    async def scenario() -> None:
        async with EngineClient(engine.url, admin_key=ADMIN) as client:
            engine_joins = client.init_weights_update_group(
                master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2
            )
            group, _ = await asyncio.gather(
                asyncio.to_thread(
                    new_weight_update_group,
                    master_address="127.0.0.1",
                    master_port=port,
                    rank=0,
                    world_size=2,
                    group_name="weight_update_group",
                ),
                engine_joins,
            )
            names = list(state)
            await client.begin_weight_update()  # as SGLang, a session around distributed updates (one at a time)
            with pytest.raises(EngineError, match="a weight-update session is already open"):
                await client.begin_weight_update()
            receive = client.update_weights_from_distributed(
                names=names,
                dtypes=[str(state[n].dtype).removeprefix("torch.") for n in names],
                shapes=[list(state[n].shape) for n in names],
                weight_version="9",
            )

            def send() -> None:
                for name in names:
                    broadcast(group, state[name].contiguous(), root=0)

            await asyncio.gather(asyncio.to_thread(send), receive)
            await client.end_weight_update()
            await check_serves(client, model, "9")
            with pytest.raises(EngineError, match="between begin_weight_update"):
                await client.update_weights_from_distributed(
                    names=names[:1], dtypes=["float32"], shapes=[list(state[names[0]].shape)]
                )
            await client.destroy_weights_update_group()
            with pytest.raises(EngineError, match="no weight update group"):
                await client.destroy_weights_update_group()

    run(scenario())


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("mpi", "backend must be one of gloo, nccl"),
        pytest.param(
            "nccl",
            "needs a CUDA device",
            marks=pytest.mark.skipif(
                torch.cuda.is_available(), reason="this machine has CUDA, so the engine can join an NCCL group"
            ),
        ),
    ],
)
def test_a_group_backend_the_engine_cannot_use_is_refused_and_leaves_no_group(engine, backend, message) -> None:
    async def scenario() -> None:
        async with EngineClient(engine.url, admin_key=ADMIN) as client:
            with pytest.raises(EngineError, match=message):
                await client.init_weights_update_group(
                    master_address="127.0.0.1",
                    master_port=free_ports(1)[0],
                    rank_offset=1,
                    world_size=2,
                    backend=backend,
                )
            with pytest.raises(EngineError, match="no weight update group"):
                await client.destroy_weights_update_group()

    run(scenario())


def test_pause_abort_ends_running_requests_and_continue_resumes(engine) -> None:
    """A request seen running (its first streamed token arrived) is ended by ``abort`` with the tokens it has; a
    request sent while paused waits until continue. The engine is continued whatever happens, so that a failure
    here cannot leave it paused under the module's later tests (their requests would wait forever)."""

    async def stream_until_aborted(client: httpx.AsyncClient, running: asyncio.Event) -> dict:
        body = {"input_ids": [3], "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}, "stream": True}
        last: dict = {}
        async with client.stream("POST", f"{engine.url}/generate", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    last = json.loads(line.removeprefix("data: "))
                    running.set()
        return last

    async def scenario() -> None:
        async with EngineClient(engine.url, admin_key=ADMIN) as client, httpx.AsyncClient(timeout=60) as http:
            try:
                running = asyncio.Event()
                long = asyncio.create_task(stream_until_aborted(http, running))
                await asyncio.wait_for(running.wait(), timeout=60)
                await client.pause_generation("abort")
                aborted = await asyncio.wait_for(long, timeout=60)
                assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
                assert 0 < len(aborted["output_ids"]) < 500
                held = asyncio.create_task(client.generate([3], {"max_new_tokens": 2, "ignore_eos": True}))
                await asyncio.sleep(0.3)
                assert not held.done()  # paused: requests wait
            finally:
                await client.continue_generation()
            assert len((await asyncio.wait_for(held, timeout=60))["output_ids"]) == 2
            assert await client.health_generate()

    run(scenario())


def test_bad_model_directory_fails_the_launch_with_its_log(tmp_path: Path) -> None:
    provider = LocalWorkerProvider(token=ADMIN, run_dir=tmp_path)
    with pytest.raises(WorkerStartError) as caught:
        run(provider.start(engine_spec("engine-bad", tmp_path / "nowhere")))
    assert "nowhere': No such file or directory (expected an HF checkpoint directory)" in str(caught.value)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    with pytest.raises(WorkerStartError, match="cannot load model from"):
        run(provider.start(engine_spec("engine-corrupt", corrupt)))


def test_model_info_and_server_info(engine, model_dir: Path) -> None:
    info = httpx.get(f"{engine.url}/get_model_info").json()
    assert info["model_path"] == str(model_dir) and info["is_generation"] is True
    server = httpx.get(f"{engine.url}/server_info").json()
    assert server["random_seed"] == 3 and server["internal_states"][0]["generated_tokens"] > 0


def test_a_broadcast_an_engine_refuses_fails_at_once_by_name_and_the_next_one_works(engine, model_dir: Path) -> None:
    """The engine refuses a bucket (a name the model lacks): the trainer's broadcast would wait for a rank that never
    joins; the update fails naming the engine, well before the group's timeout, and leaves no session open."""
    from miles_core.training.weight_iterator import ModuleHfWeightIterator
    from miles_core.weight_transfer.broadcast import BroadcastProtocol
    from miles_core.weight_transfer.protocol import EngineEndpoint

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.load_state_dict(perturbed_state(model, seed=6))
    endpoints = [EngineEndpoint("engine-0", engine.url, ADMIN)]

    async def scenario() -> None:
        protocol = BroadcastProtocol(backend="gloo", timeout_s=60)
        try:
            await protocol.connect(endpoints)
            bad_bucket = [[("model.no_such_layer.weight", torch.zeros(4))]]
            with pytest.raises(EngineError, match=r"engine engine-0 did not join the broadcast.*no_such_layer"):
                await asyncio.wait_for(protocol.transfer(iter(bad_bucket), version=7), timeout=30)
            await protocol.connect(endpoints)  # as the controller's retry does: a new group
            await protocol.transfer(iter(ModuleHfWeightIterator(model, bucket_bytes=1 << 16)), version=8)
        finally:
            await protocol.close()
        async with EngineClient(engine.url, admin_key=ADMIN) as client:
            await check_serves(client, model, "8")

    run(scenario())
