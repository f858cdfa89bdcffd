"""Protocol settings are declared pydantic models, validated in one place (``weight_transfer.settings``) when the
config is built: malformed and hostile ``--weight-transfer-settings`` for every built-in protocol (and ``auto``'s
settings per protocol) are a configuration error naming the protocol, the setting, the value and what is allowed,
before anything starts. The plugins' protocols are checked beside their own tests (``tests/rdt/``,
``tests/test_example_transfer_protocol.py``)."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest

from miles_core import ProtocolSettings
from miles_core.config.build import build_config
from miles_core.errors import ConfigError
from miles_core.loop import make_protocol
from miles_core.plugin_manager import MilesPluginManager
from miles_core.weight_transfer.auto import AutoProtocol
from miles_core.weight_transfer.broadcast import BroadcastProtocol
from miles_core.weight_transfer.disk import DiskProtocol
from miles_core.weight_transfer.protocol import WeightTransferProtocol
from miles_core.weight_transfer.settings import MAX_LISTED_PROBLEMS, allowed_values, validate_settings
from miles_core.weight_transfer.tensor import TensorProtocol

HEADER = "weight_transfer.settings (--weight-transfer-settings)"


@pytest.fixture(scope="module")
def manager() -> MilesPluginManager:
    return MilesPluginManager.load(environ={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})  # the core's protocols only


def refused_at_build(manager: MilesPluginManager, mode: str, settings: Any) -> str:
    overrides = {"weight_transfer.mode": mode, "weight_transfer.settings": settings}
    with pytest.raises(ConfigError) as refused:
        build_config(manager, overrides=overrides)
    return str(refused.value)


# -- every built-in protocol, when the config is built ---------------------------------------------------------

BAD_SETTINGS = [
    # (protocol, settings, what the error says)
    (
        "disk",
        {"keep_version": 3},
        "disk has no setting 'keep_version' (did you mean 'keep_versions'?); disk's settings: ",
    ),
    (
        "disk",
        {"keep_versions": True},
        "keep_versions = True: expected a whole number of at least 1 and of at most 64 (a boolean is not",
    ),
    ("disk", {"keep_versions": 2.0}, "disk setting keep_versions = 2.0: expected a whole number of at least 1"),
    ("disk", {"keep_versions": -3}, "disk setting keep_versions = -3: expected a whole number of at least 1"),
    ("disk", {"work_dir": ["/tmp"]}, "disk setting work_dir = ['/tmp']: expected a string or null"),
    ("tensor", {"zero_cpy": False}, "tensor has no setting 'zero_cpy' (did you mean 'zero_copy'?)"),
    ("tensor", {"zero_copy": 0}, "tensor setting zero_copy = 0: expected true or false"),
    ("tensor", {"zero_copy": "false"}, "tensor setting zero_copy = 'false': expected true or false"),
    ("tensor", {"shared_memory": "yes"}, "tensor setting shared_memory = 'yes': expected true, false or null"),
    ("tensor", {"shm_dir": {"path": "/dev/shm"}}, "tensor setting shm_dir = {'path': '/dev/shm'}: expected a string"),
    ("broadcast", {"timeout": 30}, "broadcast has no setting 'timeout' (did you mean 'timeout_s'?)"),
    ("broadcast", {"timeout_s": True}, "timeout_s = True: expected a number above 0 (a boolean is not a number)"),
    ("broadcast", {"timeout_s": 0}, "broadcast setting timeout_s = 0: expected a number above 0"),
    ("broadcast", {"timeout_s": "30"}, "broadcast setting timeout_s = '30': expected a number above 0"),
    ("broadcast", {"backend": "NCCL"}, "broadcast setting backend = 'NCCL': expected 'auto', 'gloo' or 'nccl'"),
    ("broadcast", {"master_address": 127}, "broadcast setting master_address = 127: expected a non-empty string"),
    ("auto", {"tensr": {}}, "auto has no setting 'tensr' (did you mean 'tensor'?); auto's settings: tensor, rdt,"),
    ("auto", {"zero_copy": False}, "auto has no setting 'zero_copy'; auto's settings: tensor, rdt, broadcast, disk"),
    ("auto", {"tensor": [1, 2]}, "auto setting tensor = [1, 2]: expected a mapping (a JSON object)"),
    ("auto", {"broadcast": None}, "auto setting broadcast = None: expected a mapping (a JSON object)"),
    ("auto", {"sharded-disk": {}}, "auto has no setting 'sharded-disk'"),  # a protocol auto never chooses
]


@pytest.mark.parametrize(("mode", "settings", "message"), BAD_SETTINGS)
def test_bad_settings_are_refused_when_the_config_is_built(manager, mode: str, settings: dict, message: str) -> None:
    text = refused_at_build(manager, mode, settings)
    assert text.startswith(f"{HEADER} {json.dumps(settings)} do not fit the protocol {mode!r} (miles_core."), text
    assert message in text, text


@pytest.mark.parametrize(("mode", "settings", "message"), BAD_SETTINGS)
def test_a_protocol_built_with_bad_settings_refuses_them_the_same_way(
    manager, mode: str, settings: dict, message: str
) -> None:
    protocol_cls = manager.registries.weight_transfer_protocols.get_or_raise(mode).load()
    with pytest.raises(ConfigError) as refused:
        protocol_cls(**settings)
    assert message in str(refused.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_number_that_is_not_finite_is_refused(value: float) -> None:
    """The flag and the YAML reader refuse them first; a protocol built in code refuses them too."""
    with pytest.raises(ConfigError, match=rf"broadcast setting timeout_s = {value!r}: expected a number above 0"):
        BroadcastProtocol(timeout_s=value)


def test_every_refused_setting_is_named_once_one_per_line(manager) -> None:
    text = refused_at_build(
        manager, "broadcast", {"timeout_s": -1, "backend": "mpi", "master_address": "", "size": 1, "tries": 2}
    )
    lines = text.splitlines()
    assert lines[0].endswith(
        "do not fit the protocol 'broadcast' (miles_core.weight_transfer.broadcast:BroadcastProtocol): 4 problems:"
    )
    assert lines[1] == (
        "  broadcast has no settings 'size', 'tries'; broadcast's settings: master_address, timeout_s, backend "
        """(e.g. --weight-transfer-settings '{"backend": "gloo", "timeout_s": 60}')"""
    )
    assert [line.split(":")[0] for line in lines[2:]] == [
        "  broadcast setting master_address = ''",
        "  broadcast setting timeout_s = -1",
        "  broadcast setting backend = 'mpi'",
    ]
    assert "; timeout_s: Seconds an engine may take" in lines[3]  # the field's description says what it is for


def test_thousands_of_unknown_settings_give_a_short_error(manager) -> None:
    settings = {f"key{i}": i for i in range(5000)}
    text = refused_at_build(manager, "tensor", settings)
    assert len(text) < 1500, len(text)
    assert f"and {5000 - MAX_LISTED_PROBLEMS} more" in text and "tensor's settings: shared_memory, zero_copy" in text


def test_good_settings_are_kept_typed_on_the_protocol(tmp_path) -> None:
    disk = DiskProtocol(work_dir=str(tmp_path), keep_versions=1)
    assert (disk.settings.keep_versions, disk.work_dir) == (1, tmp_path)
    broadcast = BroadcastProtocol(timeout_s=5, backend="gloo")
    assert broadcast.settings.timeout_s == 5.0 and isinstance(broadcast.settings.timeout_s, float)
    assert TensorProtocol(zero_copy=False).settings.zero_copy is False
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        broadcast.settings.timeout_s = 1  # type: ignore[misc]


# -- auto: the settings it keeps for each protocol it may choose ------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tensor": {"zero_cpy": False}}, "tensor has no setting 'zero_cpy' (did you mean 'zero_copy'?)"),
        ({"disk": {"keep_versions": 0}}, "disk setting keep_versions = 0: expected a whole number of at least 1"),
        # broadcast is not chosen for the local engines of this run, and its settings are checked all the same
        ({"broadcast": {"timeout_s": -1}}, "broadcast setting timeout_s = -1: expected a number above 0"),
        ({"broadcast": {"backend": True}}, "broadcast setting backend = True: expected 'auto', 'gloo' or 'nccl'"),
    ],
)
def test_auto_checks_the_settings_of_each_protocol_when_the_config_is_built(
    manager, settings: dict, message: str
) -> None:
    ((name, nested),) = settings.items()
    text = refused_at_build(manager, "auto", settings)
    assert text.startswith(
        f"weight_transfer.settings.{name} (--weight-transfer-settings) {json.dumps(nested)} "
        f"do not fit the protocol {name!r}"
    )
    assert message in text


def test_auto_refuses_settings_of_a_protocol_that_is_not_installed(manager) -> None:
    """rdt is a candidate of auto, provided by a plugin that this manager does not load."""
    text = refused_at_build(manager, "auto", {"rdt": {"transport": "gloo"}})
    assert text.startswith("weight_transfer.settings.rdt (--weight-transfer-settings): settings of the protocol 'rdt'")
    assert "unknown weight transfer protocol 'rdt'; available: auto, broadcast, disk, tensor" in text


def test_auto_builds_the_protocol_it_chooses_with_that_protocols_settings(manager) -> None:
    config = build_config(manager, overrides={"weight_transfer.settings": {"tensor": {"zero_copy": False}}})
    protocol = make_protocol(config, manager.registries)
    assert isinstance(protocol, AutoProtocol)
    part = protocol._build("tensor")
    assert isinstance(part, TensorProtocol) and part.settings.zero_copy is False
    assert protocol._build("broadcast").settings == BroadcastProtocol.settings_model()  # none given: the defaults


def test_per_protocol_settings_are_for_auto_alone(manager) -> None:
    text = refused_at_build(manager, "tensor", {"tensor": {"zero_copy": False}})
    settings = "shared_memory, zero_copy, held_dtype, staging_mb, shm_dir"
    assert f"tensor has no setting 'tensor'; tensor's settings: {settings} (e.g. " in text


# -- the kernel's check itself ----------------------------------------------------------------------------------


class Undeclared(WeightTransferProtocol):
    """A protocol that declares no settings model (written before protocols declared one)."""

    name = "undeclared"

    async def connect(self, engines) -> None: ...

    async def transfer(self, buckets, *, version):  # pragma: no cover - never called
        raise NotImplementedError


def test_a_protocol_without_a_settings_model_takes_no_settings() -> None:
    assert isinstance(Undeclared().settings, ProtocolSettings)
    with pytest.raises(
        ConfigError,
        match=r"undeclared has no setting 'directory'; "
        r"undeclared takes no settings \(its class names no settings_model\)",
    ):
        Undeclared(directory="/tmp")


def test_a_settings_model_that_is_not_protocol_settings_is_refused() -> None:
    class Plain(pydantic.BaseModel):
        option: int = 1

    broken = type("Broken", (Undeclared,), {"name": "broken", "settings_model": Plain})
    with pytest.raises(
        ConfigError,
        match=r"protocol 'broken' .*its settings_model is .*Plain.*not a subclass of miles_core.ProtocolSettings",
    ):
        broken()


@pytest.mark.parametrize("settings", [[1, 2], "zero_copy=false", 3, None])
def test_settings_that_are_not_a_mapping_are_refused(settings: Any) -> None:
    with pytest.raises(ConfigError) as refused:
        validate_settings(TensorProtocol, settings)
    assert "do not fit the protocol 'tensor'" in str(refused.value)
    assert "expected a mapping of setting names to values; tensor's settings: shared_memory, zero_copy" in str(
        refused.value
    )


def test_settings_that_are_not_a_mapping_are_refused_by_the_config(manager) -> None:
    with pytest.raises(ConfigError, match=r"weight_transfer.settings = \[1, 2\]: Input should be a valid dictionary"):
        build_config(manager, overrides={"weight_transfer.settings": [1, 2]})


def test_a_models_own_checks_are_reported_with_their_message() -> None:
    class Windowed(ProtocolSettings):
        low: int = pydantic.Field(default=0, ge=0, description="Lower end.")
        high: int = pydantic.Field(default=1, ge=0, description="Upper end.")

        @pydantic.field_validator("high")
        @classmethod
        def _even(cls, value: int) -> int:
            if value % 2:
                raise ValueError("must be even")
            return value

        @pydantic.model_validator(mode="after")
        def _ordered(self) -> Windowed:
            if self.low > self.high:
                raise ValueError("low must not exceed high")
            return self

    windowed = type("WindowedProtocol", (Undeclared,), {"name": "windowed", "settings_model": Windowed})
    with pytest.raises(
        ConfigError,
        match=r"windowed setting high = 3: expected a whole number of at least 0; high: Upper end. "
        r"\(Value error, must be even\)",
    ):
        windowed(high=3)
    with pytest.raises(ConfigError, match="windowed settings: Value error, low must not exceed high"):
        windowed(low=4, high=2)


class Described(ProtocolSettings):
    flag: bool | None = pydantic.Field(default=None, description="d")
    count: int = pydantic.Field(default=1, ge=1, le=8, description="d")
    ratio: float = pydantic.Field(default=0.5, gt=0, lt=1, description="d")
    name: str = pydantic.Field(default="x", min_length=1, description="d")
    path: str | None = pydantic.Field(default=None, description="d")


@pytest.mark.parametrize(
    ("field", "words"),
    [
        ("flag", "true, false or null"),
        ("count", "a whole number of at least 1 and of at most 8"),
        ("ratio", "a number above 0 and below 1"),
        ("name", "a non-empty string"),
        ("path", "a string or null"),
    ],
)
def test_allowed_values_in_words(field: str, words: str) -> None:
    assert allowed_values(Described.model_fields[field]) == words
