"""The choice of running batch for a model (continuous batching where its KV cache allows, else recomputing), and
a batch of requests generated to completion with it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from miles_core.builtin.local_engine.recomputing_batch import RecomputingBatch
from miles_core.builtin.local_engine.running_batch import RunningBatch, result_of
from miles_core.builtin.local_engine.sampling import GenerationRequest, GenerationResult, Sampler


def new_running_batch(model: torch.nn.Module, *, pad_token_id: int = 0) -> RunningBatch:
    """The running batch that serves ``model``: continuous batching over a merged KV cache when the model's cache is
    full attention (:class:`~transformers.cache_utils.DynamicLayer` in every layer), else a
    :class:`~.recomputing_batch.RecomputingBatch` (sliding windows, DeepSeek-V4's compressors)."""
    config = getattr(model, "config", None)
    layers = DynamicCache(config=config).layers if config is not None else []
    full_attention = all(type(layer) is DynamicLayer for layer in layers)
    return (RunningBatch if full_attention else RecomputingBatch)(model, pad_token_id=pad_token_id)


class FixedRow:
    """A row of :func:`generate_batch`: a request and its sampler."""

    def __init__(self, request: GenerationRequest, sampler: Sampler) -> None:
        self.request, self.sampler = request, sampler


def generate_batch(
    model: torch.nn.Module,
    requests: Sequence[GenerationRequest],
    *,
    eos_token_ids: set[int] | frozenset[int] = frozenset(),
    pad_token_id: int = 0,
    default_seed: int = 0,
    should_abort: Callable[[], str | None] = lambda: None,
    decode: Callable[[list[int]], str] | None = None,
) -> list[GenerationResult]:
    """Sample every request to completion in one batch (prefilled together, then stepped; finished rows leave).

    ``should_abort`` is asked before every step; a message ends the unfinished requests with an ``abort`` reason.
    A request whose ``cancel`` is set ends the same way, alone. ``decode`` (token ids to text) is what stop strings
    are looked for in; without it a request may not have any.
    """
    if decode is None and any(r.params.stop for r in requests):
        raise ValueError("stop strings need a tokenizer to decode the output: pass decode")
    rows = [FixedRow(r, Sampler(r, set(eos_token_ids), default_seed + i, decode)) for i, r in enumerate(requests)]
    batch = new_running_batch(model, pad_token_id=pad_token_id)
    waiting = [row for row in rows if row.sampler.finish_reason is None]
    while waiting or batch.rows:
        message = should_abort()
        for row in [*waiting, *batch.rows]:
            if message is not None:
                row.sampler.finish_reason = {"type": "abort", "message": message}
            elif row.request.cancel.is_set():  # its client went away: stop sampling it
                row.sampler.finish_reason = {"type": "abort", "message": "cancelled: the client went away"}
        waiting = [row for row in waiting if row.sampler.finish_reason is None]
        batch.finished()
        if waiting:
            batch.prefill(waiting)
            waiting = []
        else:
            batch.step()
        batch.finished()
    return [result_of(row.sampler) for row in rows]
