"""The local engine serves LoRA adapters as SGLang does: ``/load_lora_adapter``, ``/unload_lora_adapter`` and
``lora_path`` on ``/generate``, each adapter's logprobs those of peft's model, bad requests refused by name."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import httpx
import peft
import pytest
import torch
import transformers

from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.sections import TrainSection
from miles_core.engines.client import EngineClient, EngineError
from miles_core.testkit.tiny_models import save_tiny_llama
from miles_core.workers.local_provider import LocalWorkerProvider
from tests.engines.test_local_engine import ADMIN, engine_spec
from tests.numerics import served_logprob_tolerance

pytestmark = pytest.mark.slow
PROMPT = [2, 7, 9, 11]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", seed=4)


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Two adapters of the trainer (random, so that each changes the logprobs): name -> (directory, digest)."""
    root = tmp_path_factory.mktemp("adapters")
    found = {}
    for index, name in enumerate(("first", "second")):
        trainer = TorchTrainer.from_pretrained(model_dir, TrainSection(lora_rank=4, lora_alpha=8.0), seed=index)
        with torch.no_grad():
            for parameter in trainer.trained_parameters():
                parameter.normal_(std=0.2, generator=torch.Generator().manual_seed(index))
        found[name] = (root / name, trainer.save_adapter(root / name))
    return found


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    provider = LocalWorkerProvider(token=ADMIN, run_dir=tmp_path_factory.mktemp("engine-run"))
    info = asyncio.run(provider.start(engine_spec("engine-0", model_dir)))
    yield info
    asyncio.run(provider.shutdown())


def peft_logprobs(model_dir: Path, adapter: Path | None, tokens: list[int]) -> list[float]:
    """The float32 logprobs of ``tokens`` after ``PROMPT`` under the base with ``adapter`` (peft's model)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1].float(), dim=-1)
    return logprobs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()


def served(answer: dict) -> tuple[list[int], list[float]]:
    return answer["output_ids"], [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]


def tolerance(model_dir: Path) -> float:
    """Float32 on both sides (the engine decodes with a KV cache, peft runs the whole sequence): their rounding."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    return served_logprob_tolerance(torch.float32, num_layers=config.num_hidden_layers, largest_logit=10.0)


def test_adapters_load_serve_their_logprobs_and_unload(engine, model_dir: Path, adapters) -> None:
    params = {"max_new_tokens": NEW_TOKENS, "sampling_seed": 5, "ignore_eos": True}

    async def scenario() -> None:
        async with EngineClient(engine.url, admin_key=ADMIN) as client:
            for name, (path, digest) in adapters.items():
                answer = await client.load_lora_adapter(name, str(path))
                assert answer["digest"] == digest  # the adapter as the engine holds it is the trainer's
                assert answer["loaded_adapters"][name] == str(path)
            outputs = {
                name: served(await client.generate(PROMPT, params, lora_path=name)) for name in (*adapters, None)
            }
            batched = await client.generate([PROMPT, PROMPT], params, lora_path="first")
            await client.unload_lora_adapter("first")
            with pytest.raises(EngineError, match="lora_path 'first' names no loaded adapter"):
                await client.generate(PROMPT, params, lora_path="first")
            assert served(await client.generate(PROMPT, params)) == outputs[None]  # the base is untouched
            await client.unload_lora_adapter("second")

        bound = tolerance(model_dir)
        for name, (tokens, logprobs) in outputs.items():
            expected = peft_logprobs(model_dir, adapters[name][0] if name else None, tokens)
            worst = max(abs(a - b) for a, b in zip(logprobs, expected, strict=True))
            assert worst <= bound, f"{name}: served logprobs off by {worst:.3g} > {bound:.3g}"
        assert outputs["first"][1] != outputs["second"][1] != outputs[None][1]  # each adapter is its own
        for one in batched:  # same seed: the same tokens; batched, another rounding of the same float32 sums
            assert_same_answer(served(one), outputs["first"], bound)

    asyncio.run(scenario())


def test_concurrent_requests_of_different_adapters_each_get_their_own(engine, model_dir: Path, adapters) -> None:
    """One adapter per running batch: requests of two adapters and the base, sent at once, each served right."""
    params = {"max_new_tokens": NEW_TOKENS, "sampling_seed": 5, "ignore_eos": True}

    async def scenario() -> list[tuple[list[int], list[float]]]:
        async with EngineClient(engine.url, admin_key=ADMIN) as client:
            for name, (path, _) in adapters.items():
                await client.load_lora_adapter(name, str(path))
            try:
                alone = [served(await client.generate(PROMPT, params, lora_path=n)) for n in ("first", "second", None)]
                together = await asyncio.gather(
                    *(client.generate(PROMPT, params, lora_path=n) for n in ("first", "second", None) * 3)
                )
            finally:
                for name in adapters:
                    await client.unload_lora_adapter(name)
        return alone, [served(one) for one in together]

    alone, together = asyncio.run(scenario())
    for answer, expected in zip(together, alone * 3, strict=True):
        assert_same_answer(answer, expected, tolerance(model_dir))


def assert_same_answer(answer: tuple[list[int], list[float]], expected: tuple[list[int], list[float]], bound: float):
    """The same tokens (each request's own seed), logprobs within float32 rounding (batches round sums otherwise)."""
    assert answer[0] == expected[0]
    assert max(abs(a - b) for a, b in zip(answer[1], expected[1], strict=True)) <= bound


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        ("/load_lora_adapter", {"lora_path": "/nowhere"}, "missing field 'lora_name'"),
        ("/load_lora_adapter", {"lora_name": "x"}, "missing field 'lora_path'"),
        ("/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}, "holds no peft adapter in safetensors"),
        ("/load_lora_adapter", {"lora_name": "", "lora_path": "/x"}, "an adapter name is 1 to 256"),
        ("/load_lora_adapter", {"lora_name": "x", "lora_path": "/x", "frob": 1}, "unknown field 'frob'"),
        ("/load_lora_adapter", {"lora_name": 5, "lora_path": "/x"}, "field 'lora_name' must be str"),
        ("/unload_lora_adapter", {"lora_name": "never"}, "no adapter named 'never' is loaded"),
        ("/generate", {"input_ids": [2], "lora_path": 7}, "lora_path: an adapter name"),
        ("/generate", {"input_ids": [[2], [3]], "lora_path": ["a"]}, "lora_path has 1 names for 2 prompts"),
    ],
)
def test_bad_adapter_requests_are_refused_by_name(engine, route: str, body: dict, message: str) -> None:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    response = httpx.post(f"{engine.url}{route}", json=body, headers=headers, timeout=60)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]


def test_adapter_routes_need_the_admin_key_and_refuse_a_name_twice(engine, adapters, tmp_path: Path) -> None:
    path, _ = adapters["first"]
    for route in ("/load_lora_adapter", "/unload_lora_adapter"):
        response = httpx.post(f"{engine.url}{route}", json={"lora_name": "x", "lora_path": str(path)})
        assert response.status_code == 401
    pickled = tmp_path / "pickled"  # an adapter_model.bin alone would be unpickled: never read
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((path / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"not read")

    async def scenario() -> None:
        async with EngineClient(engine.url, admin_key=ADMIN) as client:
            with pytest.raises(EngineError, match="holds no peft adapter in safetensors"):
                await client.load_lora_adapter("pickled", str(pickled))
            await client.load_lora_adapter("twice", str(path))
            try:
                with pytest.raises(EngineError, match="'twice' is already loaded"):
                    await client.load_lora_adapter("twice", str(path))
            finally:
                await client.unload_lora_adapter("twice")
            assert math.isfinite(served(await client.generate(PROMPT, {"max_new_tokens": 2}))[1][0])

    asyncio.run(scenario())


def test_a_published_adapter_reuses_the_slot_of_the_one_unloaded_before(model_dir: Path, adapters) -> None:
    """A run's pattern (load the new adapter, unload the one before): from the third load on, the adapter is copied
    into the spare slot in place, and the engine's model then serves exactly the loaded adapter (its digest, its
    logprobs against one loaded into a fresh peft model)."""
    from miles_core.builtin.local_engine.lora_adapters import SPARE_SLOTS, LoraAdapters

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    served_adapters = LoraAdapters(model)
    order = ["first", "second", "first", "second", "first"]
    previous = None
    for version, which in enumerate(order):
        directory, digest = adapters[which]
        name = f"v{version}"
        assert served_adapters.load(name, str(directory)) == digest  # the trainer's adapter, as served
        if previous is not None:
            served_adapters.unload(previous)
        previous = name
    assert sorted(served_adapters.slots.values()) == ["slot-0"]  # v4 reuses the first slot: two made in all
    assert served_adapters._slots_made == 2 and len(served_adapters._spare) <= SPARE_SLOTS
    served_adapters.activate(previous)
    ids = torch.tensor([[*PROMPT, 3, 5, 8]])
    with torch.no_grad():
        reused = torch.log_softmax(served_adapters._peft(input_ids=ids).logits.float(), dim=-1)
    fresh = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(model_dir), adapters["first"][0]
    ).eval()
    with torch.no_grad():
        expected = torch.log_softmax(fresh(input_ids=ids).logits.float(), dim=-1)
    torch.testing.assert_close(reused, expected, rtol=0, atol=1e-5)  # the same float32 ops on the same tensors
