"""Routed experts from the local engine (``return_routed_experts``, SGLang's ``meta_info.routed_experts``): every
token the model ran on is reported with the experts its router chose, equal to a reference forward of the model
over the same tokens, for requests batched continuously (joining a running batch, retracted and prefilled again);
the wire format is SGLang's (base64 int32 ``[tokens, layers, top_k]``) and malformed routing is refused by name.

The comparison is exact: routing is a discrete top-k of router probabilities, and the engine's batched float32
forward (left padding, a KV cache) differs from the lone reference forward by a few float32 roundoffs (1e-7
relative), so the choice flips only for a token whose two candidate experts' probabilities are that close; the
tiny model's perturbed routers leave gaps many orders larger (checked by the margin assertion below).
"""

from __future__ import annotations

import asyncio
import base64
import sys
import threading
from pathlib import Path

import httpx
import numpy
import pytest
import torch
import transformers

from miles_core.builtin.local_engine.engine import LocalEngine, RequestError
from miles_core.builtin.local_engine.sampling import GenerationRequest, SamplingParams
from miles_core.engines.client import EngineClient
from miles_core.engines.generate_types import GenerateOutput
from miles_core.engines.generate_types import SamplingParams as ClientParams
from miles_core.engines.routed_experts import (
    RoutedExpertsError,
    RoutingShape,
    check_routed_experts,
    decode_routed_experts,
    encode_routed_experts,
)
from miles_core.errors import EngineError
from miles_core.models.moe_routing import RoutingCapture
from miles_core.testkit.tiny_models import (
    TINY_MOE,
    save_from_config,
    save_tiny_llama,
    save_tiny_qwen3_moe,
    tiny_deepseek_v3_config,
)
from miles_core.workers.local_provider import LocalWorkerProvider
from miles_core.workers.specs import CommandWorkerSpec

SHAPE = RoutingShape(num_layers=2, top_k=2, num_experts=8)  # the model below


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen3_moe(
        tmp_path_factory.mktemp("moe") / "model", scale=0.1, num_experts=8, norm_topk_prob=True, intermediate_size=128
    )


@pytest.fixture
def engine(moe_dir: Path, tmp_path: Path) -> LocalEngine:
    staging = tmp_path / "staging"
    staging.mkdir(mode=0o700)
    return LocalEngine(moe_dir, staging_dir=staging, max_batch_size=8)


def reference_routing(engine: LocalEngine, ids: list[int]) -> torch.Tensor:
    """The experts of a lone forward of the model over ``ids``, and the smallest gap between the k-th and the
    (k+1)-th router probability of any token (how far the choice is from a tie)."""
    capture = RoutingCapture(engine.model, SHAPE)
    gaps: list[float] = []
    hooks = [
        router.register_forward_hook(
            lambda m, a, out: gaps.append(
                float(torch.softmax(out[0].float(), -1).sort(-1, True).values[:, 1:3].diff().abs().min())
            )
        )
        for router in capture.routers.values()
    ]
    try:
        with torch.no_grad():
            engine.model(torch.tensor([ids]))
        return capture.experts(1, len(ids))[0], min(gaps)
    finally:
        capture.close()
        for hook in hooks:
            hook.remove()


def test_the_engine_reports_the_experts_of_every_token_with_continuous_batching(engine: LocalEngine) -> None:
    started = threading.Event()

    def on_token(token: int, logprob: float, top: object) -> None:
        started.set()

    def request(prompt: list[int], count: int, seed: int, **extra) -> GenerationRequest:
        params = SamplingParams(max_new_tokens=count, temperature=1.0, sampling_seed=seed, ignore_eos=True)
        return GenerationRequest(prompt, params, return_routed_experts=True, **extra)

    async def scenario():
        engine.start()
        first = asyncio.ensure_future(engine.generate([request([3, 4, 5], 40, 1, on_token=on_token)]))
        await asyncio.to_thread(started.wait, 60)
        joined = asyncio.ensure_future(engine.generate([request([7], 12, 2), request([9, 10, 11, 12, 13], 9, 3)]))
        await asyncio.sleep(0.05)
        await engine.pause("retract")  # every running row leaves and is prefilled again: routing must stay whole
        engine.resume()
        return [*(await first), *(await joined)]

    results = asyncio.run(scenario())
    for prompt, result in zip([[3, 4, 5], [7], [9, 10, 11, 12, 13]], results, strict=True):
        ids = prompt + result.output_ids
        assert result.routed_experts is not None and result.routed_experts.dtype == torch.int32
        assert list(result.routed_experts.shape) == [len(ids) - 1, SHAPE.num_layers, SHAPE.top_k]
        expected, margin = reference_routing(engine, ids[:-1])
        assert margin > 1e-5  # no near tie that float32 reordering could flip (see the module docstring)
        assert torch.equal(result.routed_experts, expected)


def test_requests_that_do_not_ask_get_no_routing_and_a_dense_model_refuses(engine: LocalEngine, tmp_path: Path) -> None:
    async def scenario():
        engine.start()
        return await engine.generate([GenerationRequest([3], SamplingParams(max_new_tokens=2))])

    assert asyncio.run(scenario())[0].routed_experts is None
    dense = LocalEngine(save_tiny_llama(tmp_path / "llama"), staging_dir=tmp_path)
    with pytest.raises(RequestError, match="has no Mixture-of-Experts routers to report"):
        dense.admit(GenerationRequest([3], SamplingParams(max_new_tokens=2), return_routed_experts=True))


def test_deepseek_v3_reports_the_experts_its_sigmoid_group_limited_router_chose(tmp_path: Path) -> None:
    """DeepSeek-V3's router (sigmoid scores plus the selection bias, top-k within the best group): the engine's
    recorded experts equal a lone forward's choice, its dense first layer reports zeros."""
    shape = RoutingShape(num_layers=2, top_k=2, num_experts=4)
    model_dir = save_from_config(tiny_deepseek_v3_config(), tmp_path / "deepseek", scale=0.1)
    engine = LocalEngine(model_dir, staging_dir=tmp_path)

    async def scenario():
        engine.start()
        params = SamplingParams(max_new_tokens=6, ignore_eos=True)
        return await engine.generate([GenerationRequest([3, 4, 5], params, return_routed_experts=True)])

    result = asyncio.run(scenario())[0]
    ids = [3, 4, 5, *result.output_ids][:-1]
    capture = RoutingCapture(engine.model, shape)
    try:
        with torch.no_grad():
            engine.model(torch.tensor([ids]))
        expected = capture.experts(1, len(ids))[0]
    finally:
        capture.close()
    assert list(result.routed_experts.shape) == [len(ids), 2, 2]
    assert torch.equal(result.routed_experts, expected)
    assert not result.routed_experts[:, 0].any() and len(result.routed_experts[:, 1].unique()) > 2


def test_a_model_whose_routers_cannot_be_captured_serves_and_refuses_only_requests_for_its_routing(
    tmp_path: Path,
) -> None:
    """Mixtral's router is not one capture supports: the engine serves the model all the same, and a request for
    its routed experts is refused naming the router."""
    config = transformers.AutoConfig.for_model(
        "mixtral", **{**TINY_MOE, "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2}
    )
    engine = LocalEngine(save_from_config(config, tmp_path / "mixtral"), staging_dir=tmp_path)

    async def scenario():
        engine.start()
        return await engine.generate([GenerationRequest([3], SamplingParams(max_new_tokens=2))])

    assert len(asyncio.run(scenario())[0].output_ids) == 2
    with pytest.raises(RequestError, match=r"return_routed_experts: .*MixtralTopKRouter"):
        engine.admit(GenerationRequest([3], SamplingParams(max_new_tokens=2), return_routed_experts=True))


# -- over HTTP, as SGLang's API -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(moe_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    argv = [sys.executable, "-m", "miles_core.builtin.local_engine.server", "--model-path", str(moe_dir)]
    argv += ["--host", "{host}", "--port", "{port}"]
    spec = CommandWorkerSpec(
        name="moe-engine", argv=argv, ports=["port"], health_url="http://{host}:{port}/health", startup_timeout_s=120
    )
    provider = LocalWorkerProvider(token="admin", run_dir=tmp_path_factory.mktemp("run"))
    info = asyncio.run(provider.start(spec))
    yield info
    asyncio.run(provider.shutdown())


@pytest.mark.slow
def test_the_server_sends_sglangs_field_and_the_client_reads_it(server, engine: LocalEngine) -> None:
    prompts = [[3, 4, 5], [6]]
    params = ClientParams(max_new_tokens=6, sampling_seed=4)

    async def scenario():
        async with EngineClient(server.url) as client:
            raw = await client.generate(prompts[0], params.to_sglang(), return_routed_experts=True)
            typed = await client.generate_outputs(prompts, params, routing=SHAPE)
            plain = await client.generate(prompts[0], params.to_sglang())
        return raw, typed, plain

    raw, typed, plain = asyncio.run(scenario())
    tokens = len(prompts[0]) + len(raw["output_ids"]) - 1
    ids = numpy.frombuffer(base64.b64decode(raw["meta_info"]["routed_experts"]), dtype="<i4")
    assert ids.reshape(-1, SHAPE.num_layers, SHAPE.top_k).shape[0] == tokens  # SGLang's client-side reshape
    assert "routed_experts" not in plain["meta_info"]
    for prompt, output in zip(prompts, typed, strict=True):
        ids = prompt + output.output_ids
        assert output.routed_experts == reference_routing(engine, ids[:-1])[0].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("value", ["yes", 1, None, [True]], ids=["string", "int", "null", "list"])
def test_the_server_refuses_a_malformed_return_routed_experts(server, value) -> None:
    body = {"input_ids": [3], "sampling_params": {"max_new_tokens": 1}, "return_routed_experts": value}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=30)
    if value is None:  # SGLang's default: asks for nothing
        assert response.status_code == 200 and "routed_experts" not in response.json()["meta_info"]
        return
    assert response.status_code == 400 and "return_routed_experts" in response.json()["error"]


# -- the wire format and its checks -------------------------------------------------------------------------


def answer(routed: object, *, output_ids: list[int] = (5, 6), reason: str = "length") -> dict:
    meta = {"finish_reason": {"type": reason}, "weight_version": "default"}
    if routed is not ...:
        meta["routed_experts"] = routed
    return {"text": "", "output_ids": list(output_ids), "meta_info": meta}


def test_generate_output_decodes_routed_experts() -> None:
    rows = numpy.arange(4 * 2 * 2).reshape(4, 2, 2) % 8  # a prompt of 3 and 2 outputs: 4 tokens ran
    output = GenerateOutput.from_sglang(answer(encode_routed_experts(rows)), engine="e", routing=SHAPE, prompt_tokens=3)
    assert output.routed_experts == rows.tolist()
    aborted = GenerateOutput.from_sglang(answer(..., reason="abort"), engine="e", routing=SHAPE, prompt_tokens=3)
    assert aborted.routed_experts is None  # an aborted answer may come without them


@pytest.mark.parametrize(
    ("routed", "match"),
    [
        (..., "expected a base64 string, got NoneType"),
        ([[[0, 1]]], "expected a base64 string, got list"),
        ("%%%", "not valid base64"),
        (encode_routed_experts(numpy.zeros((3, 2, 2))), "48 bytes, expected 64: 4 tokens x 2 layers x top-2"),
        (encode_routed_experts(numpy.full((4, 2, 2), 8)), "expert id 8 is out of range: ids are 0 to 7"),
        (encode_routed_experts(numpy.full((4, 2, 2), -3)), "expert id -3 is out of range"),
    ],
    ids=["missing", "json-lists", "not-base64", "too-few-tokens", "id-too-large", "negative-id"],
)
def test_malformed_routed_experts_from_an_engine_are_refused(routed: object, match: str) -> None:
    with pytest.raises(EngineError, match=match) as refused:
        GenerateOutput.from_sglang(answer(routed), engine="engine-0", routing=SHAPE, prompt_tokens=3)
    assert "engine engine-0 sent a malformed /generate answer: meta_info.routed_experts" in str(refused.value)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("0,1", "expected a list of 2 tokens' \\[layers\\]\\[top_k\\] ids, got str"),
        ([[[0, 1]]], "1 tokens' routing, expected 2"),
        ([[[0, 1]], [[0]]], "every token needs the same layers|expected \\[tokens\\]\\[layers\\]\\[top_k\\]"),
        ([[[0, 1]], [[0, 1.5]]], "with a non-integer id"),
        ([[[0, True]], [[0, 1]]], "with a non-integer id"),
        ([[[0, 1], [1, 2]], [[0, -1], [1, 2]]], "expert id -1 is out of range: ids are 0 to 7"),
        ([[[0, 1, 2]], [[0, 1, 2]]], "each token holds \\[1\\]\\[3\\] ids, the model 2 layers x top-2 of 8"),
        ([[[0, 9], [1, 2]], [[0, 1], [1, 2]]], "expert id 9 is out of range: ids are 0 to 7"),
    ],
    ids=["string", "too-few", "ragged", "float", "bool", "negative", "wrong-shape", "too-large"],
)
def test_malformed_routed_experts_lists_are_refused(value: object, match: str) -> None:
    with pytest.raises(RoutedExpertsError, match=match):
        check_routed_experts(value, num_tokens=2, shape=SHAPE)


def test_decode_is_the_inverse_of_encode() -> None:
    rows = numpy.random.default_rng(0).integers(0, 8, size=(5, 2, 2))
    assert decode_routed_experts(encode_routed_experts(rows), shape=SHAPE, num_tokens=5) == rows.tolist()
