"""The controller's weight updates read the trainer's weights once: the checksum it verifies and the copy a restarted
engine gets come from what the protocol sent, kept on CPU. A real local engine, the real ``tensor`` protocol, and
the torch trainer's own weight iterator, counted."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

from miles_core.config.build import build_config
from miles_core.engines.backend import load_engine_backend
from miles_core.errors import MilesError
from miles_core.loop import make_protocol
from miles_core.plugin_manager import MilesPluginManager
from miles_core.rollout.controller import InferenceController, RecordedWeights
from miles_core.testkit.tiny_models import perturbed_state, save_tiny_llama
from miles_core.training.weight_iterator import bucketize
from miles_core.weight_transfer.digests import checksum
from miles_core.weight_transfer.holders import InProcessHolders
from miles_core.workers.local_provider import LocalWorkerProvider

BUCKET_BYTES = 64 << 10


class CountedSource:
    """A weight source (``lambda: trainer.weight_iterator(...)``) that counts how often it is read."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state
        self.passes = 0

    def __call__(self) -> Iterator[list]:
        self.passes += 1
        return bucketize(self.state.items(), BUCKET_BYTES)


def controller_for(manager: MilesPluginManager, config, model: Path, tmp_path: Path) -> InferenceController:
    """A controller of the run's engines (local engines on ``model``) and the configured protocol."""
    provider = LocalWorkerProvider(token="controller-token", run_dir=tmp_path / "run")
    protocol = make_protocol(config, manager.registries)
    backend = load_engine_backend(manager.registries, config.engine.backend)
    return InferenceController(
        config=config, hooks=manager.hook, provider=provider, protocol=protocol, backend=backend, model_path=str(model)
    )


def test_an_update_reads_the_weights_once_verifies_them_and_keeps_a_cpu_copy(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model")
    manager = MilesPluginManager.load()
    settings = {"weight_transfer.mode": "tensor", "weight_transfer.verify_checksum": True, "engine.num_engines": 2}
    controller = controller_for(manager, build_config(manager, overrides=settings), model, tmp_path)
    new_state = perturbed_state(transformers.AutoModelForCausalLM.from_pretrained(model), seed=5)
    source = CountedSource(new_state)

    async def scenario() -> None:
        try:
            await controller.start(version=3)
            assert controller.version == 3 and {e.weight_version for e in controller.describe_engines()} == {3}
            report = await controller.update_weights(source, version=4)
            assert source.passes == 1  # sent, checksummed and copied in one pass
            assert report.checksum_ok and controller.version == 4
            served = await asyncio.gather(*(c.weights_checksum() for c in controller.engine_clients()))
            assert set(served) == {checksum(new_state.items())}
            assert [name for name, _ in controller.published] == list(new_state)
            assert all(t.device.type == "cpu" for _, t in controller.published)
            assert all(torch.equal(t, new_state[name]) for name, t in controller.published)
            assert all(t.data_ptr() != new_state[name].data_ptr() for name, t in controller.published)  # a copy
        finally:
            await controller.stop()

    asyncio.run(scenario())


def test_a_recording_that_the_protocol_did_not_finish_is_incomplete() -> None:
    state = {"a": torch.ones(4), "b": torch.zeros(4)}
    recorded = RecordedWeights(bucketize(state.items(), 16))
    taken = iter(recorded)
    next(taken)
    assert not recorded.complete and [name for name, _ in recorded.copy] == ["a"]
    assert list(taken) == [[("b", state["b"])]]
    assert recorded.complete and [name for name, _ in recorded.copy] == ["a", "b"]


def test_a_protocol_that_stops_taking_buckets_fails_the_update(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model")
    manager = MilesPluginManager.load()
    controller = controller_for(
        manager, build_config(manager, overrides={"weight_transfer.mode": "tensor"}), model, tmp_path
    )
    protocol = controller.protocol
    real_transfer = protocol.transfer

    async def first_bucket_only(buckets, *, version):
        return await real_transfer(iter([next(iter(buckets))]), version=version)

    protocol.transfer = first_bucket_only
    source = CountedSource(perturbed_state(transformers.AutoModelForCausalLM.from_pretrained(model), seed=6))

    async def scenario() -> None:
        try:
            await controller.start()
            expected = rf"the {type(protocol).__name__} protocol reported v1 sent before taking every weight bucket"
            with pytest.raises(MilesError, match=expected):
                await controller.update_weights(source, version=1)
            assert controller.version == 0 and controller.published == []
        finally:
            await controller.stop()

    asyncio.run(scenario())


def test_a_restarted_engines_republish_and_an_update_take_turns(tmp_path: Path) -> None:
    """An update that starts while a restarted engine is being given the published version waits for it: their
    protocol calls (holder tasks on the same ranks, requests to the same engines) would otherwise interleave."""
    model = save_tiny_llama(tmp_path / "model")
    manager = MilesPluginManager.load()
    controller = controller_for(
        manager, build_config(manager, overrides={"weight_transfer.mode": "tensor"}), model, tmp_path
    )
    protocol, events = controller.protocol, []
    weights = perturbed_state(transformers.AutoModelForCausalLM.from_pretrained(model), seed=7)
    holders = InProcessHolders(lambda: iter(weights.items()))
    real_republish, real_transfer = protocol.republish, protocol.transfer_from_holders

    async def slow_republish(version):
        events.append(f"republish v{version}")
        await asyncio.sleep(0.5)  # the update below starts meanwhile
        await real_republish(version)
        events.append("republished")

    async def recorded_transfer(holders, *, version, checksum=False):
        events.append(f"transfer v{version}")
        report = await real_transfer(holders, version=version, checksum=checksum)
        events.append("transferred")
        return report

    protocol.republish, protocol.transfer_from_holders = slow_republish, recorded_transfer

    async def scenario() -> None:
        try:
            await controller.start()
            await controller.update_weights(CountedSource(weights), version=1, holders=holders)
            events.clear()
            cell = next(iter(controller.cells.cells.values()))
            bringing_back = asyncio.ensure_future(controller._bring_back(cell))
            await asyncio.sleep(0.1)
            await controller.update_weights(CountedSource(weights), version=2, holders=holders)
            await bringing_back
            assert events == ["republish v1", "republished", "transfer v2", "transferred"]
            assert {e.weight_version for e in controller.describe_engines()} == {2}
        finally:
            await controller.stop()

    asyncio.run(scenario())
