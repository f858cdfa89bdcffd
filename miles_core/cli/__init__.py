"""The ``miles`` command line."""
