"""The order in which a run draws its prompts: consecutive slices of a seeded permutation per epoch.

The order is a function of the number of prompts, the run's seed and the rollout id alone, so a resumed run, or a
peer given the same prompts, sees the same data in the same order. An epoch's permutation is computed once (a compact
integer array, not a list of Python objects) and kept while the run draws from it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy

from miles_core.rollout.prompts import Prompt

EPOCHS_KEPT = 2
"""fully_async may draw the last steps of an epoch and the first of the next at once."""


class PromptOrder:
    """Which prompt indices each rollout draws from ``size`` prompts, ``batch_size`` at a time."""

    def __init__(self, size: int, *, seed: int, batch_size: int) -> None:
        self.size, self.seed, self.batch_size = size, seed, batch_size
        self._epochs: dict[int, numpy.ndarray] = {}

    def indices(self, rollout_id: int) -> list[int]:
        """Rollout ``rollout_id``'s ``batch_size`` prompt indices (fewer prompts than a batch: they wrap around)."""
        if self.size < 1:
            raise ValueError("no prompts to draw from")
        per_epoch = max(1, self.size // self.batch_size)
        epoch, slot = divmod(rollout_id, per_epoch)
        order = self.epoch(epoch)
        chosen = order[slot * self.batch_size : (slot + 1) * self.batch_size].tolist()
        while len(chosen) < self.batch_size:
            chosen.append(int(order[len(chosen) % self.size]))
        return chosen

    def epoch(self, epoch: int) -> numpy.ndarray:
        """The epoch's permutation of the prompt indices, seeded by ``(seed, epoch)``."""
        order = self._epochs.get(epoch)
        if order is None:
            dtype = numpy.int32 if self.size < 2**31 else numpy.int64
            order = numpy.random.default_rng([self.seed, epoch]).permutation(self.size).astype(dtype)
            if len(self._epochs) >= EPOCHS_KEPT:
                del self._epochs[min(self._epochs)]
            self._epochs[epoch] = order
        return order


def step_prompts(prompts: Sequence[Prompt], rollout_id: int, *, seed: int, batch_size: int) -> list[Prompt]:
    """Rollout ``rollout_id``'s ``batch_size`` prompts (:class:`PromptOrder`; a one-off call: nothing is kept)."""
    order = PromptOrder(len(prompts), seed=seed, batch_size=batch_size)
    return [prompts[i] for i in order.indices(rollout_id)]
