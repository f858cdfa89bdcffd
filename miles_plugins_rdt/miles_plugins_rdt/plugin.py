"""The Miles plugin module of miles-plugins-rdt, registered through the entry-point group ``miles.plugins``.

It will provide the weight-transfer protocol ``rdt`` (issue 7). In this version it registers no implementations
yet: ``miles plugins`` lists it with nothing provided, and selecting ``rdt`` is an error that says so.
This module is imported by every ``miles`` command, so it imports nothing heavy at the top.
"""
