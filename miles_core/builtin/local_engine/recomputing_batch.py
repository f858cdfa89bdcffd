"""A running batch for models whose KV cache cannot be padded and merged between rows: every step recomputes each
row's whole sequence, unpadded, without a cache.

Continuous batching (:class:`~.running_batch.RunningBatch`) left-pads rows and concatenates their
caches, which needs a full-attention cache whose columns are positions. A model whose cache holds other state, such
as DeepSeek-V4's sliding windows and compressors (entries summarising windows of ``compress_rate`` tokens counted
from the sequence's start, which left padding would shift), cannot be served that way; recomputing is exact for any
model, at the cost of a forward over the whole sequence per token (fine for the small models a CPU engine serves).

Rows whose sequences have the same length need no padding to share a forward, so each step runs one forward per
length (in an RL rollout a group's samples share a prompt and grow together: a handful of forwards per step, not
one per row).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles_core.builtin.local_engine.running_batch import Row, RunningBatch


class RecomputingBatch(RunningBatch):
    """Rows that join and leave between steps as in :class:`RunningBatch`, each sampled from a cacheless forward of
    its prompt plus the tokens it has so far; rows of one length share that forward."""

    @torch.inference_mode()
    def prefill(self, rows: Sequence[Row]) -> None:
        tokens = self._next_tokens(rows, record_from=0)
        self.rows.extend(rows)
        self.next_ids = torch.cat([self.next_ids, torch.tensor(tokens, dtype=torch.long, device=self.device)])

    @torch.inference_mode()
    def step(self) -> None:
        if not self.rows:
            return
        tokens = self._next_tokens(self.rows, record_from=-1)
        self.next_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)

    def _next_tokens(self, rows: Sequence[Row], *, record_from: int) -> list[int]:
        """Sample each row's next token (in ``rows``' order), one forward per sequence length; with routing asked
        for, record the experts of each row's positions from ``record_from`` (0: all of them, -1: the last one)."""
        sequences = [row.request.input_ids + row.sampler.output_ids for row in rows]
        by_length: dict[int, list[int]] = {}
        for index, ids in enumerate(sequences):
            by_length.setdefault(len(ids), []).append(index)
        tokens: list[int] = [0] * len(rows)
        for length, indices in by_length.items():
            group = [rows[index] for index in indices]
            input_ids = torch.tensor([sequences[index] for index in indices], dtype=torch.long, device=self.device)
            out = self.model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
            if self._wants_routing(group):
                experts = self.routing.experts(len(group), length)
                start = 0 if record_from == 0 else length - 1
                for position, row in enumerate(group):
                    row.sampler.record_routing(experts[position, start:], start=start)
            for index, token in zip(indices, self._sample(group, out.logits[:, -1]), strict=True):
                tokens[index] = token
        return tokens

    def remove(self, rows: Sequence[Row]) -> list[Row]:
        gone = {id(row) for row in rows}
        keep = [index for index, row in enumerate(self.rows) if id(row) not in gone]
        removed = [row for row in self.rows if id(row) in gone]
        self.rows = [self.rows[index] for index in keep]
        self.next_ids = self.next_ids[torch.tensor(keep, dtype=torch.long, device=self.device)]
        return removed
