"""A running batch of requests that share one KV cache, which requests join and leave between decode steps.

:class:`RunningBatch` is the step API of continuous batching: :meth:`~RunningBatch.prefill` runs new requests'
prompts (together, left-padded), samples each one's next token and merges their KV cache into the batch;
:meth:`~RunningBatch.step` samples one more token for every row; :meth:`~RunningBatch.remove` drops rows (finished,
cancelled, retracted), and leading cache columns that are padding for every row left go with them. A request's
tokens depend on its own seed alone (each :class:`~.sampling.Sampler` has its own generator),
whatever it is batched with and whenever it joins. :func:`~.batch_generation.generate_batch` runs a
fixed batch to completion with it.

A row that leaves keeps its sampler (tokens, logprobs, generator): prefilled again later (its prompt plus the tokens
so far), it continues where it stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer

from miles_core.builtin.local_engine.sampling import GenerationRequest, GenerationResult, Sampler, choose_tokens
from miles_core.engines.routed_experts import RoutingShape
from miles_core.errors import MilesError
from miles_core.models.moe_routing import RoutingCapture, moe_routers


class Row(Protocol):
    """What the batch needs of a request: the request itself and its sampler (its state across steps)."""

    request: GenerationRequest
    sampler: Sampler


class RunningBatch:
    """The rows being decoded together: their KV cache ``[rows, heads, columns, dim]`` per layer, left-padded to a
    common length, the attention mask over those columns, and each row's last sampled token and its position (the
    next step's input)."""

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int = 0) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.rows: list[Row] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self.next_ids = torch.zeros(0, dtype=torch.long, device=self.device)
        self.next_positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self.generated_tokens = 0
        self.routing, self.routing_refusal = _routing_capture(model)
        """The routers' choices of every forward, for the requests that ask for them (an MoE model whose routers
        :mod:`miles_core.models.moe_routing` supports); else ``None`` and why, for such a request's refusal."""

    def __len__(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def prefill(self, rows: Sequence[Row]) -> None:
        """Run ``rows``' prompts plus the tokens they have so far in one left-padded forward, sample each one's next
        token and merge their cache into the batch. On an exception the batch is as before (samplers may have
        recorded a token)."""
        inputs = [row.request.input_ids + row.sampler.output_ids for row in rows]
        width = max(len(ids) for ids in inputs)
        # left-padded as Python lists, then one tensor each: a tensor per row would cost more than the forward
        pad = self.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in inputs], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in inputs], dtype=torch.long)
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            cache=None,
            use_cache=True,
            logits_to_keep=1,
        )
        if self._wants_routing(rows):
            experts = self.routing.experts(len(rows), width)
            for index, (row, ids) in enumerate(zip(rows, inputs, strict=True)):
                row.sampler.record_routing(experts[index, width - len(ids) :], start=0)
        tokens = self._sample(rows, out.logits[:, -1])
        lengths = torch.tensor([len(ids) for ids in inputs], dtype=torch.long, device=self.device)
        self._merge(rows, out.cache, mask, torch.tensor(tokens, dtype=torch.long, device=self.device), lengths)

    @torch.inference_mode()
    def step(self) -> None:
        """Sample one token for every row (rows that finished must have been removed)."""
        if not self.rows:
            return
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=1)
        out = self.model(
            input_ids=self.next_ids.unsqueeze(1),
            attention_mask=self.mask,
            position_ids=self.next_positions.unsqueeze(1),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.cache = out.cache
        if self._wants_routing(self.rows):
            experts = self.routing.experts(len(self.rows), 1)
            for index, row in enumerate(self.rows):  # each row ran its last sampled token
                start = len(row.request.input_ids) + len(row.sampler.output_ids) - 1
                row.sampler.record_routing(experts[index], start=start)
        tokens = self._sample(self.rows, out.logits[:, -1])
        self.next_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        self.next_positions = self.next_positions + 1

    def _wants_routing(self, rows: Sequence[Row]) -> bool:
        """Whether some row asked for its routed experts; one that did on a model without routers is refused at
        admission, so here it is a defect."""
        wanted = any(row.request.return_routed_experts for row in rows)
        if wanted and self.routing is None:
            raise MilesError("return_routed_experts on a model without MoE routers")
        return wanted

    def finished(self) -> list[Row]:
        """The rows whose request ended (a stop token or string, its length), removed from the batch."""
        return self.remove([row for row in self.rows if row.sampler.finish_reason is not None])

    def remove(self, rows: Sequence[Row]) -> list[Row]:
        """Drop ``rows`` (and their cache); trim leading columns that are padding for every row left."""
        gone = {id(row) for row in rows}
        keep = [index for index, row in enumerate(self.rows) if id(row) not in gone]
        if len(keep) == len(self.rows):
            return []
        removed = [row for row in self.rows if id(row) in gone]
        self.rows = [self.rows[index] for index in keep]
        if not self.rows:
            self.clear()
            return removed
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.mask = self.mask.index_select(0, index)
        lead = int(self.mask.any(0).long().argmax())  # the first column some row attends to
        self.mask = self.mask[:, lead:]
        for layer in self._layers(self.cache):
            layer.keys = layer.keys.index_select(0, index)[:, :, lead:]
            layer.values = layer.values.index_select(0, index)[:, :, lead:]
        self.next_ids = self.next_ids.index_select(0, index)
        self.next_positions = self.next_positions.index_select(0, index)
        return removed

    def clear(self) -> list[Row]:
        """Drop every row and the whole cache."""
        removed, self.rows, self.cache = self.rows, [], None
        self.mask = self.mask.new_zeros((0, 0))
        self.next_ids = self.next_ids.new_zeros(0)
        self.next_positions = self.next_positions.new_zeros(0)
        return removed

    def _sample(self, rows: Sequence[Row], logits: torch.Tensor) -> list[int]:
        """Sample and record one token per row. Every row records its token even if one's recording fails (a
        streaming callback, a stop string's decode): the first such error is raised after, every row consistent."""
        samplers = [row.sampler for row in rows]
        tokens, logprobs = choose_tokens(samplers, list(range(len(rows))), logits.cpu())
        self.generated_tokens += len(tokens)
        errors = []
        for sampler, token, logprob in zip(samplers, tokens, logprobs, strict=True):
            try:
                sampler.record(token, logprob)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return tokens

    def _merge(
        self, rows: Sequence[Row], cache: DynamicCache, mask: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor
    ) -> None:
        """Append ``rows`` (their cache, mask, next inputs) to the batch, left-padding the shorter side's columns."""
        layers = self._layers(cache)
        if self.cache is None:
            self.cache, self.mask, self.next_ids, self.next_positions = cache, mask, tokens, lengths
            self.rows = list(rows)
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for old, new in zip(self._layers(self.cache), layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width), _left_pad(new.keys, width)])
            old.values = torch.cat([_left_pad(old.values, width), _left_pad(new.values, width)])
        old_mask, new_mask = F.pad(self.mask, (width - self.mask.shape[1], 0)), F.pad(mask, (width - mask.shape[1], 0))
        self.mask = torch.cat([old_mask, new_mask])
        self.next_ids = torch.cat([self.next_ids, tokens])
        self.next_positions = torch.cat([self.next_positions, lengths])
        self.rows.extend(rows)

    @staticmethod
    def _layers(cache: DynamicCache) -> list[DynamicLayer]:
        for layer in cache.layers:
            if type(layer) is not DynamicLayer:  # a sliding window or an indexer keeps columns we cannot pad
                raise MilesError(
                    f"continuous batching needs a full-attention KV cache (DynamicLayer); this model's cache has "
                    f"{type(layer).__name__}"
                )
        return list(cache.layers)


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, heads, columns, dim]`` with zero columns added in front up to ``width`` (masked out)."""
    return F.pad(tensor, (0, 0, width - tensor.shape[2], 0))


def result_of(sampler: Sampler, finish_reason: dict | None = None) -> GenerationResult:
    """What a request's sampler holds, as its result (``finish_reason`` overriding the sampler's own)."""
    reason = finish_reason or sampler.finish_reason or {"type": "length", "length": len(sampler.output_ids)}
    return GenerationResult(
        list(sampler.output_ids),
        list(sampler.logprobs),
        reason,
        list(sampler.top_logprobs),
        list(sampler.version_events),
        torch.cat(sampler.routed_experts) if sampler.routed_experts else None,
    )


def _routing_capture(model: torch.nn.Module) -> tuple[RoutingCapture | None, str]:
    """A capture of ``model``'s routing, or ``None`` with the reason: a dense model, or routers of a kind that
    cannot be captured (the model serves all the same; only requests for its routed experts are refused)."""
    shape = RoutingShape.of_config(getattr(model, "config", None))
    model_type = getattr(getattr(model, "config", None), "model_type", "?")
    try:
        routers = moe_routers(model) if shape is not None else {}
    except MilesError as exc:
        return None, str(exc).split(": turn ")[0]
    if not routers:
        return None, f"this model ({model_type}) has no Mixture-of-Experts routers to report"
    return RoutingCapture(model, shape), ""
