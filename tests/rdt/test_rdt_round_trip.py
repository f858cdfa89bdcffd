"""Round trips with checksums from the torch trainer and the Megatron trainer (TP=2) into one and two
Ray-hosted engines, over NIXL; a dtype change between steps; an engine killed in the middle of a transfer."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import miles_plugins_rdt.protocol as protocol_module
import pytest
import ray
import torch
from miles_plugins_rdt.protocol import RdtProtocol, RdtTransferError
from miles_plugins_rdt.staging import split_into_lanes

from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.sections import TrainSection
from miles_core.engines.client import EngineClient
from miles_core.errors import MilesError
from miles_core.testkit.protocol_contract import ContractEngines
from miles_core.weight_transfer.digests import checksum
from miles_core.workers.local_provider import LocalWorkerProvider
from tests.rdt.conftest import shm_files

pytestmark = pytest.mark.slow

BUCKET = 24 << 10  # many iterator buckets, each moved as it comes
SETTINGS = {"transport": "nixl", "staging_bucket_mb": 2, "timeout_s": 60.0}


@pytest.fixture(scope="module")
def protocol(ray_engines: ContractEngines, loop):
    """One protocol for the module: receivers start once per engine, as in a run."""
    protocol = RdtProtocol(**SETTINGS)
    yield protocol
    loop.run_until_complete(protocol.close())
    assert not shm_files(), "staging buckets left in /dev/shm"


def served(engines: ContractEngines, loop, count: int) -> list[tuple[str, str]]:
    """(weight version, checksum) of the first ``count`` engines."""

    async def ask() -> list[tuple[str, str]]:
        results = []
        for endpoint in engines.endpoints()[:count]:
            async with EngineClient(endpoint.url, admin_key=endpoint.admin_key) as client:
                results.append((await client.weight_version(), await client.weights_checksum()))
        return results

    return loop.run_until_complete(ask())


def tensors_of(buckets) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor.detach().clone()) for bucket in buckets for name, tensor in bucket]


@pytest.mark.parametrize("count", [1, 2])
def test_torch_trainer_round_trip(ray_engines, protocol, loop, count: int) -> None:
    trainer = TorchTrainer.from_pretrained(ray_engines.model_dir, TrainSection(), seed=0)
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(0.01 * count)
    loop.run_until_complete(protocol.connect(ray_engines.endpoints()[:count]))
    report = loop.run_until_complete(protocol.transfer(iter(trainer.weight_iterator(BUCKET)), version=10 + count))
    expected = checksum(tensors_of(trainer.weight_iterator(BUCKET)))
    assert served(ray_engines, loop, count) == [(str(10 + count), expected)] * count
    assert report.num_engines == count and report.num_bytes > 3 * (32 << 10) and report.gb_per_s > 0


def test_every_receive_lane_reads_its_share(ray_engines, protocol, loop, monkeypatch) -> None:
    """Lanes take a share only of waves big enough to pay for it (MIN_LANE_SHARE): lowered here, as is the wave
    size, so that each of many waves of this tiny model is read by both lanes of each engine."""
    shares = []

    def recorded(slots, lanes, **kwargs):
        pieces = split_into_lanes(slots, lanes, granule=4096)
        shares.append([sum(piece.nbytes for piece in lane) for lane in pieces])
        return pieces

    monkeypatch.setattr(protocol_module, "MIN_LANE_SHARE", 1)
    monkeypatch.setattr(protocol_module, "WAVE_BYTES", 64 << 10)
    monkeypatch.setattr(protocol_module, "split_into_lanes", recorded)
    trainer = TorchTrainer.from_pretrained(ray_engines.model_dir, TrainSection(), seed=0)
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.mul_(1.5)
    loop.run_until_complete(protocol.connect(ray_engines.endpoints()[:2]))
    loop.run_until_complete(protocol.transfer(iter(trainer.weight_iterator(BUCKET)), version=30))
    expected = checksum(tensors_of(trainer.weight_iterator(BUCKET)))
    assert served(ray_engines, loop, 2) == [("30", expected)] * 2
    assert len(shares) > 1 and all(len(share) == 2 and min(share) > 0 for share in shares), shares


def test_megatron_tp2_round_trip(ray_engines, protocol, loop, tmp_path) -> None:
    from miles_plugins_megatron.config import MegatronSection  # deferred: megatron-core imports slowly
    from miles_plugins_megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer.launch(
        ray_engines.model_dir,
        train=TrainSection(backend="megatron"),
        seed=0,
        layout=MegatronSection(tensor_parallel=2),
        provider_factory=lambda: LocalWorkerProvider(token="megatron", run_dir=tmp_path),
    )
    try:
        assert len(trainer.ranks.names) == 2
        weights = tensors_of(trainer.weight_iterator(BUCKET))
    finally:
        trainer.close()
    perturbed = [(name, tensor + 0.02) for name, tensor in weights]  # differ from what the engines serve
    for count in (1, 2):
        loop.run_until_complete(protocol.connect(ray_engines.endpoints()[:count]))
        buckets = [perturbed[i : i + 3] for i in range(0, len(perturbed), 3)]
        loop.run_until_complete(protocol.transfer(iter(buckets), version=20 + count))
        assert served(ray_engines, loop, count) == [(str(20 + count), checksum(perturbed))] * count


def test_a_dtype_change_between_steps(ray_engines, protocol, loop) -> None:
    trainer = TorchTrainer.from_pretrained(ray_engines.model_dir, TrainSection(), seed=0)
    weights = tensors_of(trainer.weight_iterator(BUCKET))
    loop.run_until_complete(protocol.connect(ray_engines.endpoints()))
    for version, dtype in ((31, torch.float32), (32, torch.bfloat16), (33, torch.float16)):
        sent = [(name, (tensor + 0.001 * version).to(dtype)) for name, tensor in weights]
        loop.run_until_complete(protocol.transfer(iter([sent[:5], sent[5:]]), version=version))
        # the engines keep their float32 weights: what they serve is the sent values, converted
        expected = checksum((name, tensor.float()) for name, tensor in sent)
        assert served(ray_engines, loop, 2) == [(str(version), expected)] * 2


def test_an_engine_killed_mid_transfer(ray_engines, protocol, loop, monkeypatch) -> None:
    """Staging never touches the engines; the switch to the new bucket is one request per engine. So a killed
    engine fails the transfer by name, a survivor serves one whole version (never a mix), and after the restart the
    next transfer reaches every engine exactly."""
    monkeypatch.setattr(protocol_module, "WAVE_BYTES", 1)  # each bucket is a wave: the first is in flight
    trainer = TorchTrainer.from_pretrained(ray_engines.model_dir, TrainSection(), seed=0)
    weights = tensors_of(trainer.weight_iterator(BUCKET))
    loop.run_until_complete(protocol.connect(ray_engines.endpoints()))
    before = served(ray_engines, loop, 1)[0]
    victim = ray_engines.infos[-1]
    sent = [(name, tensor + 0.25) for name, tensor in weights]

    def buckets_with_a_kill():
        yield sent[:4]
        os.kill(victim.pid, signal.SIGKILL)  # the first tensors are staged for both engines; now one dies
        yield sent[4:]

    with pytest.raises(RdtTransferError, match=rf"the new version was not published: engine {victim.name}: "):
        loop.run_until_complete(protocol.transfer(buckets_with_a_kill(), version=42))
    survivor = served(ray_engines, loop, 1)[0]
    assert survivor in (before, ("42", checksum(sent))), survivor  # a whole version, old or new
    assert not shm_files() - {p for p in shm_files() if "send" in p.name}, "staging buckets of dropped receivers"
    loop.run_until_complete(ray_engines.restart_dead())
    loop.run_until_complete(protocol.connect(ray_engines.endpoints()))
    retried = [(name, tensor + 0.5) for name, tensor in weights]
    loop.run_until_complete(protocol.transfer(iter([retried[:6], retried[6:]]), version=43))
    assert served(ray_engines, loop, 2) == [("43", checksum(retried))] * 2


@pytest.mark.parametrize("lane", [0, 1], ids=["owner-of-the-files", "second-lane"])
def test_a_receive_lane_killed_mid_transfer(ray_engines, protocol, loop, monkeypatch, lane: int) -> None:
    """A read that fails means no engine is asked to switch (the trainer asks only once every read is in), so no
    engine serves anything new; the engine's receivers are dropped with their staging files (whichever lane died:
    the owner of the files cannot remove them, the other lanes fail before the owner has closed), a transfer before
    connect() again is refused, and after it the next transfer reaches every engine exactly."""
    monkeypatch.setattr(protocol_module, "WAVE_BYTES", 1)
    monkeypatch.setattr(protocol_module, "MIN_LANE_SHARE", 1)  # both lanes read from every wave
    trainer = TorchTrainer.from_pretrained(ray_engines.model_dir, TrainSection(), seed=0)
    weights = tensors_of(trainer.weight_iterator(BUCKET))
    loop.run_until_complete(protocol.connect(ray_engines.endpoints()))
    before = served(ray_engines, loop, 2)
    victim = ray_engines.endpoints()[0].name
    victims_files = [Path(path) for path in protocol.staging_paths[victim]]
    sent = [(name, tensor - 0.125) for name, tensor in weights]

    def buckets_with_a_kill():
        yield sent[:4]
        ray.kill(protocol.receivers[victim][1][lane], no_restart=True)  # one of the engine's lanes dies mid-transfer
        yield sent[4:]

    with pytest.raises(RdtTransferError, match=rf"the new version was not published: engine {victim}: "):
        loop.run_until_complete(protocol.transfer(buckets_with_a_kill(), version=44))
    assert served(ray_engines, loop, 2) == before  # neither engine switched, not even the one whose reads succeeded
    assert not [path for path in victims_files if path.exists()], "the dropped receivers left their staging files"
    with pytest.raises(MilesError, match=rf"engines {victim} lost their receivers"):
        loop.run_until_complete(protocol.transfer(iter([sent]), version=44))
    loop.run_until_complete(protocol.connect(ray_engines.endpoints()))
    loop.run_until_complete(protocol.transfer(iter([sent[:6], sent[6:]]), version=45))
    assert served(ray_engines, loop, 2) == [("45", checksum(sent))] * 2


def test_receivers_freeze_what_they_hold_after_start(ray_engines, protocol, loop) -> None:
    """A full garbage collection over a receiver's start-up objects stalled a switch by 175 ms: they are frozen."""
    loop.run_until_complete(protocol.connect(ray_engines.endpoints()))
    lanes = [lane for _, engine_lanes in protocol.receivers.values() for lane in engine_lanes]
    frozen = ray.get([lane.__ray_call__.remote(lambda receiver: __import__("gc").get_freeze_count()) for lane in lanes])
    assert len(frozen) == 2 * protocol.lanes and min(frozen) > 10_000, frozen


def test_a_trainer_updating_its_weights_in_place_is_sent_without_new_objects(
    ray_engines, protocol, loop, monkeypatch
) -> None:
    """Once the trainer's registered memory settles, each transfer hands the lanes the last transfer's RDT objects
    (they describe memory, not a copy of it) and the engines get the values that memory holds now; a trainer that
    sends from other memory gets new objects (so do the next transfers, until its registrations settle), and Ray
    frees every object that no longer stands."""
    monkeypatch.setattr(protocol_module, "MIN_LANE_SHARE", 1)  # both lanes read
    puts = []
    put = ray.put
    monkeypatch.setattr(ray, "put", lambda *args, **kwargs: puts.append(1) or put(*args, **kwargs))
    store = ray.worker.global_worker.rdt_manager.rdt_store
    trainer = TorchTrainer.from_pretrained(ray_engines.model_dir, TrainSection(), seed=0)
    loop.run_until_complete(protocol.connect(ray_engines.endpoints()))
    for version in range(50, 56):
        with torch.no_grad():
            for parameter in trainer.model.parameters():
                parameter.add_(0.001)  # in place: the same memory, new values
        puts.clear()
        loop.run_until_complete(protocol.transfer(iter(trainer.weight_iterator(BUCKET)), version=version))
        expected = checksum(tensors_of(trainer.weight_iterator(BUCKET)))
        assert served(ray_engines, loop, 2) == [(str(version), expected)] * 2
    assert not puts, "transfers from memory that did not move put new objects"
    assert store.get_num_objects() == len(protocol._standing) == 2  # one per lane, nothing else kept
    fresh = [(name, tensor * 0.5) for name, tensor in tensors_of(trainer.weight_iterator(BUCKET))]  # other memory
    for version in (56, 57):
        puts.clear()
        loop.run_until_complete(protocol.transfer(iter([fresh]), version=version))
        assert served(ray_engines, loop, 2) == [(str(version), checksum(fresh))] * 2
        assert len(puts) == 2, "the registered memory changed: objects put before do not stand"
        assert store.get_num_objects() == len(protocol._standing), "Ray keeps objects that no transfer uses"


@pytest.mark.parametrize("path", ["driver", "holders"])
def test_a_receive_lane_that_never_answers_fails_the_transfer_by_name_within_the_timeout(
    ray_engines, loop, path: str
) -> None:
    """A read that never ends (its receive lane frozen with SIGSTOP: as a lane whose sender is out of reach) fails
    the transfer once the timeout_s setting has passed, naming the engine, its node and what it was waiting for,
    from the driver's iterator and from the holders alike; no engine switched."""
    protocol = RdtProtocol(**SETTINGS)
    trainer = TorchTrainer.from_pretrained(ray_engines.model_dir, TrainSection(), seed=0)
    loop.run_until_complete(protocol.connect(ray_engines.endpoints()))
    # the receivers started within the module's timeout (a busy 2-core machine takes seconds); the transfer gets 2 s
    protocol.settings = protocol.settings.model_copy(update={"timeout_s": 2.0})
    before = served(ray_engines, loop, 2)
    victim = ray_engines.endpoints()[0]
    lane = protocol.receivers[victim.name][1][0]
    pid = ray.get(lane.__ray_call__.remote(lambda receiver: os.getpid()))
    os.kill(pid, signal.SIGSTOP)
    waited = {"driver": "the read into its staging bucket did not finish", "holders": "did not answer"}[path]
    try:
        with pytest.raises(RdtTransferError, match=rf"engine {victim.name}: .*{waited} within .* \(node 127.0.0.1\)"):
            if path == "driver":
                loop.run_until_complete(protocol.transfer(iter(trainer.weight_iterator(BUCKET)), version=60))
            else:
                loop.run_until_complete(protocol.transfer_from_holders(trainer.weight_holders(), version=60))
        assert served(ray_engines, loop, 2) == before
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        loop.run_until_complete(protocol.close())
