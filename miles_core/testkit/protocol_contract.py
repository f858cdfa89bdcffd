"""The weight-transfer protocol contract, shipped as an opt-in pytest plugin.

Installing miles-core registers no pytest plugin (this module imports torch and transformers, which no unrelated
pytest run should pay for). A test suite enables it in its top-level ``conftest.py``::

    pytest_plugins = ["miles_core.testkit.protocol_contract"]

(or on the command line, ``pytest -p miles_core.testkit.protocol_contract``), which provides the ``contract_engines``
fixture. Any protocol, built-in or third-party, is then checked by subclassing :class:`ProtocolContract` in a test
module::

    from miles_core.testkit.protocol_contract import ProtocolContract

    class TestMyProtocol(ProtocolContract):
        protocol_name = "my-protocol"          # its name in the registry
        protocol_settings = {"option": 1}      # its settings (keyword arguments of its constructor)
        bad_settings = [{"option": -1}]        # settings its model must refuse (an unknown one is added)

The suite starts real local engines (a tiny model made on the spot) and checks round trips with checksums,
versioning, reports, and failures (a bad tensor, a dead engine), after which a good transfer must restore every
engine to exactly the trainer's weights; and, without engines, that the protocol declares its settings model
(:class:`~miles_core.weight_transfer.settings.ProtocolSettings`, every field described) and that bad settings are
refused with the :class:`~miles_core.errors.ConfigError` that names the protocol, as a run reports them.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import transformers

from miles_core.engines.client import EngineClient
from miles_core.errors import ConfigError
from miles_core.plugin_manager import MilesPluginManager
from miles_core.testkit.tiny_models import perturbed_state, save_tiny_llama
from miles_core.training.weight_iterator import ModuleHfWeightIterator
from miles_core.weight_transfer.digests import checksum
from miles_core.weight_transfer.holders import round_robin_share, run_holder_task
from miles_core.weight_transfer.protocol import EngineEndpoint, SendsFromHolders, WeightTransferProtocol
from miles_core.weight_transfer.settings import ProtocolSettings
from miles_core.workers.local_provider import LocalWorkerProvider
from miles_core.workers.provider import BaseWorkerProvider
from miles_core.workers.specs import CommandWorkerSpec

CONTRACT_TOKEN = "contract-admin-key"
SMALL_BUCKET_BYTES = 16 << 10  # several buckets even for the tiny model


class ContractEngines:
    """Engines serving one tiny checkpoint, shared by every protocol under test in a session: local processes, or
    the workers of ``provider`` (a protocol that needs engines hosted in Ray actors passes a Ray provider). The
    checkpoint is a tiny Llama, or what ``save_model(directory)`` writes (a tiny Qwen3-MoE, for example)."""

    def __init__(
        self,
        root: Path,
        count: int,
        provider: BaseWorkerProvider | None = None,
        *,
        save_model: Callable[[Path], Path] | None = None,
    ) -> None:
        self.model_dir = (save_model or (lambda path: save_tiny_llama(path, seed=11)))(root / "model")
        self.provider = provider or LocalWorkerProvider(token=CONTRACT_TOKEN, run_dir=root / "run")
        self.count = count
        self.infos: list[Any] = []

    def spec(self, name: str) -> CommandWorkerSpec:
        argv = [
            sys.executable,
            "-m",
            "miles_core.builtin.local_engine.server",
            "--model-path",
            str(self.model_dir),
            "--host",
            "{host}",
            "--port",
            "{port}",
        ]
        return CommandWorkerSpec(
            name=name, argv=argv, ports=["port"], health_url="http://{host}:{port}/health", num_cpus=0
        )

    async def start(self) -> None:
        self.infos = list(
            await asyncio.gather(*(self.provider.start(self.spec(f"contract-{i}")) for i in range(self.count)))
        )

    async def restart_dead(self) -> None:
        for index, info in enumerate(self.infos):
            if not await self.provider.is_alive(info.name):
                self.infos[index] = await self.provider.restart(info.name)

    def endpoints(self) -> list[EngineEndpoint]:
        return [EngineEndpoint(name=i.name, url=i.url, admin_key=CONTRACT_TOKEN) for i in self.infos]


@pytest.fixture(scope="session")
def contract_engines(tmp_path_factory: pytest.TempPathFactory):
    engines = ContractEngines(tmp_path_factory.mktemp("protocol-contract"), count=2)
    asyncio.run(engines.start())
    yield engines
    asyncio.run(engines.provider.shutdown())


class SplitHolders:
    """Three holders in this process, each with every third tensor of ``model`` (as three ranks would hold them),
    every task run on its own share; it counts the tensors handed out."""

    def __init__(self, model: torch.nn.Module, holders: int = 3) -> None:
        self.model, self.holders, self.handed_out = model, holders, 0

    def describe(self) -> list[str]:
        return [f"holder {index}" for index in range(self.holders)]

    def _share(self, holder: int):
        tensors = ModuleHfWeightIterator(self.model, bucket_bytes=1).named_tensors()
        for item in round_robin_share(tensors, holder=holder, holders=self.holders):
            self.handed_out += 1
            yield item

    def run_task(self, task: str, **kwargs: Any) -> list[dict[str, Any]]:
        return [
            run_holder_task(task, self._share(holder), holder=holder, holders=self.holders, **kwargs)
            for holder in range(self.holders)
        ]


class ProtocolContract:
    """Subclass with ``protocol_name`` (and ``protocol_settings``) to run the contract against a protocol."""

    protocol_name: ClassVar[str]
    protocol_settings: ClassVar[dict[str, Any]] = {}
    bad_settings: ClassVar[list[dict[str, Any]]] = []  # beyond an unknown setting, which every protocol refuses

    def make_protocol(self) -> WeightTransferProtocol:
        registries = MilesPluginManager.load().registries
        protocol_cls = registries.weight_transfer_protocols.get_or_raise(self.protocol_name).load()
        return protocol_cls(**self.protocol_settings)

    def test_settings_model_is_declared_and_described(self) -> None:
        registries = MilesPluginManager.load().registries
        protocol_cls = registries.weight_transfer_protocols.get_or_raise(self.protocol_name).load()
        model = protocol_cls.settings_model
        assert issubclass(model, ProtocolSettings), f"{self.protocol_name}'s settings_model is {model!r}"
        undescribed = [name for name, field in model.model_fields.items() if not field.description]
        assert undescribed == [], f"{self.protocol_name}'s settings without a description: {undescribed}"
        required = [name for name, field in model.model_fields.items() if field.is_required()]
        assert required == [], f"{self.protocol_name}'s settings without a default: {required}"
        protocol = self.make_protocol()
        try:
            assert isinstance(protocol.settings, model)  # what the protocol reads its settings from
        finally:
            asyncio.run(protocol.close())

    def test_bad_settings_are_refused_as_documented(self) -> None:
        registries = MilesPluginManager.load().registries
        protocol_cls = registries.weight_transfer_protocols.get_or_raise(self.protocol_name).load()
        for bad in [{**self.protocol_settings, "no_such_setting_for_the_contract": 1}, *self.bad_settings]:
            with pytest.raises(ConfigError) as refused:
                protocol_cls(**bad)
            assert f"do not fit the protocol {self.protocol_name!r}" in str(refused.value)
            assert any(repr(key) in str(refused.value) or f" {key} " in str(refused.value) for key in bad), (
                f"{self.protocol_name} refused {bad} without naming a setting: {refused.value}"
            )

    @staticmethod
    def trainer_model(engines: ContractEngines, seed: int) -> torch.nn.Module:
        model = transformers.AutoModelForCausalLM.from_pretrained(engines.model_dir)
        model.load_state_dict(perturbed_state(model, seed=seed))
        return model

    @staticmethod
    async def served(engines: ContractEngines) -> list[tuple[str, str]]:
        """(weight version, checksum) of every engine."""
        results = []
        for endpoint in engines.endpoints():
            async with EngineClient(endpoint.url, admin_key=CONTRACT_TOKEN) as client:
                results.append((await client.weight_version(), await client.weights_checksum()))
        return results

    async def _transfer(self, protocol: WeightTransferProtocol, model: torch.nn.Module, version: int) -> Any:
        return await protocol.transfer(
            iter(ModuleHfWeightIterator(model, bucket_bytes=SMALL_BUCKET_BYTES)), version=version
        )

    def test_round_trip_versions_and_report(self, contract_engines: ContractEngines) -> None:
        async def scenario() -> None:
            protocol = self.make_protocol()
            await protocol.connect(contract_engines.endpoints())
            try:
                for version, seed in ((101, 1), (102, 2)):
                    model = self.trainer_model(contract_engines, seed)
                    report = await self._transfer(protocol, model, version)
                    expected = checksum(ModuleHfWeightIterator(model, bucket_bytes=1).named_tensors())
                    assert await self.served(contract_engines) == [(str(version), expected)] * contract_engines.count
                    named = list(ModuleHfWeightIterator(model, bucket_bytes=1).named_tensors())
                    assert report.num_bytes == sum(t.numel() * t.element_size() for _, t in named)
                    assert report.version == version and report.num_engines == contract_engines.count
                    assert report.seconds > 0 and report.gb_per_s > 0
            finally:
                await protocol.close()

        asyncio.run(scenario())

    def test_close_leaves_nothing_in_the_temporary_directory(
        self, contract_engines: ContractEngines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """What a protocol makes in the temporary directory for a run (``disk``'s versions when no ``work_dir`` is
        set) is gone once it is closed: runs on a long-lived machine would otherwise fill it (a version per run)."""
        temporary = tmp_path / "tmp"
        temporary.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(temporary))

        async def scenario() -> None:
            protocol = self.make_protocol()
            try:
                await protocol.connect(contract_engines.endpoints())
                await self._transfer(protocol, self.trainer_model(contract_engines, 8), 151)
            finally:
                await protocol.close()

        asyncio.run(scenario())
        assert sorted(path.name for path in temporary.iterdir()) == []

    def test_a_bad_tensor_fails_clearly_and_a_retry_restores_exact_weights(self, contract_engines) -> None:
        async def scenario() -> None:
            protocol = self.make_protocol()
            await protocol.connect(contract_engines.endpoints())
            try:
                before = await self.served(contract_engines)
                model = self.trainer_model(contract_engines, 3)
                bad = list(ModuleHfWeightIterator(model, bucket_bytes=SMALL_BUCKET_BYTES))
                bad[-1] = [*bad[-1], ("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))]
                with pytest.raises(Exception, match=r"up_proj\.weight"):
                    await protocol.transfer(iter(bad), version=201)
                assert [v for v, _ in await self.served(contract_engines)] == [v for v, _ in before]  # not published
                await protocol.connect(contract_engines.endpoints())
                await self._transfer(protocol, model, 202)
                expected = checksum(ModuleHfWeightIterator(model, bucket_bytes=1).named_tensors())
                assert await self.served(contract_engines) == [("202", expected)] * contract_engines.count
            finally:
                await protocol.close()

        asyncio.run(scenario())

    def test_a_dead_engine_is_a_clear_error(self, contract_engines: ContractEngines) -> None:
        async def scenario() -> None:
            protocol = self.make_protocol()
            await protocol.connect(contract_engines.endpoints())
            victim = contract_engines.infos[-1].name
            try:
                await contract_engines.provider.kill(victim)
                await asyncio.sleep(0.2)
                with pytest.raises(Exception) as caught:
                    await asyncio.wait_for(
                        self._transfer(protocol, self.trainer_model(contract_engines, 4), 301), timeout=150
                    )
                assert not isinstance(caught.value, TimeoutError)
            finally:
                await protocol.close()
                await contract_engines.restart_dead()
            protocol = self.make_protocol()
            await protocol.connect(contract_engines.endpoints())
            try:
                model = self.trainer_model(contract_engines, 5)
                await self._transfer(protocol, model, 302)
                expected = checksum(ModuleHfWeightIterator(model, bucket_bytes=1).named_tensors())
                assert await self.served(contract_engines) == [("302", expected)] * contract_engines.count
            finally:
                await protocol.close()

        asyncio.run(scenario())

    def test_holders_send_their_shares_and_a_restarted_engine_gets_the_version_back(self, contract_engines) -> None:
        """For a protocol that sends from the trainer's holders: three holders' shares make exactly the trainer's
        weights on every engine, the report's checksum (combined from the holders' digests) is the engines', and
        after an engine restarts, :meth:`republish` brings it back to that version."""
        protocol = self.make_protocol()
        if not isinstance(protocol, SendsFromHolders):
            pytest.skip(f"{self.protocol_name} sends from the driver only (it is not a SendsFromHolders protocol)")
        if not protocol.sends_from_holders():
            pytest.skip(f"{self.protocol_name} with {self.protocol_settings} sends from the driver only")

        async def scenario() -> None:
            protocol = self.make_protocol()
            await protocol.connect(contract_engines.endpoints())
            try:
                model = self.trainer_model(contract_engines, 6)
                holders = SplitHolders(model)
                report = await protocol.transfer_from_holders(holders, version=401, checksum=True)
                expected = checksum(ModuleHfWeightIterator(model, bucket_bytes=1).named_tensors())
                named = list(ModuleHfWeightIterator(model, bucket_bytes=1).named_tensors())
                assert holders.handed_out == len(named)  # every tensor handed to exactly one holder
                assert report.checksum == expected and report.version == 401
                assert report.num_bytes == sum(t.numel() * t.element_size() for _, t in named)
                assert await self.served(contract_engines) == [("401", expected)] * contract_engines.count
                model = self.trainer_model(contract_engines, 7)  # the next step's weights, in the holders a trainer
                report = await protocol.transfer_from_holders(SplitHolders(model), version=402, checksum=True)
                expected = checksum(ModuleHfWeightIterator(model, bucket_bytes=1).named_tensors())  # hands out anew
                assert report.checksum == expected
                assert await self.served(contract_engines) == [("402", expected)] * contract_engines.count
                victim = contract_engines.infos[-1].name
                await contract_engines.provider.kill(victim)
                for _ in range(100):
                    if not await contract_engines.provider.is_alive(victim):
                        break
                    await asyncio.sleep(0.1)
                await contract_engines.restart_dead()
                assert (await self.served(contract_engines))[-1] != ("402", expected)  # back with its checkpoint
                await protocol.connect(contract_engines.endpoints())
                await protocol.republish(402)
                assert await self.served(contract_engines) == [("402", expected)] * contract_engines.count
            finally:
                await protocol.close()

        asyncio.run(scenario())
