"""How many torch CPU threads the trainer and each local engine of a run use when the config leaves it open."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles_core.config.build import MilesConfig

EMBEDDED_MODEL_THREADS = 1
"""One thread for a process of the embedded default model that shares the cores: its tensors (``[128, 15, 64]`` in
a step) are too small for torch to gain from splitting an op across cores, while two processes with a thread per
core each fight over them whenever both run, and a thread that waits for a descheduled sibling at every op makes a
step several times slower on a busy machine."""

OVERLAPPING_SCHEDULES = ("one_step_off", "fully_async")
"""The schedules whose trainer trains while the engines generate."""


def engine_threads(config: MilesConfig) -> int | None:
    """``engine.cpu_threads`` when given; else :data:`EMBEDDED_MODEL_THREADS` for a run of the embedded default
    model (no ``--model``), which generates as fast with one; else ``None``: torch's default, one per core."""
    if config.engine.cpu_threads is not None:
        return config.engine.cpu_threads
    return EMBEDDED_MODEL_THREADS if config.model.path is None else None


def trainer_threads(config: MilesConfig) -> int | None:
    """``train.cpu_threads`` when given; else, for the embedded default model under an overlapping schedule,
    :data:`EMBEDDED_MODEL_THREADS` (the trainer and the engine then run at once, a core each on a small machine);
    else ``None``: torch's default. Under ``sync`` the trainer runs alone and keeps every core: its thread count
    also sets the order of the gradients' float sums, and so the run's exact trajectory."""
    if config.train.cpu_threads is not None:
        return config.train.cpu_threads
    overlapping = config.run.schedule in OVERLAPPING_SCHEDULES
    return EMBEDDED_MODEL_THREADS if config.model.path is None and overlapping else None


def omp_wait_policy() -> dict[str, str]:
    """The OpenMP wait policy of Miles' processes: ``PASSIVE`` unless the environment sets ``OMP_WAIT_POLICY``.
    torch's OpenMP threads otherwise spin after every parallel op, waiting for work; on a machine whose cores other
    processes use too (the trainer and an engine, another program) a spinning thread holds the core that the thread
    it waits for needs. On the loaded 2-core machine a default ``train_step`` with two threads took 3014 ms spinning
    and 88 ms passive (medians of 25; one thread: 143 ms). The thread count, and so every float sum, is unchanged."""
    return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
