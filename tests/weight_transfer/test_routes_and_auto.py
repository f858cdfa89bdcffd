"""Declared weight routes: which protocol reaches which engine, decided in one place (``routes.route_for``), and
``auto``'s choice per engine (``routes.choose_protocol``, ``AutoProtocol``). No engine is started: the checks run
before any request, and ``auto`` is driven with recording protocols."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
from pathlib import Path

import pydantic
import pytest
import torch

from miles_core.config.build import build_config
from miles_core.errors import ConfigError
from miles_core.plugin_manager import MilesPluginManager
from miles_core.weight_transfer.auto import AutoProtocol, AutoSettings
from miles_core.weight_transfer.protocol import EngineEndpoint, TransferReport, WeightTransferProtocol
from miles_core.weight_transfer.routes import (
    DISK,
    DISTRIBUTED,
    LOCAL_ENGINE,
    SGLANG_HTTP_API,
    STAGING_COPY,
    STAGING_SWAP,
    TENSOR_BYTES,
    WEIGHTS_BY_NAME,
    EngineCapabilities,
    choose_protocol,
    route_for,
)
from miles_core.weight_transfer.settings import ProtocolSettings
from miles_core.weight_transfer.tensor import TensorProtocol

SGLANG = EngineCapabilities(frozenset({DISK, DISTRIBUTED, STAGING_COPY, WEIGHTS_BY_NAME}), "loader.load", tp_size=2)
NIXL = importlib.util.find_spec("nixl") is not None
ELSEWHERE = "http://198.51.100.7:30000"  # a documentation address: never this node, never contacted


def test_a_route_is_the_protocols_first_that_the_engine_serves_where_it_runs() -> None:
    assert route_for(TensorProtocol, "engine engine-0", LOCAL_ENGINE, same_node=True) == "staging_swap"
    assert route_for(TensorProtocol, "engine engine-0", SGLANG, same_node=True) == "staging_copy"
    assert route_for(TensorProtocol, "engine engine-0", LOCAL_ENGINE, same_node=False) == "tensor_bytes"


def test_tensor_to_sglang_on_another_node_names_engine_protocol_and_what_reaches_it() -> None:
    with pytest.raises(ConfigError) as refused:
        route_for(TensorProtocol, "engine engine-1", SGLANG, same_node=False)
    message = str(refused.value)
    assert "= 'tensor' cannot reach engine engine-1 (on another node than the sender)" in message
    assert "tensor needs tensor_bytes, and the engine serves disk, distributed, staging_copy, weights_by_name" in (
        message
    )
    assert message.endswith("protocols that reach it: auto, broadcast, disk, rdt")


def test_a_protocol_that_declares_no_routes_is_not_checked() -> None:
    class Undeclared(WeightTransferProtocol):
        name = "undeclared"

    assert route_for(Undeclared, "engine engine-0", SGLANG_HTTP_API, same_node=False) is None


@pytest.mark.parametrize(
    ("capabilities", "same_node", "in_ray", "expected"),
    [
        (LOCAL_ENGINE, True, False, "tensor"),
        (SGLANG, True, True, "tensor"),
        (SGLANG, False, False, "broadcast"),
        (SGLANG, False, True, "rdt" if NIXL else "broadcast"),
        (SGLANG_HTTP_API, True, False, "broadcast"),
        (EngineCapabilities(frozenset({DISK})), False, True, "disk"),
    ],
)
def test_auto_takes_the_fastest_protocol_the_engine_and_its_place_support(
    capabilities: EngineCapabilities, same_node: bool, in_ray: bool, expected: str
) -> None:
    protocol, why = choose_protocol(capabilities, same_node=same_node, in_ray=in_ray)
    assert protocol == expected and why


def test_engines_that_serve_no_known_route_are_an_error() -> None:
    with pytest.raises(ConfigError, match=r"serves no weight route Miles knows \(checksum\)"):
        choose_protocol(EngineCapabilities(frozenset({"checksum"})), same_node=True, in_ray=False)


def test_tensor_refuses_sglang_on_another_node_at_connect_before_any_request() -> None:
    protocol = TensorProtocol(shared_memory=False)  # as for an engine on another node
    with pytest.raises(ConfigError, match=r"'tensor' cannot reach engine engine-0 \(on another node"):
        asyncio.run(protocol.connect([EngineEndpoint("engine-0", ELSEWHERE, "key", SGLANG)]))


class RecordingSettings(ProtocolSettings):
    zero_copy: bool = pydantic.Field(default=True, description="Recorded, as tensor's setting of that name.")


class Recording(WeightTransferProtocol):
    """A protocol that records what it was given."""

    settings_model = RecordingSettings
    calls: list[tuple[str, object]] = []

    def __init__(self, name: str, **settings: object) -> None:
        super().__init__(**settings)
        self.name = name

    async def connect(self, engines):
        Recording.calls.append((f"{self.name}.connect", [engine.name for engine in engines]))

    async def transfer(self, buckets, *, version: int) -> TransferReport:
        names = [name for bucket in buckets for name, _ in bucket]
        Recording.calls.append((f"{self.name}.transfer", names))
        return TransferReport(self.name, version, num_bytes=8, seconds=0.5, num_engines=1)


def test_auto_chooses_per_engine_says_so_once_and_sends_the_same_weights_through_each(capsys) -> None:
    Recording.calls = []
    auto = AutoProtocol(tensor={"zero_copy": False})
    built: dict[str, dict] = {}

    def factory(name: str, settings: dict) -> Recording:
        built[name] = settings
        return Recording(name, **settings)

    auto.bind(factory, engines_in_ray=False)
    here = EngineEndpoint("engine-0", "http://127.0.0.1:30000", "key", LOCAL_ENGINE)
    there = EngineEndpoint("engine-1", ELSEWHERE, "key", SGLANG)
    buckets = [[("a", torch.zeros(2))], [("b", torch.ones(2))]]

    async def scenario() -> TransferReport:
        await auto.connect([here, there])
        await auto.connect([here, there])  # the same choice: not said again
        return await auto.transfer(iter(buckets), version=4)

    report = asyncio.run(scenario())
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("miles: weights to")]
    assert lines == [
        "miles: weights to engine-0 by tensor (auto: on the trainer's node: shared memory)",
        "miles: weights to engine-1 by broadcast (auto: on another node, engines not in Ray actors (rdt needs "
        "--run-worker-provider ray): a gloo/NCCL group)",
    ]
    assert built == {"broadcast": {}, "tensor": {"zero_copy": False}}
    assert {("tensor.connect", ("engine-0",)), ("broadcast.connect", ("engine-1",))} <= {
        (call, tuple(names)) for call, names in Recording.calls
    }
    assert [names for call, names in Recording.calls if call.endswith("transfer")] == [["a", "b"], ["a", "b"]]
    assert report.protocol == "auto/broadcast+tensor" and report.num_engines == 2 and report.seconds == 1.0


def test_auto_settings_are_per_protocol_objects() -> None:
    with pytest.raises(ConfigError) as refused:
        AutoProtocol(zero_copy=False)
    assert "auto has no setting 'zero_copy'; auto's settings: tensor, rdt, broadcast, disk (e.g. " in str(refused.value)
    assert '\'{"tensor": {"zero_copy": false}' in str(refused.value)
    with pytest.raises(ConfigError, match=r"auto setting tensor = False: expected a mapping \(a JSON object\)"):
        AutoProtocol(tensor=False)
    assert AutoProtocol(tensor={"zero_copy": False}).settings.settings_of("tensor") == {"zero_copy": False}


def test_auto_keeps_settings_for_every_protocol_it_may_choose() -> None:
    """Each name :func:`choose_protocol` can answer is a setting of auto (a protocol it chooses has settings there)."""
    routes = [DISK, DISTRIBUTED, STAGING_COPY, STAGING_SWAP, TENSOR_BYTES]
    chosen = set()
    for size in range(len(routes) + 1):
        for served in itertools.combinations(routes, size):
            for same_node, in_ray in itertools.product([True, False], repeat=2):
                try:
                    chosen.add(
                        choose_protocol(EngineCapabilities(frozenset(served)), same_node=same_node, in_ray=in_ray)[0]
                    )
                except ConfigError:
                    continue  # serves no route Miles knows
    assert {"tensor", "broadcast", "disk"} <= chosen <= set(AutoSettings.model_fields)
    assert "rdt" in AutoSettings.model_fields  # chosen where nixl is installed


def test_auto_is_the_default_and_sglang_takes_it_with_no_protocol_flag() -> None:
    manager = MilesPluginManager.load()
    assert build_config(manager).weight_transfer.mode == "auto"
    assert build_config(manager, overrides={"engine.backend": "sglang"}).weight_transfer.mode == "auto"
    build_config(manager, overrides={"engine.backend": "sglang", "weight_transfer.mode": "tensor"})


def test_a_protocol_the_engines_cannot_take_is_refused_when_the_config_is_built(tmp_path: Path) -> None:
    manager = MilesPluginManager.load()
    other_server = {"engine.backend": "sglang", "sglang.launch_command": [str(tmp_path / "my-server")]}
    with pytest.raises(ConfigError) as refused:
        build_config(manager, overrides={**other_server, "weight_transfer.mode": "tensor"})
    assert "'tensor' cannot reach the engines of engine.backend (--engine) = 'sglang'" in str(refused.value)
    assert "protocols that reach it: auto, broadcast, disk" in str(refused.value)
