"""The server's memory of calls: results stay until they expire, and memory stays bounded under load."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

from miles_core.workers.rpc.wire import RUNNING

DEFAULT_RESULT_TTL_S = 12 * 3600.0
MAX_FORGOTTEN_IDS = 100_000  # about 10 MB of remembered ids


@dataclasses.dataclass
class StoredCall:
    """One call: its request fingerprint, state, and (once finished) its call record as JSON
    (:class:`~miles_core.workers.rpc.wire.CallRecord`), encoded once and sent as it is to every poll."""

    call_id: str
    fingerprint: str
    method: str
    state: str = RUNNING
    body: bytes = b""
    finished_at: float | None = None
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class StoreFullError(Exception):
    """Every slot holds a running call; the client should retry later (503)."""


class CallStore:
    """Call records by call id.

    Finished records are dropped ``ttl_s`` after they finished. Independently of time, at most ``max_calls``
    records and ``max_result_bytes`` of finished records are kept: past that the oldest finished records are
    evicted first. Forgotten ids are remembered (a bounded number of them) so that a poll can say "expired"
    rather than "unknown", and an expired id is never executed a second time.
    """

    def __init__(
        self, *, ttl_s: float = DEFAULT_RESULT_TTL_S, max_calls: int = 100_000, max_result_bytes: int = 256 << 20
    ) -> None:
        if ttl_s <= 0 or max_calls <= 0 or max_result_bytes <= 0:
            raise ValueError("ttl_s, max_calls and max_result_bytes must be positive")
        self.ttl_s = ttl_s
        self.max_calls = max_calls
        self.max_result_bytes = max_result_bytes
        self._records: collections.OrderedDict[str, StoredCall] = collections.OrderedDict()
        self._finished: collections.OrderedDict[str, None] = collections.OrderedDict()  # in order of finishing
        self._result_bytes = 0
        self._forgotten: collections.OrderedDict[str, str] = collections.OrderedDict()  # call id -> why
        self.evicted = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._records)

    @property
    def result_bytes(self) -> int:
        """Bytes of finished records held."""
        return self._result_bytes

    def get(self, call_id: str) -> StoredCall | None:
        return self._records.get(call_id)

    def forgotten_reason(self, call_id: str) -> str | None:
        """Why a call id is no longer held ("expired" or "evicted"), or None if it was never seen."""
        return self._forgotten.get(call_id)

    def add(self, record: StoredCall) -> None:
        """Hold a new running call, evicting old finished records if needed."""
        self.expire()
        while len(self._records) >= self.max_calls and self._finished:
            self._drop_oldest_finished("evicted")
        if len(self._records) >= self.max_calls:
            raise StoreFullError(f"{len(self._records)} calls are running; the limit is {self.max_calls}")
        self._records[record.call_id] = record

    def finish(self, record: StoredCall, *, state: str, body: bytes) -> None:
        """Record a call's outcome and wake its pollers."""
        record.state, record.body, record.finished_at = state, body, time.monotonic()
        self._finished[record.call_id] = None
        self._result_bytes += len(body)
        while self._result_bytes > self.max_result_bytes and len(self._finished) > 1:
            self._drop_oldest_finished("evicted")
        record.done.set()

    def expire(self, now: float | None = None) -> None:
        """Drop finished records older than the TTL."""
        now = time.monotonic() if now is None else now
        while self._finished:
            oldest = self._records[next(iter(self._finished))]
            if oldest.finished_at is None or now - oldest.finished_at < self.ttl_s:
                break
            self._drop_oldest_finished("expired")

    def _drop_oldest_finished(self, reason: str) -> None:
        call_id, _ = self._finished.popitem(last=False)
        record = self._records.pop(call_id)
        self._result_bytes -= len(record.body)
        self._forgotten[call_id] = reason
        if len(self._forgotten) > MAX_FORGOTTEN_IDS:
            self._forgotten.popitem(last=False)
        if reason == "expired":
            self.expired += 1
        else:
            self.evicted += 1
