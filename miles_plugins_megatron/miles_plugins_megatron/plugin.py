"""The Miles plugin module of miles-plugins-megatron, registered through the entry-point group ``miles.plugins``.

It will provide the training backend ``megatron``, the Megatron HfWeightIterator and model implementations
(issue 5). In this version it registers no implementations yet: ``miles plugins`` lists it with nothing provided.
This module is imported by every ``miles`` command, so it imports nothing heavy at the top.
"""
