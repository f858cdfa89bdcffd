"""Every built-in protocol and the third-party example pass the same contract (the core's pytest plugin)."""

from __future__ import annotations

import pytest

from miles_core.testkit.protocol_contract import ProtocolContract

pytestmark = pytest.mark.slow


class TestDisk(ProtocolContract):
    protocol_name = "disk"


class TestTensorSharedMemory(ProtocolContract):
    protocol_name = "tensor"


class TestTensorOverHttp(ProtocolContract):
    protocol_name = "tensor"
    protocol_settings = {"shared_memory": False}


class TestBroadcastGloo(ProtocolContract):
    protocol_name = "broadcast"
    protocol_settings = {"timeout_s": 30.0}


class TestExampleShardedDisk(ProtocolContract):
    """The third-party example, registered only through the ``miles.weight_transfer`` entry point."""

    protocol_name = "sharded-disk"
