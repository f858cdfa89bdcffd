"""A real SGLang server (sglang 0.5.23, its CPU engine) launched through the plugin from the SGLang environment:
served logprobs equal the trainer's before and after weight updates through ``disk`` and ``broadcast``, SGLang's
weight-update session is what ``broadcast`` needs, and a failed launch names its command and log tail. ``miles train
--engine sglang`` learns through ``broadcast`` with the engine on another host in
``tests/cluster/test_sglang_across_hosts.py``.

Skipped, with the reason, where SGLang cannot serve (see :mod:`tests.sglang.real_sglang`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from miles_plugins_sglang.launch import cpu_float16_is_wrong, sglang_capabilities

from miles_core.engines.client import EngineClient, EngineError
from miles_core.testkit.tiny_models import save_tiny_llama
from miles_core.training.losses import token_logprobs
from miles_core.training.weight_iterator import ModuleHfWeightIterator
from miles_core.weight_transfer.broadcast import GROUP_NAME, BroadcastProtocol, bucket_spec
from miles_core.weight_transfer.protocol import EngineEndpoint
from miles_core.weight_transfer.routes import STAGING_COPY, WEIGHTS_BY_NAME
from miles_core.weight_transfer.staged_load import WeightMismatchError, load_staged, verify_sampled
from miles_core.weight_transfer.staging_layout import StagingLayout
from miles_core.weight_transfer.tensor import TensorProtocol
from miles_core.workers.errors import WorkerStartError
from tests.numerics import served_logprob_tolerance
from tests.sglang.real_sglang import (
    READY_LINE,
    real_sglang_config,
    real_sglang_server,
    requires_real_sglang,
    sglang_python,
)

pytestmark = [pytest.mark.slow, requires_real_sglang]
TOKEN = "sglang-admin"
MODEL = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def served_dtype() -> torch.dtype:
    """Pinned (``server_args.dtype``) so that the tolerance knows it: SGLang's CPU kernels have no float32, and float16
    only where its float16 matmul is right on this machine (as the plugin chooses; asked when a test runs)."""
    return torch.bfloat16 if cpu_float16_is_wrong(sglang_python()) else torch.float16


PROMPTS = [[2, 17, 33, 9, 41], [5, 6, 7], [100, 200, 300, 400, 11, 12]]


def trainer_logprobs(model: transformers.PreTrainedModel, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The trainer's float32 logprobs of ``output`` after ``prompt`` (the loss's own function)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[:, len(prompt) - 1 : -1]
    return token_logprobs(logits, torch.tensor([output]))[0].double()


def largest_logit(model: transformers.PreTrainedModel, prompt: list[int], output: list[int]) -> float:
    with torch.no_grad():
        return model(torch.tensor([prompt + output])).logits.abs().max().item()


async def served(client: EngineClient, *, greedy: bool) -> list[tuple[list[int], list[int], torch.Tensor, dict]]:
    """Each prompt's output ids and the served logprobs, greedy or sampled (seeded)."""
    params = [
        {"max_new_tokens": 12, "ignore_eos": True, "temperature": 0.0 if greedy else 1.0, "sampling_seed": i}
        for i in range(len(PROMPTS))
    ]
    answers = await client.generate(PROMPTS, params)
    return [
        (
            prompt,
            a["output_ids"],
            torch.tensor([lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]], dtype=torch.float64),
            a["meta_info"],
        )
        for prompt, a in zip(PROMPTS, answers, strict=True)
    ]


async def max_difference(client: EngineClient, model: transformers.PreTrainedModel) -> tuple[float, float]:
    """The largest difference between served and trainer logprobs over greedy and sampled outputs, and the largest
    ratio of a sample's difference to its bound (:func:`served_logprob_tolerance`)."""
    worst, worst_ratio = 0.0, 0.0
    for greedy in (True, False):
        for prompt, output, logprobs, _meta in await served(client, greedy=greedy):
            assert len(output) == 12
            difference = (logprobs - trainer_logprobs(model, prompt, output)).abs().max().item()
            scale = largest_logit(model, prompt, output)
            bound = served_logprob_tolerance(served_dtype(), num_layers=MODEL["num_hidden_layers"], largest_logit=scale)
            worst, worst_ratio = max(worst, difference), max(worst_ratio, difference / bound)
    return worst, worst_ratio


def load(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("real-sglang")
    return {
        name: save_tiny_llama(root / name, seed=seed, **MODEL)
        for name, seed in (("initial", 0), ("disk", 1), ("broadcast", 2), ("tensor", 3))
    }


@pytest.fixture(scope="module")
def engine(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """One real SGLang server for the module, on a private event loop thread."""
    run_dir = tmp_path_factory.mktemp("real-sglang-run")
    loop = asyncio.new_event_loop()
    server = real_sglang_server(
        run_dir, checkpoints["initial"], token=TOKEN, **{"sglang.server_args": {"dtype": str(served_dtype())[6:]}}
    )
    info = loop.run_until_complete(server.__aenter__())
    try:
        yield info.url, Path(info.log_file)
    finally:
        loop.run_until_complete(server.__aexit__(None, None, None))
        loop.close()


def test_the_engine_log_shows_sglangs_own_start_up(engine: tuple[str, Path]) -> None:
    log = engine[1].read_text()
    assert READY_LINE in log and "sglang" in log


def test_served_logprobs_equal_the_trainers_before_and_after_updates(engine, checkpoints) -> None:
    """disk, then broadcast (SGLang's weight-update session): after each, the served logprobs are the new model's."""
    models = {name: load(path) for name, path in checkpoints.items()}

    async def scenario() -> dict[str, tuple[float, float]]:
        measured = {}
        async with EngineClient(engine[0], admin_key=TOKEN, name="engine-0") as client:
            measured["initial"] = await max_difference(client, models["initial"])
            await client.update_weights_from_disk(str(checkpoints["disk"]), weight_version="1")
            assert await client.weight_version() == "1"
            measured["disk"] = await max_difference(client, models["disk"])
            _stale, stale_ratio = await max_difference(client, models["initial"])
            assert stale_ratio > 5  # the update changed what is served, by far more than the bound
            protocol = BroadcastProtocol(backend="gloo", timeout_s=60)
            await protocol.connect([EngineEndpoint("engine-0", engine[0], TOKEN)])
            try:
                buckets = iter(ModuleHfWeightIterator(models["broadcast"], bucket_bytes=64 << 10))
                await protocol.transfer(buckets, version=2)
            finally:
                await protocol.close()
            assert await client.weight_version() == "2"
            measured["broadcast"] = await max_difference(client, models["broadcast"])
            meta = (await served(client, greedy=True))[0][3]
            assert meta["weight_version"] == "2"
        return measured

    measured = asyncio.run(scenario())
    print(
        "served vs trainer logprobs, max |difference| (as a fraction of the bound):",
        {name: f"{worst:.2e} ({ratio:.3f})" for name, (worst, ratio) in measured.items()},
    )
    for name, (worst, ratio) in measured.items():
        assert ratio <= 1, f"{name}: served logprobs differ from the trainer's by {worst:.3g}, {ratio:.2f}x the bound"


def test_a_distributed_update_outside_a_session_is_refused_and_the_protocol_stops_naming_the_engine(engine) -> None:
    """SGLang 0.5.23 answers 400 to a receive outside begin/end_weight_update and never joins the broadcast: the
    sender must not wait for it."""

    async def scenario() -> None:
        async with EngineClient(engine[0], admin_key=TOKEN, name="engine-0") as client:
            protocol = BroadcastProtocol(backend="gloo", timeout_s=60)
            await protocol.connect([EngineEndpoint("engine-0", engine[0], TOKEN)])
            try:
                await protocol._driver_group()  # as a transfer forms it
                tensor = torch.zeros(MODEL["vocab_size"], MODEL["hidden_size"])
                with pytest.raises(EngineError, match="begin_weight_update"):
                    await client.update_weights_from_distributed(
                        names=["model.embed_tokens.weight"],
                        dtypes=["float32"],
                        shapes=[list(tensor.shape)],
                        group_name=GROUP_NAME,
                    )
                bucket = [("model.embed_tokens.weight", tensor)]
                send = asyncio.ensure_future(asyncio.to_thread(protocol._send, bucket))
                with pytest.raises(EngineError, match=r"engine engine-0 did not join the broadcast"):
                    await asyncio.wait_for(protocol._receive(bucket_spec(bucket), GROUP_NAME, send), 30)
            finally:
                await protocol.close()

    asyncio.run(scenario())


def sglang_endpoint(url: str) -> EngineEndpoint:
    """The engine as the controller hands it to protocols: with the routes the sglang backend declares."""
    capabilities = sglang_capabilities(real_sglang_config())
    assert {STAGING_COPY, WEIGHTS_BY_NAME} <= capabilities.routes and capabilities.staging_loader
    return EngineEndpoint("engine-0", url, TOKEN, capabilities)


def test_tensor_loads_through_shared_memory_checked_by_reading_parameters_back(engine, checkpoints) -> None:
    """``tensor`` into real SGLang: buckets staged in shared memory, copied in by Miles' loader inside the server,
    every parameter read back (``/get_weights_by_name``) equal to the trainer's rounded to the served dtype, and the
    served logprobs are the new model's."""
    model = load(checkpoints["tensor"])
    names = [name for name, _ in model.named_parameters()]

    async def scenario() -> tuple[float, float]:
        protocol = TensorProtocol(staging_mb=0.125)  # several staging files of this small model: double-buffered
        protocol.verify_samples = len(names)  # every parameter, where a run samples a few per update
        await protocol.connect([sglang_endpoint(engine[0])])
        try:
            buckets = iter(ModuleHfWeightIterator(model, bucket_bytes=64 << 10))
            report = await protocol.transfer(buckets, version=3)
        finally:
            await protocol.close()
        assert report.protocol == "tensor" and report.num_bytes == sum(p.numel() * 4 for p in model.parameters())
        async with EngineClient(engine[0], admin_key=TOKEN, name="engine-0") as client:
            assert await client.weight_version() == "3"
            return await max_difference(client, model)

    worst, ratio = asyncio.run(scenario())
    assert ratio <= 1, f"served logprobs differ from the trainer's by {worst:.3g}, {ratio:.2f}x the bound"


def test_staging_in_the_held_dtype_serves_exactly_what_staging_at_full_width_serves(engine, checkpoints) -> None:
    """``held_dtype`` (the default): the matrices are staged in the served dtype, rounded by the staging copy as
    SGLang's copy would round them. The engine then holds the same parameters, bit for bit, and serves the same
    tokens and logprobs as after a transfer staged in the trainer's float32; the staging file holds about half the
    bytes; and, with nothing to verify, the version rides on the last load."""
    model = load(checkpoints["tensor"])
    names = [name for name, _ in model.named_parameters()]

    async def transfer(held_dtype: bool, version: int) -> tuple[int, dict, list]:
        protocol = TensorProtocol(held_dtype=held_dtype)
        await protocol.connect([sglang_endpoint(engine[0])])
        try:
            await protocol.transfer(iter(ModuleHfWeightIterator(model, bucket_bytes=64 << 10)), version=version)
            staged_bytes = protocol._staging[0][1].numel()
        finally:
            await protocol.close()
        async with EngineClient(engine[0], admin_key=TOKEN, name="engine-0") as client:
            assert await client.weight_version() == str(version)
            held = {name: await client.weights_by_name(name, truncate_size=1 << 20) for name in names}
            greedy = [(output, logprobs) for _, output, logprobs, _ in await served(client, greedy=True)]
        return staged_bytes, held, greedy

    async def scenario() -> None:
        full_bytes, full_held, full_greedy = await transfer(False, 11)
        narrow_bytes, narrow_held, narrow_greedy = await transfer(True, 12)
        assert full_bytes >= sum(p.numel() * 4 for p in model.parameters())
        assert narrow_bytes < 0.55 * full_bytes  # the matrices in bf16; the norms (a few KiB) in float32
        assert narrow_held == full_held
        for (output, logprobs), (full_output, full_logprobs) in zip(narrow_greedy, full_greedy, strict=True):
            assert output == full_output and torch.equal(logprobs, full_logprobs)

    asyncio.run(scenario())


def test_a_parameter_of_another_shape_is_refused_before_loading_and_the_engine_keeps_its_version(engine) -> None:
    async def scenario() -> None:
        async with EngineClient(engine[0], admin_key=TOKEN, name="engine-0") as client:
            before = await client.weight_version()
            protocol = TensorProtocol()
            await protocol.connect([sglang_endpoint(engine[0])])
            try:
                bad = [("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, MODEL["hidden_size"]))]
                with pytest.raises(
                    WeightMismatchError,
                    match=r"engine engine-0 .*parameter model\.layers\.0\.self_attn\.q_proj\.weight is "
                    # staged in the dtype the engine holds: bfloat16 where the CPU has AMX, float16 or 32 elsewhere
                    r"\[3, 64\] from the trainer \(staged as (bfloat16|float16|float32)\), but the engine serves it as "
                    r"floating\[64, 64\]; nothing "
                    r"was loaded",
                ):
                    await protocol.transfer(iter([bad]), version=99)
            finally:
                await protocol.close()
            assert await client.weight_version() == before and await client.health_generate()

    asyncio.run(scenario())


def test_a_parameter_the_engine_holds_otherwise_stops_naming_it_and_the_engine(engine, checkpoints) -> None:
    """The read-back check itself: against other values than the engine holds, it names the parameter."""
    model = load(checkpoints["disk"])  # not what the engine serves now
    name = "model.layers.1.mlp.down_proj.weight"

    async def scenario() -> None:
        async with EngineClient(engine[0], admin_key=TOKEN, name="engine-0") as client:
            with pytest.raises(WeightMismatchError, match=rf"engine engine-0 .* holds other values for {name}"):
                await verify_sampled(client, sglang_endpoint(engine[0]), {name: model.get_parameter(name)}, version=7)

    asyncio.run(scenario())


def test_the_loader_refuses_a_file_outside_the_staging_directory_and_the_server_goes_on(engine, tmp_path) -> None:
    """A staged load naming a file elsewhere (with the admin key): refused inside the server, which says why in the
    outcome the sender reads, and keeps serving (an exception in a custom loader would end SGLang's scheduler)."""
    layout = StagingLayout.of([("model.norm.weight", torch.ones(MODEL["hidden_size"]))])
    outside = tmp_path / "weights"
    outside.write_bytes(bytes(layout.size))

    async def scenario() -> None:
        async with EngineClient(engine[0], admin_key=TOKEN, name="engine-0") as client:
            endpoint = sglang_endpoint(engine[0])
            await client.begin_weight_update()
            try:
                with pytest.raises(EngineError, match=r"engine engine-0 .* is not a file of the weight-staging dir"):
                    await load_staged(client, endpoint, staging_path=outside, buffer_size=layout.size, layout=layout)
            finally:
                await client.end_weight_update()
            assert await client.health_generate()

    asyncio.run(scenario())


def test_a_launch_with_a_bad_flag_names_the_command_and_its_log(tmp_path: Path, checkpoints) -> None:
    async def scenario() -> None:
        async with real_sglang_server(tmp_path, checkpoints["initial"], **{"sglang.extra_args": ["--no-such-flag"]}):
            pass

    with pytest.raises(WorkerStartError) as failure:
        asyncio.run(scenario())
    message = str(failure.value)
    assert "engine-0" in message and "sglang.launch_server" in message
    assert "--no-such-flag" in message and "unrecognized arguments" in message
