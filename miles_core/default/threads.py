"""How many torch CPU threads the trainer and each local engine of a run use when the config leaves it open."""

from __future__ import annotations

from typing import Any

EMBEDDED_MODEL_THREADS = 1
"""The embedded default model's: its tensors (``[128, 15, 64]`` in a step) are too small for torch to gain from
splitting an op across cores, and the trainer and the engine are two processes: with a thread per core each, they
fight over the cores whenever both run (an overlapping schedule, a health check, another program), and a thread
that waits for a descheduled sibling at every op makes a step several times slower on a busy machine."""


def torch_threads(setting: int | None, config: Any) -> int | None:
    """``setting`` (``train.cpu_threads`` or ``engine.cpu_threads``) when given; else
    :data:`EMBEDDED_MODEL_THREADS` for a run of the embedded default model (no ``--model``); else ``None``: torch's
    default, one thread per core."""
    if setting is not None:
        return setting
    return EMBEDDED_MODEL_THREADS if config.model.path is None else None
