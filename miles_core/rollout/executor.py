"""``RolloutExecutor``: the data side of a step. ``get(rollout_id)`` picks the step's prompts (the same ones for
the same id, so a resumed run sees the same data), generates ``group_size`` samples per prompt across the engines
(or through a router), scores them, computes group statistics and returns the training batch.

A request that fails because its engine died is sent again to a running engine once the controller has one, so
no sample of the step is lost. A reward function sees the response decoded without special tokens
(:func:`decode_response`) and must return a finite number (:func:`checked_reward`); one that raises or returns
anything else stops the run with an error naming the sample and the function: a silently wrong reward would be
worse than a stopped run.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import decimal
import math
import numbers
import random
import statistics
from collections.abc import Callable
from typing import Any

import numpy
import torch

from miles_core.engines.client import EngineClient
from miles_core.engines.generate_types import GenerateOutput, SamplingParams
from miles_core.errors import MilesError
from miles_core.rollout.prompts import Prompt
from miles_core.training.batch import TrainBatch, TrainSample
from miles_core.training.losses import grpo_advantages

MAX_ATTEMPTS = 5


@dataclasses.dataclass
class Sample:
    index: int  # position in the step: prompt_index * group_size + k
    prompt: Prompt
    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    response: str = ""
    finish_reason: str = ""
    weight_version: int | None = None  # the Miles version that generated it; None: the initial weights
    reward: float = 0.0
    engine: str = ""


@dataclasses.dataclass
class Rollout:
    rollout_id: int
    samples: list[Sample]
    batch: TrainBatch | None
    stats: dict[str, float]


class RolloutExecutor:
    def __init__(
        self,
        *,
        config: Any,
        tokenizer: Any,
        train_prompts: list[Prompt],
        eval_prompts: list[Prompt],
        reward_fn: Callable[..., float],
        reward_name: str,
        controller: Any,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.train_prompts = train_prompts
        self.eval_prompts = eval_prompts
        self.reward_fn = reward_fn
        self.reward_name = reward_name
        self.controller = controller
        self._next_engine = 0

    # -- data order -----------------------------------------------------------------------------------------

    def prompts_for(self, rollout_id: int) -> list[Prompt]:
        """The step's prompts: consecutive slices of a seeded shuffle per epoch (depends on the id alone)."""
        size = self.config.rollout.batch_size
        per_epoch = max(1, len(self.train_prompts) // size)
        epoch, slot = divmod(rollout_id, per_epoch)
        order = list(range(len(self.train_prompts)))
        random.Random(self.config.run.seed * 7919 + epoch).shuffle(order)
        chosen = order[slot * size : (slot + 1) * size]
        while len(chosen) < size:  # fewer prompts than a batch: wrap around
            chosen.append(order[len(chosen) % len(order)])
        return [self.train_prompts[i] for i in chosen]

    # -- steps ----------------------------------------------------------------------------------------------

    async def get(self, rollout_id: int) -> Rollout:
        group = self.config.rollout.group_size
        samples = [
            Sample(index=i * group + k, prompt=p, prompt_ids=self.encode(p.text))
            for i, p in enumerate(self.prompts_for(rollout_id))
            for k in range(group)
        ]
        params = self._sampling(temperature=self.config.rollout.temperature)
        await self._generate(samples, params, seed_base=(self.config.run.seed * 1_000_003 + rollout_id) * 4096)
        self._score(samples, f"sample {{index}} of rollout {rollout_id} (step {rollout_id + 1})")
        rewards = torch.tensor([s.reward for s in samples])
        advantages = grpo_advantages(rewards, group, normalize_std=self.config.train.normalize_advantages)
        batch = TrainBatch(
            [
                TrainSample(s.prompt_ids, s.response_ids, s.logprobs, float(a), s.reward)
                for s, a in zip(samples, advantages.tolist(), strict=True)
            ]
        )
        return Rollout(rollout_id, samples, batch, self._stats(samples, "rollout"))

    async def evaluate(self, rollout_id: int) -> Rollout:
        """Greedy answers to the held-out prompts."""
        samples = [Sample(index=i, prompt=p, prompt_ids=self.encode(p.text)) for i, p in enumerate(self.eval_prompts)]
        await self._generate(samples, self._sampling(temperature=0.0), seed_base=0)
        self._score(samples, f"eval sample {{index}} at step {rollout_id}")
        return Rollout(rollout_id, samples, None, self._stats(samples, "eval"))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def _sampling(self, *, temperature: float) -> SamplingParams:
        rollout = self.config.rollout
        return SamplingParams(
            max_new_tokens=rollout.max_new_tokens, temperature=temperature, top_p=rollout.top_p, top_k=rollout.top_k
        )

    # -- generation -----------------------------------------------------------------------------------------

    async def _generate(self, samples: list[Sample], params: SamplingParams, *, seed_base: int) -> None:
        """Fill every sample's response; one /generate call per engine per wave, failures retried elsewhere."""
        pending = list(samples)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            clients = self._clients()
            shares = [pending[i :: len(clients)] for i in range(len(clients))]
            results = await asyncio.gather(
                *(
                    self._generate_on(client, share, params, seed_base)
                    for client, share in zip(clients, shares, strict=True)
                    if share
                ),
                return_exceptions=True,
            )
            failed = [exc for exc in results if isinstance(exc, BaseException)]
            pending = [s for s in pending if not s.finish_reason]
            if not pending:
                return
            if attempt == MAX_ATTEMPTS:
                raise MilesError(f"{len(pending)} samples could not be generated: {failed[:1]}")
            await self.controller.wait_for_engines(self.config.engine.startup_timeout_s)

    def _clients(self) -> list[EngineClient]:
        if self.controller.router_client is not None:
            return [self.controller.router_client]
        clients = self.controller.engine_clients()
        if not clients:
            raise MilesError("no engine is running")
        self._next_engine = (self._next_engine + 1) % len(clients)
        return clients[self._next_engine :] + clients[: self._next_engine]

    async def _generate_on(
        self, client: EngineClient, share: list[Sample], params: SamplingParams, seed_base: int
    ) -> None:
        per_sample = [dataclasses.replace(params, sampling_seed=seed_base + s.index) for s in share]
        outputs: list[GenerateOutput | BaseException]
        if client.is_router:  # one request per sample, so that the router can spread them over its engines
            outputs = await asyncio.gather(
                *(client.generate_outputs(s.prompt_ids, p) for s, p in zip(share, per_sample, strict=True)),
                return_exceptions=True,
            )
        else:
            outputs = await client.generate_outputs([s.prompt_ids for s in share], per_sample)
        for sample, output in zip(share, outputs, strict=True):
            if isinstance(output, BaseException) or output.aborted:
                continue  # generated again in the next wave
            sample.response_ids = output.output_ids
            sample.logprobs = output.logprobs
            sample.finish_reason = output.finish_reason
            sample.weight_version = output.weight_version
            sample.engine = client.name
            # the tokenizer's decode, not the engine's text: rewards see exactly what the trainer trains on
            sample.response = decode_response(self.tokenizer, sample.response_ids)
        failed = [output for output in outputs if isinstance(output, BaseException)]
        if failed:
            raise failed[0]

    # -- rewards --------------------------------------------------------------------------------------------

    def _score(self, samples: list[Sample], where: str) -> None:
        """Every sample's reward, checked; ``where`` (``"sample {index} of rollout 2 (step 3)"``) names the sample in
        errors."""
        for sample in samples:
            try:
                # Copies: the prompt's label and metadata are shared by its group and by every later step, so a
                # reward that changes them in place would silently change what the next sample is scored against.
                reward = self.reward_fn(
                    prompt=sample.prompt.text,
                    response=sample.response,
                    label=copy.deepcopy(sample.prompt.label),
                    metadata=copy.deepcopy(sample.prompt.metadata),
                )
            except Exception as exc:
                raise MilesError(
                    f"reward function {self.reward_name} raised on {_describe(sample, where)}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            try:
                sample.reward = checked_reward(reward)
            except ValueError as exc:
                raise MilesError(
                    f"reward function {self.reward_name} {exc} on {_describe(sample, where)}: a reward "
                    "must be a finite int or float (or a bool, counted as 1.0/0.0)"
                ) from None

    @staticmethod
    def _stats(samples: list[Sample], prefix: str) -> dict[str, float]:
        rewards = [s.reward for s in samples]
        lengths = [len(s.response_ids) for s in samples]
        return {
            f"{prefix}/reward_mean": statistics.fmean(rewards),
            f"{prefix}/reward_std": statistics.pstdev(rewards),
            f"{prefix}/response_length": statistics.fmean(lengths),
            f"{prefix}/samples": float(len(samples)),
        }


def decode_response(tokenizer: Any, ids: list[int]) -> str:
    """The text a reward function sees: the generated ids decoded without special tokens (no ``<eos>``, pad or
    bos), otherwise as generated (whitespace kept)."""
    return tokenizer.decode(ids, skip_special_tokens=True)


def checked_reward(value: Any) -> float:
    """``value`` as a float when it is a finite real number (``True``/``False`` count as 1.0/0.0, the reward of an
    exact match); anything else (a string, ``None``, NaN, infinity, a tensor) is a ``ValueError`` saying what was
    returned, since a wrong reward silently trains the wrong thing."""
    if isinstance(value, numpy.bool_):  # `a == b` on numpy values: a bool too, though not a numbers.Real
        value = bool(value)
    if not isinstance(value, numbers.Real | decimal.Decimal):  # int, float, bool, Fraction, Decimal, numpy scalars
        hint = " (call .item() on it)" if callable(getattr(value, "item", None)) else ""
        raise ValueError(f"returned {_excerpt(value)} of type {type(value).__name__}, not a number{hint}")
    try:
        number = float(value)
    except OverflowError:  # an int or Fraction beyond float's range
        raise ValueError(f"returned {_excerpt(value)}, beyond the range of a float") from None
    except ValueError:  # Decimal('sNaN')
        raise ValueError(f"returned {_excerpt(value)}, not a finite number") from None
    if not math.isfinite(number):
        raise ValueError(f"returned {number!r}, not a finite number")
    return number


def _describe(sample: Sample, where: str) -> str:
    location = where.format(index=sample.index)
    return f"{location} (prompt {_excerpt(sample.prompt.text)}, response {_excerpt(sample.response)})"


def _excerpt(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + "...' (cut)"
