"""Every protocol setting that sizes something has a bound (issue 45, item 4), and an address setting is a host of
this node that the run uses. Sizes: a hard cap in the field (the same on every machine, stated in the flag docs) and
the machine's bound (per CPU, a share of physical memory), both refused when the config is built. Addresses: the form
(at most 253 characters, a host name or an IP address) when the config is built; that it resolves to an address of
the node that binds it when the protocol is built at run setup; a warning, once, where the run would not use it.
The rdt plugin's sizes are checked beside its own tests (``tests/rdt/test_staging.py``). No engine is started."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from miles_core.bounds import (
    MAX_HOST_CHARS,
    addresses_of_this_node,
    check_host,
    machine_cpus,
    machine_memory_mib,
)
from miles_core.builtin.core_plugin import LOCAL_PER_CPU
from miles_core.config.build import build_config
from miles_core.errors import ConfigError
from miles_core.loop import make_protocol
from miles_core.plugin_manager import MilesPluginManager
from miles_core.weight_transfer.auto import AutoProtocol
from miles_core.weight_transfer.broadcast import BroadcastProtocol
from miles_core.weight_transfer.protocol import EngineEndpoint, WeightTransferProtocol
from miles_core.weight_transfer.routes import LOCAL_ENGINE
from miles_core.weight_transfer.settings import allowed_values
from miles_core.weight_transfer.tensor import TensorSettings

HEADER = "weight_transfer.settings (--weight-transfer-settings)"
NOT_THIS_NODE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): documentation only, no interface of a machine has it


@pytest.fixture(scope="module")
def manager() -> MilesPluginManager:
    return MilesPluginManager.load(environ={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})  # the core's protocols only


def refused_at_build(manager: MilesPluginManager, mode: str, settings: Any) -> str:
    with pytest.raises(ConfigError) as refused:
        build_config(manager, overrides={"weight_transfer.mode": mode, "weight_transfer.settings": settings})
    text = str(refused.value)
    assert text.startswith(f"{HEADER} {json.dumps(settings)[:150]}"), text
    return text


# -- sizes ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "settings", "message"),
    [
        ("disk", {"keep_versions": 65}, "disk setting keep_versions = 65: expected a whole number of at least 1 and "
         "of at most 64; keep_versions: The versions kept on disk (at most 64: each is a whole copy"),
        ("tensor", {"staging_mb": 2_000_000}, "tensor setting staging_mb = 2000000: expected a number above 0 and of "
         "at most 1048576"),
        ("auto", {"disk": {"keep_versions": 100000}}, "disk setting keep_versions = 100000: expected a whole number "
         "of at least 1 and of at most 64"),
    ],
)  # fmt: skip
def test_a_size_beyond_its_hard_cap_is_refused_when_the_config_is_built(
    manager: MilesPluginManager, mode: str, settings: dict, message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        build_config(manager, overrides={"weight_transfer.mode": mode, "weight_transfer.settings": settings})
    assert message in str(refused.value), str(refused.value)


def test_tensor_staging_files_beyond_a_quarter_of_this_machines_memory_are_refused(
    manager: MilesPluginManager,
) -> None:
    """Two staging files must fit in half of the physical memory: one MiB more than a quarter is refused, and says
    why with the machine's numbers; a quarter is taken."""
    quarter = machine_memory_mib() // 4
    text = refused_at_build(manager, "tensor", {"staging_mb": quarter + 1})
    assert f"tensor setting staging_mb = {quarter + 1}: expected a number above 0 and of at most 1048576" in text
    assert text.endswith(
        f"(Value error, 2 staging files of {quarter + 1} MiB would take more than half of this machine's "
        f"{machine_memory_mib()} MiB of memory (at most {quarter} MiB each))"
    ), text
    config = build_config(
        manager, overrides={"weight_transfer.mode": "tensor", "weight_transfer.settings": {"staging_mb": quarter}}
    )
    assert config.weight_transfer.settings == {"staging_mb": quarter}


def test_the_bounds_are_stated_where_the_flag_docs_come_from() -> None:
    """The field's description and allowed values (which the errors and the generated docs quote) name the cap."""
    field = TensorSettings.model_fields["staging_mb"]
    assert allowed_values(field) == "a number above 0 and of at most 1048576"
    assert "at most a quarter of the physical memory" in field.description
    assert allowed_values(BroadcastProtocol.settings_model.model_fields["master_address"]) == (
        "a non-empty string of at most 253 characters or null"
    )


# -- addresses: their form, when the config is built ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("a" * 100_000, "broadcast setting master_address = 'aaaa"),
        ("no such host", "Value error, neither an IP address nor a host name"),
        ("host:29500", "Value error, neither an IP address nor a host name"),
        ("-leading.example", "Value error, neither an IP address nor a host name"),
        ("a" * 64 + ".example", "Value error, neither an IP address nor a host name (labels of 1-63 letters"),
    ],
)
def test_a_master_address_that_is_not_a_host_is_refused_when_the_config_is_built(
    manager: MilesPluginManager, address: str, message: str
) -> None:
    text = refused_at_build(manager, "broadcast", {"master_address": address})
    assert message in text, text
    assert "expected a non-empty string of at most 253 characters or null" in text
    assert len(text) < 2000  # a 100 KB value is quoted cut


def test_the_hosts_a_master_address_may_name() -> None:
    for host in ["127.0.0.1", "::1", "[::1]", "localhost", "node-1.cluster.example", "a" * 63, "10.0.0.1"]:
        assert check_host(host) == host
    longest = ".".join(["a" * 63] * 3 + ["a" * 61])
    assert len(longest) == MAX_HOST_CHARS and check_host(longest) == longest
    with pytest.raises(ValueError, match="254 characters; a host name has at most 253"):
        check_host(longest + "a")


# -- addresses: this node's, when the protocol is built at run setup -------------------------------------------------


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("no.such.host", "MilesError: 'no.such.host' does not resolve"),
        (
            NOT_THIS_NODE,
            f"MilesError: master_address '{NOT_THIS_NODE}' resolves to {NOT_THIS_NODE}, not an address of this node",
        ),
    ],
)
def test_a_master_address_that_is_not_this_nodes_is_refused_at_run_setup(
    manager: MilesPluginManager, address: str, message: str
) -> None:
    """The form fits, so the config builds; building the protocol (the driver, which binds the address) refuses it,
    naming the setting and what to give instead, before any engine is asked to join."""
    config = build_config(
        manager,
        overrides={"weight_transfer.mode": "broadcast", "weight_transfer.settings": {"master_address": address}},
    )
    with pytest.raises(ConfigError) as refused:
        make_protocol(config, manager.registries)
    text = str(refused.value)
    assert text.startswith(f'{HEADER} {{"master_address": "{address}"}} do not fit the protocol \'broadcast\''), text
    assert message in text, text
    if address == NOT_THIS_NODE:
        assert NOT_THIS_NODE not in addresses_of_this_node()
        assert "leave master_address unset for this node's address" in text


def test_a_master_address_of_this_node_is_taken() -> None:
    for address in ["127.0.0.1", "localhost"]:
        assert BroadcastProtocol(master_address=address).settings.master_address == address


class _NoHolders:
    """Holders whose every task fails: the transfer stops after its checks, before any group forms."""

    def run_task(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no holders in this test")


def test_a_master_address_the_holders_path_does_not_use_is_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    protocol = BroadcastProtocol(master_address="127.0.0.1")
    caplog.set_level(logging.WARNING, logger="miles_core.weight_transfer.broadcast")
    for version in (1, 2):
        with pytest.raises(RuntimeError, match="no holders in this test"):
            asyncio.run(protocol.transfer_from_holders(_NoHolders(), version=version))
    warnings = [record.getMessage() for record in caplog.records]
    assert warnings == [
        "broadcast: the setting master_address '127.0.0.1' is not used: the weights go from the trainer's holders, "
        "whose groups meet at each holder's node; only transfers from the driver use master_address (remove it, or "
        "run a trainer without holders)"
    ]
    caplog.clear()
    with pytest.raises(RuntimeError):
        asyncio.run(BroadcastProtocol().transfer_from_holders(_NoHolders(), version=1))
    assert caplog.records == []  # nothing set, nothing said


class _Idle(WeightTransferProtocol):
    name = "idle"

    async def connect(self, engines: Any) -> None:
        return None

    async def transfer(self, buckets: Any, *, version: int) -> Any:
        raise AssertionError("not called")


def test_settings_for_a_protocol_auto_does_not_choose_are_warned_about_once(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture
) -> None:
    """A master_address for broadcast while every engine is on the trainer's node (auto chooses tensor); capsys
    keeps auto's announcement off the terminal."""
    auto = AutoProtocol(broadcast={"master_address": "127.0.0.1"}, tensor={"zero_copy": False})
    auto.bind(lambda name, settings: _Idle(), engines_in_ray=False)
    here = EngineEndpoint("engine-0", "http://127.0.0.1:30000", "key", LOCAL_ENGINE)
    caplog.set_level(logging.WARNING, logger="miles_core.weight_transfer.auto")

    async def connect_twice() -> None:
        await auto.connect([here])
        await auto.connect([here])

    asyncio.run(connect_twice())
    assert [record.getMessage() for record in caplog.records] == [
        'auto: the settings given for broadcast ({"master_address": "127.0.0.1"}) are not used: auto chose tensor '
        "for the engines of this placement; remove them, or name the protocol with --update-weight-transfer-mode"
    ]


# -- engine and trainer sizes with the local worker provider -----------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"engine.num_engines": 5000}, "engine.num_engines = 5000: Input should be less than or equal to 1024"),
        ({"engine.cpu_threads": 5000}, "engine.cpu_threads = 5000: Input should be less than or equal to 1024"),
        ({"train.cpu_threads": 5000}, "train.cpu_threads = 5000: Input should be less than or equal to 1024"),
        ({"engine.max_batch_size": 100_000}, "engine.max_batch_size = 100000: Input should be less than or equal to"),
        (
            {"weight_transfer.bucket_size_mb": 2_000_000},
            "weight_transfer.bucket_size_mb = 2000000: Input should be less than or equal to 1048576",
        ),
    ],
)
def test_engines_and_threads_beyond_their_hard_cap_are_refused(
    manager: MilesPluginManager, overrides: dict, message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        build_config(manager, overrides={**overrides, "run.worker_provider": "ray"})
    assert message in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    ("field", "flag", "what"),
    [
        ("engine.num_engines", "--engine-num-engines", "engines"),
        ("engine.cpu_threads", "--engine-cpu-threads", "threads per engine"),
        ("train.cpu_threads", "--train-cpu-threads", "trainer threads"),
    ],
)
def test_local_engines_and_threads_beyond_four_per_cpu_of_this_machine_are_refused(
    manager: MilesPluginManager, field: str, flag: str, what: str
) -> None:
    """With the local provider every process runs here; with Ray the cluster's nodes decide (the hard cap alone)."""
    bound = LOCAL_PER_CPU * machine_cpus()
    with pytest.raises(ConfigError) as refused:
        build_config(manager, overrides={field: bound + 1})
    assert str(refused.value) == (
        f"{field} ({flag}) = {bound + 1}: more than 4 {what} per CPU of this machine ({machine_cpus()} CPUs: at most "
        f"{bound}) with the local worker provider, where every process runs here; give at most {bound}, or "
        "--run-worker-provider ray to place them on a cluster"
    )
    assert build_config(manager, overrides={field: bound}) is not None
    assert build_config(manager, overrides={field: bound + 1, "run.worker_provider": "ray"}) is not None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("megatron.threads_per_rank", 100_000),
        ("megatron.cpus_per_rank", 100_000.0),
        ("megatron.data_parallel", 100_000),
        ("sglang.tp_size", 100_000),
        ("sglang.gpus_per_engine", 100_000.0),
    ],
)
def test_the_backends_sizes_beyond_their_hard_cap_are_refused(field: str, value: float) -> None:
    """The Megatron and SGLang plugins' sections: ranks, threads and GPUs per engine are capped at 1024."""
    plugins = MilesPluginManager.load()
    with pytest.raises(ConfigError) as refused:
        build_config(plugins, overrides={field: value})
    assert f"{field} = {value}: Input should be less than or equal to 1024" in str(refused.value), str(refused.value)


def test_a_transfer_bucket_beyond_a_quarter_of_this_machines_memory_is_refused(manager: MilesPluginManager) -> None:
    quarter = machine_memory_mib() // 4
    with pytest.raises(ConfigError) as refused:
        build_config(manager, overrides={"weight_transfer.bucket_size_mb": quarter + 1})
    assert (
        f"weight_transfer.bucket_size_mb = {quarter + 1}: Value error, 2 transfer buckets of {quarter + 1} MiB would "
        f"take more than half of this machine's {machine_memory_mib()} MiB of memory (at most {quarter} MiB each)"
    ) in str(refused.value)
    config = build_config(manager, overrides={"weight_transfer.bucket_size_mb": quarter})
    assert config.weight_transfer.bucket_size_mb == quarter
