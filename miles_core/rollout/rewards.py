"""Rewards: what a run scores its samples with, and the pool that scores them off the event loop.

A run's reward is a :class:`RewardPlan`: a :class:`CompositeReward` (weighted parts, ``--reward math:1.0,format:0.1``)
per data source (``--rollout-reward-dispatch-key`` / ``--rollout-reward-by-source``), else the default one. A part
is a per-sample function (``fn(*, prompt, response, label, metadata) -> float``, run by the :class:`RewardPool`'s
worker threads with a per-call timeout) or a :class:`BatchReward` (a reward server, awaited on the event loop).

A part that raises, returns anything but a finite number or runs past its timeout scores 0 and is counted
(:class:`Sample` ``reward_errors`` / ``reward_timeouts``); the first failure of each kind per part is printed, and
``max_consecutive_failures`` failures of one part in a row stop the run with a :class:`MilesError` naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import decimal
import math
import numbers
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy

from miles_core.errors import MilesError
from miles_core.rollout.samples import Sample

MAX_ABANDONED_THREADS = 32
"""Worker threads stuck in calls that timed out, at most, before the run stops: each holds whatever it holds."""


@dataclasses.dataclass(frozen=True)
class RewardInput:
    """What a reward scores: the prompt's text, the decoded response, the prompt's label and metadata."""

    prompt: str
    response: str
    label: Any
    metadata: dict[str, Any]


class BatchReward(Protocol):
    """A reward scored a batch at a time outside the driver (a reward server), awaited on the event loop."""

    async def score(self, items: list[RewardInput]) -> list[float | Exception]:
        """One reward per item, in order, or the exception that kept that item from being scored (counted as an
        error; it never raises for a failure to score)."""
        ...


@dataclasses.dataclass(frozen=True)
class RewardPart:
    """One weighted part of a reward: a per-sample function, or a :class:`BatchReward`."""

    name: str  # as the user wrote it: its metric is rollout/reward/<name>
    weight: float
    fn: Callable[..., Any] | None = None
    batch: BatchReward | None = None


@dataclasses.dataclass(frozen=True)
class CompositeReward:
    """The weighted sum of its parts (``text``: as written, for messages)."""

    text: str
    parts: tuple[RewardPart, ...]


@dataclasses.dataclass(frozen=True)
class RewardPlan:
    """The reward of each sample: by its metadata's ``dispatch_key`` value in ``by_source``, else ``default``."""

    default: CompositeReward | None
    by_source: Mapping[str, CompositeReward] = dataclasses.field(default_factory=dict)
    dispatch_key: str | None = None

    @property
    def name(self) -> str:
        if not self.dispatch_key:
            return self.default.text if self.default else "none"
        sources = ", ".join(f"{source}: {reward.text}" for source, reward in self.by_source.items())
        fallback = f"; else {self.default.text}" if self.default else ""
        return f"by {self.dispatch_key} ({sources}{fallback})"

    def reward_for(self, metadata: Any) -> CompositeReward:
        """The reward of a sample with ``metadata``; an unknown source without a default is a :class:`MilesError`
        naming it and the known ones."""
        if self.dispatch_key is None:
            assert self.default is not None
            return self.default
        source = metadata.get(self.dispatch_key) if isinstance(metadata, dict) else None
        found = self.by_source.get(source) if isinstance(source, str) else None
        if found is not None:
            return found
        if self.default is not None:
            return self.default
        raise MilesError(
            f"a sample's metadata {self.dispatch_key!r} is {source!r:.80}, which --rollout-reward-by-source does not "
            f"map (known: {', '.join(self.by_source)}); add it, or give --reward for the others"
        )


def checked_reward(value: Any) -> float:
    """``value`` as a float when it is a finite real number (``True``/``False`` count as 1.0/0.0, the reward of an
    exact match); anything else (a string, ``None``, NaN, infinity, a tensor) is a ``ValueError`` saying what was
    returned, since a wrong reward silently trains the wrong thing."""
    if isinstance(value, numpy.bool_):  # `a == b` on numpy values: a bool too, though not a numbers.Real
        value = bool(value)
    if not isinstance(value, numbers.Real | decimal.Decimal):  # int, float, bool, Fraction, Decimal, numpy scalars
        hint = " (call .item() on it)" if callable(getattr(value, "item", None)) else ""
        raise ValueError(f"returned {excerpt(value)} of type {type(value).__name__}, not a number{hint}")
    try:
        number = float(value)
    except OverflowError:  # an int or Fraction beyond float's range
        raise ValueError(f"returned {excerpt(value)}, beyond the range of a float") from None
    except ValueError:  # Decimal('sNaN')
        raise ValueError(f"returned {excerpt(value)}, not a finite number") from None
    if not math.isfinite(number):
        raise ValueError(f"returned {number!r}, not a finite number")
    return number


def describe(sample: Sample, where: str) -> str:
    """``where`` (``"sample {index} of rollout 2 (step 3)"``) filled in, with excerpts of the prompt and response."""
    location = where.format(index=sample.index)
    return f"{location} (prompt {excerpt(sample.prompt.text)}, response {excerpt(sample.response)})"


def excerpt(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + "...' (cut)"


# -- the pool ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Failure:
    """A part's call that gave no reward: ``kind`` is ``"error"`` (raised, or not a finite number) or
    ``"timeout"``."""

    kind: str
    message: str


@dataclasses.dataclass(eq=False)
class RewardCall:
    """One call of a per-sample function; ``outcome`` is set by its worker (or a timeout by the driver)."""

    fn: Callable[..., Any]
    item: RewardInput
    outcome: float | Failure | None = None


def run_call(call: RewardCall) -> float | Failure:
    """The call, its label and metadata copied (they are shared by the prompt's group and later steps: a reward
    that changed them in place would change what the next sample is scored against)."""
    item = call.item
    try:
        value = call.fn(
            prompt=item.prompt,
            response=item.response,
            label=copy.deepcopy(item.label),
            metadata=copy.deepcopy(item.metadata),
        )
    except Exception as exc:  # the reward's own error, whatever it is: counted, never the run's end by itself
        return Failure("error", f"raised {type(exc).__name__}: {exc}")
    try:
        return checked_reward(value)
    except ValueError as exc:
        return Failure("error", f"{exc} (a reward is a finite int or float, or a bool)")


class _Worker:
    """A daemon thread of the pool, running chunks of calls in order. The driver abandons it when its current
    call runs past the timeout: it then drops whatever it finishes later (daemon: it never holds up the exit)."""

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue[tuple[list[RewardCall], Callable[[], None]] | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.current: RewardCall | None = None
        self.started = 0.0
        self.abandoned = False
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            calls, done = job
            for call in calls:
                with self.lock:
                    if self.abandoned:
                        return
                    self.current, self.started = call, time.monotonic()
                outcome = run_call(call)
                with self.lock:
                    if self.abandoned:  # timed out meanwhile: the driver has scored it
                        return
                    call.outcome, self.current = outcome, None
            done()

    def overdue(self, now: float, timeout_s: float) -> RewardCall | None:
        """The current call when it has run ``timeout_s`` or longer: the worker is then abandoned (under its lock,
        so the call's late outcome can no longer land)."""
        with self.lock:
            if self.current is None or now - self.started < timeout_s:
                return None
            self.abandoned = True
            self.current.outcome = Failure("timeout", "")
            return self.current

    def deadline(self, timeout_s: float) -> float | None:
        with self.lock:
            return self.started + timeout_s if self.current is not None else None


class RewardPool:
    """``workers`` daemon threads that run per-sample reward calls with a per-call timeout. A batch is split into
    one chunk per worker (one hand-off each, not one per call); the driver sleeps until the nearest deadline, and a
    call past it is a timeout while its worker is abandoned and replaced (at most
    :data:`MAX_ABANDONED_THREADS` stuck at once)."""

    def __init__(self, *, workers: int, timeout_s: float) -> None:
        self.size, self.timeout_s = workers, timeout_s
        self._workers: list[_Worker] = []
        self._abandoned: list[_Worker] = []
        self._made = 0

    async def run(self, calls: list[RewardCall]) -> None:
        """Set every call's outcome: its value, or its :class:`Failure` (a timeout too)."""
        if not calls:
            return
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        chunks = [calls[i :: self.size] for i in range(min(self.size, len(calls)))]
        active: dict[_Worker, list[RewardCall]] = {}
        finished: set[_Worker] = set()

        def submit(worker: _Worker, chunk: list[RewardCall]) -> None:
            active[worker] = chunk

            def done() -> None:
                loop.call_soon_threadsafe(lambda: (finished.add(worker), wake.set()))

            worker.jobs.put((chunk, done))

        for worker, chunk in zip(self._ready_workers(len(chunks)), chunks, strict=False):
            submit(worker, chunk)
        while True:
            for worker in finished & active.keys():
                del active[worker]
            if not active:
                return
            now = time.monotonic()
            for worker, chunk in list(active.items()):
                late = worker.overdue(now, self.timeout_s)
                if late is not None:
                    del active[worker]
                    rest = chunk[chunk.index(late) + 1 :]
                    if rest:
                        submit(self._replace(worker), rest)
                    else:
                        self._replace(worker)
            deadlines = [d for d in (worker.deadline(self.timeout_s) for worker in active) if d is not None]
            wake.clear()
            if active:
                wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else self.timeout_s
                with contextlib.suppress(TimeoutError):  # a deadline came: the loop's top checks it
                    await asyncio.wait_for(wake.wait(), wait + 0.001)

    def _ready_workers(self, count: int) -> list[_Worker]:
        while len(self._workers) < count:
            self._workers.append(self._new_worker())
        return self._workers[:count]

    def _new_worker(self) -> _Worker:
        self._made += 1
        return _Worker(f"miles-reward-{self._made}")

    def _replace(self, stuck: _Worker) -> _Worker:
        """A fresh worker in ``stuck``'s place; too many stuck threads at once stop the run."""
        self._abandoned = [w for w in self._abandoned if w.thread.is_alive()] + [stuck]
        if len(self._abandoned) > MAX_ABANDONED_THREADS:
            raise MilesError(
                f"{len(self._abandoned)} reward calls ran past --rollout-reward-timeout-s {self.timeout_s:g} and never "
                f"returned (at most {MAX_ABANDONED_THREADS} may hang at once): fix the reward, or make it return"
            )
        fresh = self._new_worker()
        self._workers[self._workers.index(stuck)] = fresh
        return fresh

    def close(self) -> None:
        """Let the idle workers end (stuck ones are daemon threads: they never hold up the exit)."""
        for worker in self._workers:
            worker.jobs.put(None)
        self._workers = []


# -- the scorer -------------------------------------------------------------------------------------------------


class RewardScorer:
    """Scores samples with a :class:`RewardPlan`: per-sample parts in the :class:`RewardPool`, batch parts awaited
    together with them. Sets each sample's ``reward`` (the weighted sum), ``reward_parts`` and failure counts."""

    def __init__(
        self,
        plan: RewardPlan,
        *,
        timeout_s: float,
        workers: int,
        max_consecutive_failures: int,
        log: Callable[[str], None] = lambda line: print(line, flush=True),
    ) -> None:
        self.plan = plan
        self.pool = RewardPool(workers=workers, timeout_s=timeout_s)
        self.max_consecutive_failures = max_consecutive_failures
        self.log = log
        self._in_row: dict[str, int] = {}
        self._logged: set[tuple[str, str]] = set()

    async def score(self, samples: list[Sample], wheres: list[str]) -> None:
        """Every sample's reward; ``wheres``, one per sample (``"sample {index} of rollout 2 (step 3)"``), name them
        in messages."""
        rewards = [self.plan.reward_for(sample.prompt.metadata) for sample in samples]
        items = [RewardInput(s.prompt.text, s.response, s.prompt.label, s.prompt.metadata) for s in samples]
        outcomes: list[dict[str, float | Failure]] = [{} for _ in samples]
        calls: list[tuple[int, str, RewardCall]] = []
        batches: dict[tuple[int, str], tuple[BatchReward, list[int]]] = {}
        for index, (reward, item) in enumerate(zip(rewards, items, strict=True)):
            for part in reward.parts:
                if part.batch is not None:
                    batches.setdefault((id(part.batch), part.name), (part.batch, []))[1].append(index)
                else:
                    assert part.fn is not None
                    calls.append((index, part.name, RewardCall(part.fn, item)))
        batch_results = await asyncio.gather(
            self.pool.run([call for _, _, call in calls]),
            *(batch.score([items[i] for i in indices]) for batch, indices in batches.values()),
        )
        for index, name, call in calls:
            assert call.outcome is not None
            outcomes[index][name] = call.outcome
        shared: dict[int, Failure] = {}  # one failed request fails its items with one Failure: one in a row
        for ((_, name), (_, indices)), results in zip(batches.items(), batch_results[1:], strict=True):
            for index, result in zip(indices, results, strict=True):
                outcomes[index][name] = _batch_outcome(result, shared)
        counted: set[int] = set()
        for sample, reward, found, where in zip(samples, rewards, outcomes, wheres, strict=True):
            self._take(sample, reward, found, where, counted)

    def _take(
        self,
        sample: Sample,
        reward: CompositeReward,
        found: dict[str, float | Failure],
        where: str,
        counted: set[int],
    ) -> None:
        """The sample's reward from its parts' outcomes (a failed part counts 0), failures counted and checked
        (``counted``: the failures already counted in a row, shared by the items of a failed request)."""
        total, parts = 0.0, {}
        sample.reward_errors = sample.reward_timeouts = 0
        for part in reward.parts:
            outcome = found[part.name]
            if isinstance(outcome, Failure):
                if id(outcome) not in counted:
                    counted.add(id(outcome))
                    self._failed(part.name, outcome, sample, where)
                sample.reward_errors += outcome.kind == "error"
                sample.reward_timeouts += outcome.kind == "timeout"
                value = 0.0
            else:
                self._in_row[part.name] = 0
                value = outcome
            parts[part.name] = value
            total += part.weight * value
        sample.reward, sample.reward_parts = total, parts

    def _failed(self, name: str, failure: Failure, sample: Sample, where: str) -> None:
        message = failure.message or f"ran past --rollout-reward-timeout-s {self.pool.timeout_s:g}"
        what = f"reward {name} {'' if failure.kind == 'error' else 'timed out: '}{message} on {describe(sample, where)}"
        if (name, failure.kind) not in self._logged:
            self._logged.add((name, failure.kind))
            kind = "reward/errors" if failure.kind == "error" else "reward/timeouts"
            self.log(f"miles: {what}; it scores 0 (further ones are counted in {kind}, not printed)")
        self._in_row[name] = self._in_row.get(name, 0) + 1
        if self._in_row[name] >= self.max_consecutive_failures:
            raise MilesError(
                f"reward {name} failed {self._in_row[name]} times in a row "
                f"(--rollout-reward-max-consecutive-failures); the last: {what}"
            )

    def close(self) -> None:
        self.pool.close()


def _batch_outcome(result: Any, shared: dict[int, Failure]) -> float | Failure:
    """A batch reward's result as an outcome; the items of one exception share one :class:`Failure`."""
    if isinstance(result, Exception):
        if id(result) not in shared:
            shared[id(result)] = Failure("error", str(result) or type(result).__name__)
        return shared[id(result)]
    try:
        return checked_reward(result)
    except ValueError as exc:
        return Failure("error", str(exc))


def single_reward(fn: Callable[..., Any], name: str) -> RewardPlan:
    """The plan of one reward function, weight 1.0, for every sample."""
    return RewardPlan(CompositeReward(name, (RewardPart(name, 1.0, fn=fn),)))
