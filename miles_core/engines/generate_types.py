"""SGLang's ``/generate`` as types: :class:`SamplingParams`, what a rollout asks for, and :class:`GenerateOutput`,
one checked answer. The JSON keys of SGLang's native API live here and in :mod:`miles_core.engines.client`, so
that the rollout reads fields, and a malformed answer is an :class:`~miles_core.errors.EngineError` naming the
engine rather than a ``KeyError`` deep in the executor.

(The local engine's server validates incoming requests with its own pydantic model,
:class:`miles_core.builtin.local_engine.sampling.SamplingParams`; this one is the client's, light and dependency-free.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from miles_core.engines.routed_experts import RoutedExperts, RoutedExpertsError, RoutingShape, decode_routed_experts
from miles_core.errors import EngineError

INITIAL_WEIGHT_VERSION = "default"
"""What SGLang (and the local engine) report before any weights were published: no Miles version yet."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """The sampling settings of one request, as the rollout sends them (SGLang's ``sampling_params``).

    ``top_k`` -1 and ``top_p`` 1.0 turn those filters off; ``temperature`` 0 is greedy; ``sampling_seed`` makes
    the sample reproducible (``None``: the engine's own seed)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    sampling_seed: int | None = None

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, low=0)
        _check_int("top_k", self.top_k, low=-1)
        if self.sampling_seed is not None:
            _check_int("sampling_seed", self.sampling_seed, low=0)
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature = {self.temperature!r}: a finite number of at least 0")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p = {self.top_p!r}: a number above 0 and at most 1 (1 keeps all)")

    def to_sglang(self) -> dict[str, Any]:
        """SGLang's ``sampling_params`` object (no ``sampling_seed`` key when it is ``None``)."""
        params = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": self.top_k,
        }
        if self.sampling_seed is not None:
            params["sampling_seed"] = self.sampling_seed
        return params


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """One finished answer of ``/generate``.

    ``logprobs`` are the chosen tokens' logprobs (one per output id; empty when not asked for). ``finish_reason``
    is SGLang's type: ``"stop"``, ``"length"``, ``"abort"``. ``weight_version`` is the Miles version the engine
    served (``None`` before the first publication). ``meta`` is the raw ``meta_info``, for callers that need more
    (top logprobs, token counts). ``routed_experts``: when asked for (``return_routed_experts``), the experts of
    every token the engine ran, ``[prompt + output - 1][layers][top_k]`` (:mod:`miles_core.engines.routed_experts`);
    ``None`` otherwise, and for an aborted answer that came without them."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int | None
    text: str | None
    meta: dict[str, Any]
    routed_experts: RoutedExperts | None = None

    @property
    def aborted(self) -> bool:
        """Whether the engine ended the request early (paused with ``abort``, a weight update, a disconnect):
        its output is partial and the request should be sent again."""
        return self.finish_reason == "abort"

    @classmethod
    def from_sglang(
        cls,
        body: Any,
        *,
        engine: str,
        with_logprobs: bool = False,
        routing: RoutingShape | None = None,
        prompt_tokens: int = 0,
    ) -> GenerateOutput:
        """Check and read one answer; ``with_logprobs``: it was asked for with ``return_logprob`` (so it must
        carry one logprob per output id; an aborted answer may carry none); ``routing``: it was asked for with
        ``return_routed_experts`` of a model of this shape, for a prompt of ``prompt_tokens`` tokens (so it must
        carry their routing and that of every output id but the last; an aborted answer may carry none). Anything
        malformed is an :class:`EngineError` naming ``engine``."""

        def bad(what: str) -> EngineError:
            return EngineError(f"engine {engine} sent a malformed /generate answer: {what}")

        if not isinstance(body, Mapping):
            raise bad(f"expected a JSON object, got {_excerpt(body)}")
        output_ids, meta, text = body.get("output_ids"), body.get("meta_info"), body.get("text")
        if not isinstance(output_ids, list) or not all(_is_int(t) for t in output_ids):
            raise bad(f"output_ids = {_excerpt(output_ids)}, expected a list of token ids")
        if not isinstance(meta, Mapping):
            raise bad(f"meta_info = {_excerpt(meta)}, expected an object")
        if text is not None and not isinstance(text, str):
            raise bad(f"text = {_excerpt(text)}, expected a string")
        reason = meta.get("finish_reason")
        if not isinstance(reason, Mapping) or not isinstance(reason.get("type"), str):
            raise bad(f"meta_info.finish_reason = {_excerpt(reason)}, expected an object with a string 'type'")
        # An aborted request's answer may lack the logprobs and the version (SGLang answers a request aborted while
        # queued from its tokenizer process): it is partial anyway and is sent again, so only what it has is checked.
        aborted = reason["type"] == "abort"
        if not with_logprobs or (aborted and "output_token_logprobs" not in meta):
            logprobs: list[float] = []
        else:
            logprobs = _logprobs(meta, output_ids, bad)
        version = meta.get("weight_version", INITIAL_WEIGHT_VERSION if aborted else _MISSING)
        routed = None
        if routing is not None and not (aborted and "routed_experts" not in meta):
            tokens = max(prompt_tokens + len(output_ids) - 1, 0)
            try:
                routed = decode_routed_experts(meta.get("routed_experts"), shape=routing, num_tokens=tokens)
            except RoutedExpertsError as exc:
                raise bad(f"meta_info.routed_experts: {exc} (was return_routed_experts honoured?)") from None
        return cls(
            output_ids=list(output_ids),
            logprobs=logprobs,
            finish_reason=reason["type"],
            weight_version=parse_weight_version(version, engine=engine),
            text=text,
            meta=dict(meta),
            routed_experts=routed,
        )


_MISSING = object()


def parse_weight_version(value: Any, *, engine: str) -> int | None:
    """SGLang's ``weight_version`` string as Miles's version: ``"default"`` (nothing published yet) is ``None``,
    ``"3"`` is 3 (Miles publishes ``str(int)``); anything else is an :class:`EngineError`, since a sample whose
    version is unknown cannot be told stale from fresh."""
    if value == INITIAL_WEIGHT_VERSION:
        return None
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 19:  # an int64
        return int(value)
    shown = "missing" if value is _MISSING else _excerpt(value)
    raise EngineError(
        f"engine {engine} reported weight_version {shown}: expected {INITIAL_WEIGHT_VERSION!r} or a version Miles "
        "published (a non-negative integer as a string); was the engine's version set by something else?"
    )


def _logprobs(meta: Mapping[str, Any], output_ids: list[int], bad: Any) -> list[float]:
    """The chosen tokens' logprobs from ``output_token_logprobs`` (``[logprob, token_id, text]`` per token), each
    checked to belong to its output id: misaligned logprobs would train silently on the wrong tokens."""
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list) or len(entries) != len(output_ids):
        raise bad(
            f"meta_info.output_token_logprobs = {_excerpt(entries)}, expected a list of {len(output_ids)} "
            "[logprob, token_id, text] entries, one per output id (was return_logprob honoured?)"
        )
    if entries and set(map(type, entries)) == {list} and min(map(len, entries)) >= 2:  # the well-formed answer, fast
        values = [entry[0] for entry in entries]
        if (
            [entry[1] for entry in entries] == output_ids
            and set(map(type, values)) <= {float, int}
            and all(map(math.isfinite, values))
        ):
            return [float(value) for value in values]
    logprobs = []  # something is wrong: find the first bad entry, to name it
    for position, (entry, token) in enumerate(zip(entries, output_ids, strict=True)):
        if not isinstance(entry, list) or len(entry) < 2 or entry[1] != token or not _is_finite(entry[0]):
            raise bad(
                f"meta_info.output_token_logprobs[{position}] = {_excerpt(entry)}, expected [a finite logprob, "
                f"{token}, text] for output id {token}"
            )
        logprobs.append(float(entry[0]))
    return logprobs


def _check_int(name: str, value: Any, *, low: int) -> None:
    if not _is_int(value) or value < low:
        raise ValueError(f"SamplingParams.{name} = {value!r}: an integer of at least {low}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _excerpt(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 6] + "... (cut)"
