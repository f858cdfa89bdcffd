"""The rdt protocol passes the core's protocol contract, over NIXL and over gloo, into engines hosted by Ray."""

from __future__ import annotations

import pytest

from miles_core.testkit.protocol_contract import ContractEngines, ProtocolContract

pytestmark = pytest.mark.slow


@pytest.fixture
def contract_engines(ray_engines: ContractEngines) -> ContractEngines:
    """The contract's engines, started by the Ray provider instead of as local processes."""
    return ray_engines


class TestRdtNixl(ProtocolContract):
    protocol_name = "rdt"
    protocol_settings = {"transport": "nixl", "staging_bucket_mb": 1, "timeout_s": 60.0}


class TestRdtGloo(ProtocolContract):
    protocol_name = "rdt"
    protocol_settings = {"transport": "gloo", "staging_bucket_mb": 1, "timeout_s": 60.0}
