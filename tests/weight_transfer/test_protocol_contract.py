"""Every built-in protocol and the third-party example pass the same contract (the core's pytest plugin)."""

from __future__ import annotations

import pytest

from miles_core.testkit.protocol_contract import ProtocolContract

pytestmark = pytest.mark.slow


class TestDisk(ProtocolContract):
    protocol_name = "disk"
    bad_settings = [{"keep_versions": 0}, {"keep_versions": "2"}, {"keep_versions": 1.5}, {"work_dir": ["/tmp"]}]


class TestTensorSharedMemory(ProtocolContract):
    protocol_name = "tensor"
    bad_settings = [{"zero_copy": "false"}, {"shared_memory": 0}, {"shm_dir": 3}]


class TestTensorOverHttp(ProtocolContract):
    protocol_name = "tensor"
    protocol_settings = {"shared_memory": False}


class TestBroadcastGloo(ProtocolContract):
    protocol_name = "broadcast"
    # A dead engine is found when the collective times out, so the dead-engine test waits this long once; the other
    # tests' transfers (a tiny model, two engines) finish in seconds even on a loaded machine.
    protocol_settings = {"timeout_s": 15.0}
    bad_settings = [
        {"timeout_s": 0},
        {"timeout_s": float("nan")},
        {"backend": "mpi"},
        {"master_address": ""},
        {"master_address": 5},
    ]


class TestExampleShardedDisk(ProtocolContract):
    """The third-party example, registered only through the ``miles.weight_transfer`` entry point."""

    protocol_name = "sharded-disk"
    bad_settings = [{"keep_versions": 0}]
