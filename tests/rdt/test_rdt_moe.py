"""The rdt protocol carries a tiny Qwen3-MoE from the torch trainer (experts fused in memory, sent one tensor per
expert under their checkpoint names) into a Ray-hosted local engine, over NIXL and over gloo: the engine serves
weights of the trainer's checksum."""

from __future__ import annotations

import asyncio

import pytest
import torch
from miles_plugins_rdt.protocol import RdtProtocol

from miles_core.builtin.ray_provider import RayWorkerProvider
from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.sections import TrainSection
from miles_core.testkit.protocol_contract import CONTRACT_TOKEN, ContractEngines
from miles_core.testkit.tiny_models import save_tiny_qwen3_moe
from miles_core.weight_transfer.digests import checksum
from tests.rdt.conftest import shm_files
from tests.rdt.test_rdt_round_trip import served, tensors_of

pytestmark = pytest.mark.slow

BUCKET = 24 << 10  # many iterator buckets: one layer's experts span several


@pytest.fixture(scope="module")
def moe_engine(ray_cluster, tmp_path_factory: pytest.TempPathFactory):
    """One local engine on a tiny Qwen3-MoE, started by the Ray provider (as rdt needs)."""
    root = tmp_path_factory.mktemp("rdt-moe")
    engines = ContractEngines(
        root,
        count=1,
        provider=RayWorkerProvider(token=CONTRACT_TOKEN, run_dir=root / "run"),
        save_model=lambda path: save_tiny_qwen3_moe(path, seed=5),
    )
    asyncio.run(engines.start())
    yield engines
    asyncio.run(engines.provider.shutdown())


@pytest.mark.parametrize("transport", ["nixl", "gloo"])
def test_rdt_carries_moe_weights(moe_engine: ContractEngines, loop, transport: str) -> None:
    trainer = TorchTrainer.from_pretrained(moe_engine.model_dir, TrainSection(), seed=0)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(2)
        for parameter in trainer.model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    protocol = RdtProtocol(transport=transport, staging_bucket_mb=2, timeout_s=60.0)
    try:
        loop.run_until_complete(protocol.connect(moe_engine.endpoints()))
        loop.run_until_complete(protocol.transfer(iter(trainer.weight_iterator(BUCKET)), version=7))
        sent = tensors_of(trainer.weight_iterator(BUCKET))
        assert "model.layers.1.mlp.experts.2.gate_proj.weight" in dict(sent)
        assert served(moe_engine, loop, 1) == [("7", checksum(sent))]
    finally:
        loop.run_until_complete(protocol.close())
    assert not shm_files(), "staging buckets left in /dev/shm"
