"""``RolloutStream``: the rollout of ``--run-schedule fully_async``, generation that never stops.

A producer keeps ``batch_size + --rollout-over-sampling`` groups generating or finished ahead of the trainer at all
times; each group, once generated, scored and passed by the filters, goes
into a FIFO buffer. Each training step takes ``batch_size`` groups from it (:meth:`RolloutStream.take`). A group
lags the trainer by the versions between the oldest weights any of its tokens were generated with and the weights
being trained; one beyond ``--rollout-max-staleness`` is dropped or generated again (``--rollout-stale-groups``).

Weight updates do not wait for generation: the controller pauses the engines with ``abort`` for the swap alone,
and the executor sends every cut request again (continued after its tokens with ``--rollout-partial``, else from
the start), so no sample is lost or counted twice.

Group ``g`` is slot ``g % batch_size`` of rollout ``g // batch_size`` (the prompt and seeds a ``sync`` run gives it).
:class:`StreamState` records which groups are settled (trained on, dropped or filtered out); a checkpoint keeps it,
so a resumed run skips exactly those and generates everything that was in flight or buffered again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_core.errors import MilesError
from miles_core.rollout.executor import RolloutExecutor
from miles_core.rollout.samples import Group, Rollout

if TYPE_CHECKING:
    from miles_core.config.sections import RolloutSection

STATE_FILE = "rollout_stream.json"


@dataclasses.dataclass
class StreamState:
    """The settled group indices: every one below ``low``, and those in ``above``."""

    low: int = 0
    above: set[int] = dataclasses.field(default_factory=set)

    def settle(self, index: int) -> None:
        if index >= self.low:
            self.above.add(index)
        while self.low in self.above:
            self.above.remove(self.low)
            self.low += 1

    def settled(self, index: int) -> bool:
        return index < self.low or index in self.above

    def copy(self) -> StreamState:
        """A snapshot, for a checkpoint written in another thread while the stream goes on settling groups."""
        return StreamState(low=self.low, above=set(self.above))

    def save(self, directory: Path) -> Path:
        path = directory / STATE_FILE
        path.write_text(json.dumps({"low": self.low, "above": sorted(self.above)}) + "\n")
        return path

    @classmethod
    def load(cls, directory: Path, *, default_low: int) -> StreamState:
        """The state saved in a checkpoint; one without it (written by a ``sync`` or ``one_step_off`` run) continues
        where those schedules would: at group ``default_low``."""
        path = directory / STATE_FILE
        if not path.is_file():
            return cls(low=default_low)
        try:
            data = json.loads(path.read_text())
            return cls(low=int(data["low"]), above={int(i) for i in data["above"]})
        except (ValueError, KeyError, TypeError) as exc:
            raise MilesError(f"{path} is not a rollout stream state ({type(exc).__name__}: {exc})") from None


class RolloutStream:
    """Generates groups ahead of the trainer, into a buffer that :meth:`take` draws batches from."""

    def __init__(
        self, executor: RolloutExecutor, controller: Any, rollout: RolloutSection, *, state: StreamState
    ) -> None:
        self.executor, self.controller = executor, controller
        self.batch_size = rollout.batch_size
        self.in_flight_limit = rollout.batch_size + rollout.over_sampling
        self.max_staleness = rollout.max_staleness
        self.retry_stale = rollout.stale_groups == "retry"
        self.state = state
        self._buffer: collections.deque[Group] = collections.deque()
        self._running: dict[int, asyncio.Task] = {}
        self._retry: collections.deque[int] = collections.deque()
        self._changed = asyncio.Condition()
        self._error: BaseException | None = None
        self._producer: asyncio.Task | None = None
        self._filtered = 0
        self._idle_s = 0.0  # time with no group generating since the previous take
        self._idle_since: float | None = None

    def start(self) -> None:
        self._producer = asyncio.create_task(self._produce(), name="rollout-stream")

    async def stop(self) -> None:
        """Cancel the producer and every group in flight (a resumed run generates them again)."""
        tasks = [t for t in (self._producer, *set(self._running.values())) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # -- producing ------------------------------------------------------------------------------------------

    def _room(self) -> int:
        """How many groups may start: at most ``batch_size + over_sampling`` are in flight or finished and not yet
        taken. More would not keep the engines busier, only make the groups older by the time they are trained on
        (each batch overlaps one training step)."""
        return self.in_flight_limit - len(self._running) - len(self._buffer)

    async def _produce(self) -> None:
        """Start every group there is room for, together (one request per engine: each request costs the driver's
        HTTP client time, which the trainer's thread would feel), whenever room appears."""
        index = self.state.low
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: self._room() > 0 or self._error is not None)
            if self._error is not None:
                return
            chosen: list[int] = []
            for _ in range(self._room()):
                if self._retry:
                    chosen.append(self._retry.popleft())
                    continue
                while self.state.settled(index) or index in self._running:
                    index += 1
                chosen.append(index)
                index += 1
            if not self._running and self._idle_since is not None:
                self._idle_s += time.monotonic() - self._idle_since
            task = asyncio.create_task(self._generate(chosen), name=f"rollout-groups-{chosen[0]}")
            self._running.update(dict.fromkeys(chosen, task))

    async def _generate(self, indices: list[int]) -> None:
        try:
            groups = await self.executor.groups_at([divmod(index, self.batch_size) for index in indices])
            kept = [self.executor.keeps(group) for group in groups]
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the run stops: take() raises it
            self._error = exc
        else:
            for group, keep in zip(groups, kept, strict=True):
                if keep:
                    self._buffer.append(group)
                else:
                    self.state.settle(group.index)
                    self._filtered += 1
        finally:
            for index in indices:
                self._running.pop(index, None)
            if not self._running:
                self._idle_since = time.monotonic()
        async with self._changed:
            self._changed.notify_all()

    # -- taking ---------------------------------------------------------------------------------------------

    async def take(self, rollout_id: int) -> Rollout:
        """The next ``batch_size`` groups within the staleness bound, as step ``rollout_id + 1``'s batch, with the
        stream's statistics (staleness of the groups taken, groups dropped, retried and filtered out since the
        previous step)."""
        version = self.controller.version  # the weights the trainer holds now
        taken: list[Group] = []
        lags: list[int] = []
        dropped = retried = 0
        while len(taken) < self.batch_size:
            group = await self._next_group()
            lag = version - min(group.versions(self.executor.initial_version))
            if lag > self.max_staleness:
                if self.retry_stale:
                    self._retry.append(group.index)
                    retried += 1
                else:
                    self.state.settle(group.index)
                    dropped += 1
                continue
            self.state.settle(group.index)
            taken.append(group)
            lags.append(lag)
        stats = self._stats(lags, dropped=dropped, retried=retried)
        return self.executor.rollout_of(rollout_id, taken, stats)

    async def _next_group(self) -> Group:
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._buffer) or self._error is not None)
            if self._error is not None:
                raise self._error
            group = self._buffer.popleft()
            self._changed.notify_all()  # room for the producer
        return group

    def _stats(self, lags: list[int], *, dropped: int, retried: int) -> dict[str, float]:
        filtered, self._filtered = self._filtered, 0
        idle_s, self._idle_s = self._idle_s, 0.0
        if not self._running and self._idle_since is not None:  # idle now: count up to here, and on from here
            idle_s += time.monotonic() - self._idle_since
            self._idle_since = time.monotonic()
        stats = {
            "rollout/staleness_mean": statistics.fmean(lags),
            "rollout/staleness_max": float(max(lags)),
            "rollout/dropped_stale_groups": float(dropped),
            "rollout/retried_stale_groups": float(retried),
            "rollout/filtered_groups": float(filtered),
            "rollout/buffered_groups": float(len(self._buffer)),
            "rollout/groups_in_flight": float(len(self._running)),
            "rollout/generation_idle_s": idle_s,  # no group generating: the engines had nothing to do
        }
        for lag in range(self.max_staleness + 1):  # the histogram: groups taken at each staleness
            stats[f"rollout/staleness_{lag}"] = float(lags.count(lag))
        return stats
