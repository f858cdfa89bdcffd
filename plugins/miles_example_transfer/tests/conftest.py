"""The protocol contract's fixtures: the test kit's pytest plugin is opt-in, so a protocol package enables it here."""

pytest_plugins = ["miles_core.testkit.protocol_contract"]
