"""The ``broadcast`` protocol's group backend: ``auto`` follows the trainer's device, ``nccl`` is refused where no
CUDA device exists (before any engine is contacted), and with two GPUs an NCCL group carries the weights."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest
import torch
import transformers

from miles_core.engines.client import EngineClient
from miles_core.engines.weights import unique_named_tensors
from miles_core.errors import ConfigError, MilesError
from miles_core.testkit.tiny_models import perturbed_state, save_tiny_llama
from miles_core.weight_transfer.broadcast import BroadcastProtocol
from miles_core.weight_transfer.digests import checksum
from miles_core.weight_transfer.protocol import EngineEndpoint
from miles_core.workers.local_provider import LocalWorkerProvider
from miles_core.workers.specs import CommandWorkerSpec
from tests.conftest import run_miles

CUDA = torch.cuda.is_available()
ADMIN = "broadcast-admin-key"


def test_auto_is_nccl_with_a_cuda_device_and_gloo_without() -> None:
    protocol = BroadcastProtocol()
    assert protocol.backend == ("nccl" if CUDA else "gloo")
    assert protocol.device.type == ("cuda" if CUDA else "cpu")
    assert BroadcastProtocol(backend="gloo").device.type == "cpu"


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(ConfigError, match="broadcast setting backend = 'mpi': expected 'auto', 'gloo' or 'nccl'"):
        BroadcastProtocol(backend="mpi")


@pytest.mark.skipif(CUDA, reason="this machine has CUDA, so NCCL is usable")
def test_nccl_without_a_cuda_device_is_refused_with_what_to_do() -> None:
    with pytest.raises(MilesError, match=r"needs a CUDA device .* use 'gloo'"):
        BroadcastProtocol(backend="nccl")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ('{"backend": "mpi"}', "broadcast setting backend = 'mpi': expected 'auto', 'gloo' or 'nccl'"),
        (
            '{"bucket": 3}',
            "do not fit the protocol 'broadcast'.*broadcast has no setting 'bucket'.*broadcast's settings: master",
        ),
    ],
)
def test_miles_train_refuses_bad_protocol_settings_before_any_worker_starts(tmp_path: Path, settings, message) -> None:
    result = run_miles(
        "train",
        "--num-steps",
        "1",
        "--output-dir",
        str(tmp_path / "run"),
        "--update-weight-transfer-mode",
        "broadcast",
        "--weight-transfer-settings",
        settings,
    )
    assert result.returncode == 2, result.stderr
    assert re.search(message, result.stderr), result.stderr
    assert "trainer, model" not in result.stdout  # stopped before the trainer was built
    assert not list((tmp_path / "run").glob("**/engine-*.log"))


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices: NCCL puts the trainer and the "
    f"engine on GPUs of their own (found {torch.cuda.device_count()})",
)
def test_nccl_group_carries_the_weights_to_an_engine_on_another_gpu(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.load_state_dict(perturbed_state(model, seed=7))
    argv = [
        sys.executable,
        "-m",
        "miles_core.builtin.local_engine.server",
        "--model-path",
        str(model_dir),
        "--host",
        "{host}",
        "--port",
        "{port}",
    ]
    spec = CommandWorkerSpec(
        name="engine-gpu1",
        argv=argv,
        ports=["port"],
        env={"CUDA_VISIBLE_DEVICES": "1"},
        health_url="http://{host}:{port}/health",
    )
    provider = LocalWorkerProvider(token=ADMIN, run_dir=tmp_path / "run")

    async def scenario() -> None:
        torch.cuda.set_device(0)
        info = await provider.start(spec)
        protocol = BroadcastProtocol(backend="nccl", timeout_s=60)
        try:
            await protocol.connect([EngineEndpoint(name=info.name, url=info.url, admin_key=ADMIN)])
            report = await protocol.transfer([list(model.state_dict().items())], version=4)
            async with EngineClient(info.url, admin_key=ADMIN) as client:
                served = await client.weights_checksum()
                version = await client.weight_version()
        finally:
            await protocol.close()
            await provider.shutdown()
        assert served == checksum(unique_named_tensors(model.state_dict().items()))
        assert report.num_bytes > 0 and version == "4"

    asyncio.run(scenario())
