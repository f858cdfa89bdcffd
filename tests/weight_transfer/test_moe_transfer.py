"""Every weight-transfer protocol carries a MoE model's weights: from the torch trainer on a tiny Qwen3-MoE (experts
fused in memory, sent one tensor per expert under their checkpoint names) through the controller, with its checksum
verification on, into a local engine, whose logprobs then equal the trainer's.

Tolerance of the logprob comparison, 1e-4: both sides compute in float32 (unit roundoff 6e-8), the engine
incrementally with its KV cache and its own attention kernel, the trainer over the whole sequence in eager
attention; over two layers such reorderings move a logprob by some 1e-6 (as in tests/engines/test_local_engine.py),
while weights that did not arrive (the engine still on its initial model) move them by 1e-2 or more, which the test
checks first."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.build import build_config
from miles_core.config.sections import TrainSection
from miles_core.engines.client import EngineClient
from miles_core.plugin_manager import MilesPluginManager
from miles_core.testkit.tiny_models import save_tiny_qwen3_moe
from miles_core.weight_transfer.digests import checksum
from tests.test_controller_weights import controller_for

pytestmark = pytest.mark.slow

BUCKET_BYTES = 16 << 10  # many buckets: experts of one layer are split across them
TOLERANCE = 1e-4
PROMPTS = [[2, 5, 9, 11], [2, 40, 3]]
PROTOCOLS = {  # test id: (weight_transfer.mode, weight_transfer.settings)
    "disk": ("disk", {}),
    "tensor-shared-memory": ("tensor", {}),
    "tensor-http": ("tensor", {"shared_memory": False}),
    "broadcast-gloo": ("broadcast", {"backend": "gloo", "timeout_s": 30.0}),
    "sharded-disk": ("sharded-disk", {}),  # the third-party example (plugins/miles_example_transfer)
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe") / "model", seed=7)


def trainer_logprobs(trainer: TorchTrainer, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The trainer's log-softmax ``[len(output), vocab]`` at the positions that predict ``output``."""
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(torch.tensor([prompt + output]))[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(output)]


async def largest_logprob_gap(url: str, trainer: TorchTrainer) -> float:
    """The largest difference between the engine's top-20 logprobs of a greedy continuation and the trainer's."""
    gap = 0.0
    async with EngineClient(url) as client:
        for prompt in PROMPTS:
            body: dict[str, Any] = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
                "return_logprob": True,
                "top_logprobs_num": 20,
            }
            answer = await client._request("POST", "/generate", body)
            expected = trainer_logprobs(trainer, prompt, answer["output_ids"])
            for position, top in enumerate(answer["meta_info"]["output_top_logprobs"]):
                gap = max(gap, *(abs(logprob - expected[position, token].item()) for logprob, token, _ in top))
    return gap


@pytest.mark.parametrize("name", list(PROTOCOLS))
def test_a_protocol_carries_moe_weights_checked_by_checksum(tmp_path: Path, moe_dir: Path, name: str) -> None:
    manager = MilesPluginManager.load()
    mode, settings = PROTOCOLS[name]
    overrides = {
        "weight_transfer.mode": mode,
        "weight_transfer.settings": settings,
        "weight_transfer.verify_checksum": True,
        "engine.num_engines": 1,
    }
    controller = controller_for(manager, build_config(manager, overrides=overrides), moe_dir, tmp_path)
    trainer = TorchTrainer.from_pretrained(moe_dir, TrainSection(), seed=0)
    with torch.no_grad():  # every weight moved, each expert its own way: a misplaced expert cannot hide
        generator = torch.Generator().manual_seed(1)
        for parameter in trainer.model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    sent = checksum(trainer.weight_iterator(1 << 30).named_tensors())

    async def scenario() -> None:
        try:
            await controller.start(version=1)
            (url,) = [client.url for client in controller.engine_clients()]
            assert await largest_logprob_gap(url, trainer) > 100 * TOLERANCE  # the engine is not yet the trainer
            report = await controller.update_weights(lambda: trainer.weight_iterator(BUCKET_BYTES), version=2)
            assert report.checksum_ok is True and report.num_engines == 1
            assert [name for name, _ in controller.published if ".mlp.experts.3.up_proj" in name] == [
                f"model.layers.{layer}.mlp.experts.3.up_proj.weight" for layer in (0, 1)
            ]
            assert await controller.engine_clients()[0].weights_checksum() == sent
            assert await largest_logprob_gap(url, trainer) < TOLERANCE
        finally:
            await controller.stop()

    asyncio.run(scenario())
