"""Routed experts, the data of routing replay ("R3"): which experts a Mixture-of-Experts model routed each token to,
as an engine reports it and a trainer replays it.

Layout: one row per token, one row per decoder layer in each (``num_hidden_layers`` of them, as SGLang counts them;
a dense layer's row holds zeros and is never replayed), ``top_k`` expert ids in each, in the router's order (best
first). For a request of ``P`` prompt and ``R`` generated tokens there are ``P + R - 1`` rows: every token the model
was run on, that is all but the last generated one (SGLang's ``seqlen - 1``).

On the wire (SGLang's ``meta_info.routed_experts``, asked for with ``return_routed_experts: true``) the rows are one
base64 string of little-endian int32 values, ``[tokens, layers, top_k]`` in C order; the reader needs the model's
layers and ``top_k`` to reshape them (:class:`RoutingShape`). Samples and training batches carry them as nested
int lists ``[tokens][layers][top_k]`` (JSON through the worker RPC).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy

if TYPE_CHECKING:
    import torch

RoutedExperts = list[list[list[int]]]
"""``[tokens][layers][top_k]`` expert ids."""

NOT_ROUTED = -1
"""A token or layer without recorded routing in a batch's tensor: the trainer routes it normally."""


class RoutedExpertsError(ValueError):
    """Routed experts that do not fit the model or the sample: the message names what and how to fix it."""


@dataclasses.dataclass(frozen=True)
class RoutingShape:
    """What routed experts of one model look like: ``num_layers`` rows of ``top_k`` ids below ``num_experts``."""

    num_layers: int
    top_k: int
    num_experts: int

    @classmethod
    def of_config(cls, config: Mapping[str, Any] | Any) -> RoutingShape | None:
        """The shape of an HF config (a ``config.json`` mapping or a config object) with ``num_experts`` (which
        transformers 5 writes as ``num_local_experts``; DeepSeek-V3's ``n_routed_experts``) and
        ``num_experts_per_tok``; ``None`` for a model without routed experts."""
        get = config.get if isinstance(config, Mapping) else lambda key: getattr(config, key, None)
        names = ("num_experts", "num_local_experts", "n_routed_experts")
        experts = next((get(name) for name in names if get(name) is not None), None)
        values = [get("num_hidden_layers"), get("num_experts_per_tok"), experts]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            return None
        return cls(num_layers=values[0], top_k=values[1], num_experts=values[2])

    def describe(self) -> str:
        return f"{self.num_layers} layers x top-{self.top_k} of {self.num_experts} experts"


def encode_routed_experts(rows: numpy.ndarray | Sequence[Any]) -> str:
    """``[tokens, layers, top_k]`` ids as SGLang sends them: base64 of little-endian int32, C order."""
    return base64.b64encode(numpy.ascontiguousarray(rows, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(text: Any, *, shape: RoutingShape, num_tokens: int) -> RoutedExperts:
    """SGLang's ``routed_experts`` string as ``[num_tokens][layers][top_k]`` lists, every id checked to be an
    expert of the model; anything else is a :class:`RoutedExpertsError` saying what it holds."""
    if not isinstance(text, str):
        raise RoutedExpertsError(f"expected a base64 string, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RoutedExpertsError("not valid base64") from None
    per_token = shape.num_layers * shape.top_k
    if len(raw) != 4 * per_token * num_tokens:
        raise RoutedExpertsError(
            f"{len(raw)} bytes, expected {4 * per_token * num_tokens}: {num_tokens} tokens x {shape.describe()} as "
            "int32 (is the engine serving the same model, and were the prompt's tokens included?)"
        )
    ids = numpy.frombuffer(raw, dtype="<i4").reshape(num_tokens, shape.num_layers, shape.top_k)
    _check_range(ids, shape)
    return ids.tolist()


def check_routed_experts(value: Any, *, num_tokens: int, shape: RoutingShape | None = None) -> RoutedExperts:
    """Nested lists ``[num_tokens][layers][top_k]`` of non-negative ints, every token with the same layers and
    ``top_k`` (those of ``shape`` and ids below its ``num_experts`` when given); returns them as plain lists."""
    if not isinstance(value, list | tuple):
        raise RoutedExpertsError(f"expected a list of {num_tokens} tokens' [layers][top_k] ids, got {_kind(value)}")
    if len(value) != num_tokens:
        raise RoutedExpertsError(
            f"{len(value)} tokens' routing, expected {num_tokens} (one per token the model ran on: the prompt and "
            "every response token but the last)"
        )
    if not value:
        return []
    try:
        ids = numpy.asarray(value, dtype=object)
    except ValueError:  # ragged nesting numpy cannot even hold as objects
        raise RoutedExpertsError("ragged lists: every token needs the same layers, each the same top_k ids") from None
    if ids.ndim != 3 or any(not _is_int(v) for v in ids.flat):
        raise RoutedExpertsError(
            "expected [tokens][layers][top_k] integers, every token with the same layers and top_k; got "
            f"{ids.ndim} levels of nesting{'' if ids.ndim != 3 else ' with a non-integer id'}"
        )
    ids = ids.astype(numpy.int64)
    if shape is not None and ids.shape[1:] != (shape.num_layers, shape.top_k):
        raise RoutedExpertsError(
            f"each token holds [{ids.shape[1]}][{ids.shape[2]}] ids, the model {shape.describe()} needs "
            f"[{shape.num_layers}][{shape.top_k}]"
        )
    _check_range(ids, shape)
    return ids.tolist()


def _check_range(ids: numpy.ndarray, shape: RoutingShape | None) -> None:
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (shape is not None and high >= shape.num_experts):
        bad = low if low < 0 else high
        limit = f"0 to {shape.num_experts - 1}" if shape is not None else "non-negative"
        raise RoutedExpertsError(f"expert id {bad} is out of range: ids are {limit}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int | numpy.integer) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    return type(value).__name__


def check_replayable(experts: torch.Tensor, *, last_layer: int, top_k: int, num_experts: int) -> None:
    """A :class:`RoutedExpertsError` unless ``experts`` (``[batch, tokens, layers, top_k]``) fits a model whose last
    MoE layer is ``last_layer`` and whose routers pick ``top_k`` of ``num_experts`` (ids, or :data:`NOT_ROUTED`)."""
    if experts.dim() != 4 or experts.shape[3] != top_k or experts.shape[2] <= last_layer:
        raise RoutedExpertsError(
            f"routed experts of shape {list(experts.shape)}: the model needs [batch, tokens, layers >= "
            f"{last_layer + 1}, {top_k}]"
        )
    bad = experts[(experts < NOT_ROUTED) | (experts >= num_experts)]
    if bad.numel():
        raise RoutedExpertsError(
            f"expert id {int(bad[0])} is out of range: this model's experts are 0 to {num_experts - 1} (were the "
            "routed experts recorded on another model?)"
        )
