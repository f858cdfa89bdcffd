"""The weight-transfer protocol contract, run against this package's protocol as installed (CI runs it from a copy of
this folder outside the checkout, against the package's wheel: ``.ci/wheels``)."""

from __future__ import annotations

from miles_core import ProtocolContract


class TestShardedDisk(ProtocolContract):
    """``sharded-disk``, found through the ``miles.weight_transfer`` entry point of the installed distribution."""

    protocol_name = "sharded-disk"
    bad_settings = [{"keep_versions": 0}]
