"""The local engine serving a model whose KV cache cannot be left-padded and merged between rows (DeepSeek-V4's
sliding windows and compressors): :class:`RecomputingBatch` recomputes each row's sequence; its tokens are the
model's own, rows join and leave as in continuous batching, and weights arrive under DeepSeek-V4's checkpoint names
(which transformers holds under other names in memory)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_core.builtin.local_engine import batch_generation
from miles_core.builtin.local_engine.batch_generation import FixedRow, generate_batch, new_running_batch
from miles_core.builtin.local_engine.engine import LocalEngine, load_model
from miles_core.builtin.local_engine.recomputing_batch import RecomputingBatch
from miles_core.builtin.local_engine.running_batch import RunningBatch, result_of
from miles_core.builtin.local_engine.sampling import GenerationRequest, GenerationResult, Sampler, SamplingParams
from miles_core.engines.weights import WeightLoadError, load_named_tensors
from miles_core.testkit.tiny_models import save_tiny_deepseek_v4, save_tiny_llama, save_tiny_qwen3_moe
from miles_core.weight_transfer.digests import checksum

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def dsv4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_deepseek_v4(tmp_path_factory.mktemp("dsv4") / "model", scale=0.1)


@pytest.fixture(scope="module")
def dsv4(dsv4_dir: Path) -> torch.nn.Module:
    return load_model(dsv4_dir)


def greedy_alone(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """The model's greedy tokens and their logprobs, each from a forward over the whole sequence so far."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            last = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            ids.append(int(last.argmax()))
            logprobs.append(float(last.max()))
    return ids[len(prompt) :], logprobs


def test_the_batch_kind_follows_the_models_cache(dsv4, tmp_path: Path) -> None:
    assert type(new_running_batch(dsv4)) is RecomputingBatch
    assert type(new_running_batch(load_model(save_tiny_llama(tmp_path / "llama")))) is RunningBatch


def test_recomputed_rows_get_the_models_tokens_joining_and_leaving(dsv4) -> None:
    """Two prompts of other lengths (the longer past the window and several compressed windows), the second joining
    after two steps and the first leaving early: each gets exactly the tokens and logprobs it gets alone."""
    first, second = list(range(3, 14)), [5, 9, 12]
    batch = RecomputingBatch(dsv4)
    rows = [FixedRow(GenerationRequest(p, GREEDY), Sampler(GenerationRequest(p, GREEDY), set(), 0)) for p in (first,)]
    batch.prefill(rows)
    batch.step()
    batch.step()
    joining = FixedRow(GenerationRequest(second, GREEDY), Sampler(GenerationRequest(second, GREEDY), set(), 0))
    batch.prefill([joining])
    assert len(batch) == 2
    batch.step()
    assert batch.remove([rows[0]]) == [rows[0]] and len(batch) == 1
    while not batch.finished():
        batch.step()
    assert result_of(rows[0].sampler).output_ids == greedy_alone(dsv4, first, 4)[0]
    tokens, logprobs = greedy_alone(dsv4, second, GREEDY.max_new_tokens)
    served = result_of(joining.sampler)
    assert served.output_ids == tokens and served.logprobs == pytest.approx(logprobs, abs=1e-6)
    (again,) = generate_batch(dsv4, [GenerationRequest(second, GREEDY)])
    assert again.output_ids == tokens


def test_the_engine_loads_and_serves_weights_under_the_checkpoints_names(dsv4_dir: Path, tmp_path: Path) -> None:
    """A DeepSeek-V4 checkpoint's tensors (``model.layers.0.attn.wq_a.weight``, ``...ffn.experts.1.w3.weight``,
    ``head.weight``: held as ``self_attn.q_a_proj``, the fused ``mlp.experts.gate_up_proj``, ``lm_head`` in
    memory) load into the engine and are served back under the same names; a name of neither layout is refused with
    nothing loaded."""
    staging = tmp_path / "staging"
    staging.mkdir(mode=0o700)
    engine = LocalEngine(dsv4_dir, staging_dir=staging, max_batch_size=4)
    on_disk = load_file(str(dsv4_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(5)
    changed = {
        name: tensor + torch.randn(tensor.shape, generator=generator) if tensor.is_floating_point() else tensor.flip(0)
        for name, tensor in on_disk.items()
    }
    (tmp_path / "update").mkdir()
    save_file(changed, str(tmp_path / "update" / "model.safetensors"))
    before = engine.weights_checksum()
    engine.update_from_disk(str(tmp_path / "update"), "v1")
    assert engine.weights_checksum() == checksum(changed.items()) != before

    async def served() -> list:
        engine.start()
        return await engine.generate([GenerationRequest([3, 4, 5, 6, 7], GREEDY)])

    (result,) = asyncio.run(served())
    assert result.output_ids == greedy_alone(engine.model, [3, 4, 5, 6, 7], GREEDY.max_new_tokens)[0]
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.attn\.nonsense\.weight: not a weight of this model"):
        load_named_tensors(engine.model, {**changed, "model.layers.0.attn.nonsense.weight": torch.zeros(1)})
    assert engine.weights_checksum() == checksum(changed.items())


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return load_model(save_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe") / "model", scale=0.1))


@pytest.mark.parametrize("model_name", ["dsv4", "qwen3_moe"])
def test_rows_of_one_length_share_a_forward_and_get_what_they_get_alone(
    model_name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four prompts of one length and one of another: every step runs one forward per sequence length (two, not
    five), and each row's tokens and logprobs are those it gets alone. Served recomputing, a Qwen3-MoE (whose routers
    Miles captures; DeepSeek-V4's hash routers it does not) reports each row's routed experts as it does alone.

    Batched rows go through matrix products of another shape, so a logprob may differ in its last bits (float32:
    about 1e-7 relative, a few roundings per layer of these two-layer models): 1e-5 leaves two orders of margin,
    and a batching error (a row reading another's positions) moves logprobs by far more than that."""
    model = request.getfixturevalue(model_name)
    monkeypatch.setattr(batch_generation, "new_running_batch", RecomputingBatch)
    with_routing = model_name == "qwen3_moe"
    same_length = [[3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5, 4, 3], [5, 5, 5, 5, 5, 5, 5], [12, 3, 7, 7, 1, 2, 4]]
    prompts = [*same_length, [4, 6, 8]]

    def served(prompts: list[list[int]]) -> tuple[list[GenerationResult], int]:
        forwards = []
        hook = model.register_forward_hook(lambda *_: forwards.append(1))
        try:
            requests = [GenerationRequest(p, GREEDY, return_routed_experts=with_routing) for p in prompts]
            return batch_generation.generate_batch(model, requests), len(forwards)
        finally:
            hook.remove()

    together, forwards = served(prompts)
    assert forwards == 2 * GREEDY.max_new_tokens
    for prompt, result in zip(prompts, together, strict=True):
        ((alone,), _) = served([prompt])
        assert result.output_ids == alone.output_ids
        assert result.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        if with_routing:
            assert result.routed_experts.shape[0] == len(prompt) + GREEDY.max_new_tokens - 1
            assert torch.equal(result.routed_experts, alone.routed_experts)
        else:
            assert result.routed_experts is None
