"""A running batch for models whose KV cache cannot be padded and merged between rows: every step recomputes each
row's whole sequence, unpadded, without a cache.

Continuous batching (:class:`~.running_batch.RunningBatch`) left-pads rows and concatenates their
caches, which needs a full-attention cache whose columns are positions. A model whose cache holds other state, such
as DeepSeek-V4's sliding windows and compressors (entries summarising windows of ``compress_rate`` tokens counted
from the sequence's start, which left padding would shift), cannot be served that way; recomputing is exact for any
model, at the cost of a forward over the whole sequence per token (fine for the small models a CPU engine serves).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles_core.builtin.local_engine.running_batch import Row, RunningBatch


class RecomputingBatch(RunningBatch):
    """Rows that join and leave between steps as in :class:`RunningBatch`, each sampled from a cacheless forward of
    its prompt plus the tokens it has so far."""

    @torch.inference_mode()
    def prefill(self, rows: Sequence[Row]) -> None:
        tokens = [self._next_token(row, record_from=0) for row in rows]
        self.rows.extend(rows)
        self.next_ids = torch.cat([self.next_ids, torch.tensor(tokens, dtype=torch.long, device=self.device)])

    @torch.inference_mode()
    def step(self) -> None:
        if not self.rows:
            return
        tokens = [self._next_token(row, record_from=-1) for row in self.rows]
        self.next_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)

    def _next_token(self, row: Row, *, record_from: int) -> int:
        """Sample the row's next token; with routing asked for, record the experts of its positions from
        ``record_from`` (0: all of them, -1: the last one)."""
        ids = row.request.input_ids + row.sampler.output_ids
        out = self.model(input_ids=torch.tensor([ids], dtype=torch.long, device=self.device), use_cache=False)
        if self._wants_routing([row]):
            experts = self.routing.experts(1, len(ids))[0]
            start = 0 if record_from == 0 else len(ids) - 1
            row.sampler.record_routing(experts[start:], start=start)
        (token,) = self._sample([row], out.logits[:, -1])
        return token

    def remove(self, rows: Sequence[Row]) -> list[Row]:
        gone = {id(row) for row in rows}
        keep = [index for index, row in enumerate(self.rows) if id(row) not in gone]
        removed = [row for row in self.rows if id(row) in gone]
        self.rows = [self.rows[index] for index in keep]
        self.next_ids = self.next_ids[torch.tensor(keep, dtype=torch.long, device=self.device)]
        return removed
