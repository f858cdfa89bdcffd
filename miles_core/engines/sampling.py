"""Batched sampling with a KV cache, on CPU or GPU, from any transformers causal LM.

Token in, token out: requests carry prompt token ids and get back output token ids with their logprobs. The
logprob of a token is taken from the distribution it was sampled from before top-k / top-p truncation, that is
``log_softmax(logits / temperature)`` (raw logits when greedy), which is what the trainer recomputes.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Annotated

import pydantic
import torch

MIN_TEMPERATURE = 1e-6
"""Temperatures below this are greedy, as in SGLang: dividing logits by less overflows float32 (NaN logprobs)."""

MAX_SEED = 2**63 - 1  # what torch.Generator.manual_seed takes
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20
"""The most alternatives a request may ask for at each position (OpenAI's own limit)."""

TokenCallback = Callable[[int, float, list[tuple[float, int]] | None], None]
"""Told each token (id, logprob, its top alternatives if asked for) as soon as it is sampled, on the sampling
thread: it must only hand them on (to an event loop, a queue)."""


class SamplingParams(pydantic.BaseModel):
    """The subset of SGLang's ``sampling_params`` the local engine implements; other keys are rejected, and every
    number must be finite and within range (a bad value is refused at admission, never inside a batch)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=True)

    max_new_tokens: int = pydantic.Field(default=128, ge=0)
    temperature: float = pydantic.Field(default=1.0, ge=0.0, le=1e4)
    top_p: float = pydantic.Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = pydantic.Field(default=-1, ge=-1)
    stop_token_ids: list[int] = pydantic.Field(default_factory=list, max_length=1024)
    ignore_eos: bool = False
    sampling_seed: int | None = pydantic.Field(default=None, ge=0, le=MAX_SEED)
    n: int = pydantic.Field(default=1, ge=1, le=1)  # one sample per request; send a group as separate requests
    stop: list[Annotated[str, pydantic.Field(min_length=1, max_length=MAX_STOP_CHARS)]] = pydantic.Field(
        default_factory=list, max_length=MAX_STOP_STRINGS
    )
    """Stop strings: the request ends once its decoded output holds one (the engine needs a tokenizer)."""

    @pydantic.field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: object) -> object:
        """SGLang takes a single stop string as well as a list of them."""
        return [value] if isinstance(value, str) else value

    @pydantic.field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _int_is_a_float(cls, value: object) -> object:
        """Strict mode refuses strings and booleans; an integer such as ``1`` is still a valid float."""
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @property
    def greedy(self) -> bool:
        """Whether tokens are the argmax (temperature 0, or below :data:`MIN_TEMPERATURE`)."""
        return self.temperature < MIN_TEMPERATURE


@dataclasses.dataclass
class GenerationRequest:
    """Prompt token ids and sampling parameters; ``cancel`` set (by any thread) ends it with an abort reason at
    the next step, e.g. when its client went away."""

    input_ids: list[int]
    params: SamplingParams
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    top_logprobs_num: int = 0  # the most likely tokens to report at each position, with their logprobs
    on_token: TokenCallback | None = None  # streaming: told each token as it is sampled


@dataclasses.dataclass
class GenerationResult:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict  # {"type": "length", "length": N}, {"type": "stop", "matched": token_id or stop string}
    top_logprobs: list[list[tuple[float, int]]] = dataclasses.field(default_factory=list)
    """Per output token, when asked for: the ``top_logprobs_num`` most likely ``(logprob, token)``, best first,
    from the same distribution as ``logprobs``."""


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside top-k and the top-p nucleus with -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


class _Sampler:
    """Per-request state: generator, stop set, outputs."""

    def __init__(
        self,
        request: GenerationRequest,
        eos_token_ids: set[int],
        default_seed: int,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.params = request.params
        self.top_logprobs_num = request.top_logprobs_num
        self.on_token = request.on_token
        self.decode = decode
        self.top_logprobs: list[list[tuple[float, int]]] = []
        seed = self.params.sampling_seed if self.params.sampling_seed is not None else default_seed
        self.generator = torch.Generator().manual_seed(seed)
        self.stop_ids = set(self.params.stop_token_ids) | (set() if self.params.ignore_eos else eos_token_ids)
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: dict | None = None if self.params.max_new_tokens > 0 else {"type": "length", "length": 0}

    def record(self, token: int, logprob: float) -> None:
        """Append the chosen token; note whether the request ended."""
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        if self.on_token is not None:
            self.on_token(token, logprob, self.top_logprobs[-1] if self.top_logprobs_num > 0 else None)
        if token in self.stop_ids:
            self.finish_reason = {"type": "stop", "matched": token}
        elif (matched := self._stop_string()) is not None:
            self.finish_reason = {"type": "stop", "matched": matched}
        elif len(self.output_ids) >= self.params.max_new_tokens:
            self.finish_reason = {"type": "length", "length": len(self.output_ids)}

    def _stop_string(self) -> str | None:
        """The stop string that the decoded output now holds first, if any (decoded whole: a token's text may
        depend on the tokens before it)."""
        if not self.params.stop or self.decode is None:
            return None
        text = self.decode(self.output_ids)
        found = [(text.find(stop), stop) for stop in self.params.stop if stop in text]
        return min(found)[1] if found else None


def _choose(samplers: list[_Sampler], rows: list[int], logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Sample one token for each active row at once, by inverse CDF with one uniform number per row drawn from the
    request's own generator: a request's tokens depend on its seed alone, whatever it is batched with."""
    logits = logits[rows].float()
    temperatures = torch.tensor([samplers[r].params.temperature for r in rows])
    greedy = torch.tensor([samplers[r].params.greedy for r in rows], dtype=torch.bool)
    scaled = logits / torch.where(greedy, torch.ones_like(temperatures), temperatures).unsqueeze(-1)
    logprobs = torch.log_softmax(scaled, dim=-1)
    probs = logprobs.exp()
    for i, row in enumerate(rows):
        params = samplers[row].params
        if params.top_k > 0 or params.top_p < 1.0:
            probs[i] = torch.softmax(_filter(scaled[i], params.top_k, params.top_p), dim=-1)
    uniform = torch.cat([torch.rand(1, generator=samplers[r].generator) for r in rows])
    cdf = probs.cumsum(-1)
    sampled = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(-1)).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    for i, row in enumerate(rows):  # the alternatives come from the distribution the reported logprob is from
        if samplers[row].top_logprobs_num > 0:
            top = torch.topk(logprobs[i], min(samplers[row].top_logprobs_num, logprobs.shape[-1]))
            samplers[row].top_logprobs.append(list(zip(top.values.tolist(), top.indices.tolist(), strict=True)))
    return tokens.tolist(), chosen.tolist()


@torch.inference_mode()
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
    """Sample every request to completion in one left-padded batch that shares a KV cache.

    ``should_abort`` is asked before every step; a message ends the unfinished requests with an ``abort`` reason.
    A request whose ``cancel`` is set ends the same way, alone; the batch ends when no request is left running.
    ``decode`` (token ids to text) is what stop strings are looked for in; without it a request may not have any.
    """
    if not requests:
        return []
    if decode is None and any(r.params.stop for r in requests):
        raise ValueError("stop strings need a tokenizer to decode the output: pass decode")
    samplers = [_Sampler(r, set(eos_token_ids), default_seed + i, decode) for i, r in enumerate(requests)]
    device = next(model.parameters()).device
    width = max(len(r.input_ids) for r in requests)
    input_ids = torch.full((len(requests), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(requests), width), dtype=torch.long)
    for row, request in enumerate(requests):
        input_ids[row, width - len(request.input_ids) :] = torch.tensor(request.input_ids, dtype=torch.long)
        attention_mask[row, width - len(request.input_ids) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cache = None
    max_steps = max(r.params.max_new_tokens for r in requests)
    for _ in range(max_steps):
        if all(s.finish_reason is not None for s in samplers):
            break
        abort_message = should_abort()
        if abort_message is not None:
            for sampler in samplers:
                sampler.finish_reason = sampler.finish_reason or {"type": "abort", "message": abort_message}
            break
        for sampler, request in zip(samplers, requests, strict=True):
            if sampler.finish_reason is None and request.cancel.is_set():  # its client went away: stop sampling it
                sampler.finish_reason = {"type": "abort", "message": "cancelled: the client went away"}
        if all(s.finish_reason is not None for s in samplers):
            break
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = out.cache
        rows = [row for row, s in enumerate(samplers) if s.finish_reason is None]
        chosen, logprobs = _choose(samplers, rows, out.logits[:, -1].cpu())
        tokens = [pad_token_id] * len(samplers)
        for row, token, logprob in zip(rows, chosen, logprobs, strict=True):
            samplers[row].record(token, logprob)
            tokens[row] = token
        input_ids = torch.tensor(tokens, dtype=torch.long, device=device).unsqueeze(1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(requests), 1))], dim=1)
        positions = positions[:, -1:] + 1
    return [
        GenerationResult(
            s.output_ids, s.logprobs, s.finish_reason or {"type": "length", "length": len(s.output_ids)}, s.top_logprobs
        )
        for s in samplers
    ]
