"""Example third-party weight-transfer protocol for Miles, registered through the ``miles.weight_transfer`` group."""
