"""The Miles plugin module of miles-plugins-sglang, registered through the entry-point group ``miles.plugins``.

It will provide the engine backend ``sglang``, the router worker and the SGLang weight-update paths (issue 6).
In this version it registers no implementations yet: ``miles plugins`` lists it with nothing provided.
This module is imported by every ``miles`` command, so it imports nothing heavy at the top.
"""
