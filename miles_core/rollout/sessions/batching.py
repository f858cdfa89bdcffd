"""``TurnBatcher``: the turns that sessions ask of one engine within a few milliseconds go to it as one batched
``/generate`` request.

Each HTTP request costs the session server's Python HTTP client about as much CPU as the tiny default model's whole
turn (py-spy on a 2-core run: more than half the server's time was in httpx), so sending every turn alone made the
server the bottleneck. Batches do not wait for each other: a batch leaves ``window_s`` after its first turn arrived
(or at once when it holds ``max_batch`` turns) while earlier batches are still generating, so a long turn never
holds a later one back; the engine's continuous batching runs them together.
"""

from __future__ import annotations

import asyncio
import contextlib

from miles_core.engines.client import EngineClient
from miles_core.engines.generate_types import GenerateOutput, SamplingParams

BATCH_WINDOW_S = 0.002
MAX_BATCH = 256


class TurnBatcher:
    """Batches :meth:`generate` calls for one engine client."""

    def __init__(self, client: EngineClient, *, window_s: float = BATCH_WINDOW_S, max_batch: int = MAX_BATCH) -> None:
        self.client, self.window_s, self.max_batch = client, window_s, max_batch
        self._pending: list[tuple[list[int], SamplingParams, asyncio.Future[GenerateOutput]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()

    async def generate(self, input_ids: list[int], params: SamplingParams) -> GenerateOutput:
        """One turn's output, generated in a batch with the turns that arrived with it; a failed batch fails each."""
        future: asyncio.Future[GenerateOutput] = asyncio.get_running_loop().create_future()
        self._pending.append((input_ids, params, future))
        if len(self._pending) >= self.max_batch:
            self._send()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.window_s, self._send)
        return await future

    def _send(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._generate(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _generate(self, batch: list[tuple[list[int], SamplingParams, asyncio.Future[GenerateOutput]]]) -> None:
        try:
            outputs = await self.client.generate_outputs([ids for ids, _, _ in batch], [p for _, p, _ in batch])
        except BaseException as exc:
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, _, future), output in zip(batch, outputs, strict=True):
            if not future.done():  # its request was cancelled (the agent hung up): nobody waits for it
                future.set_result(output)

    async def aclose(self) -> None:
        """Cancel the batches still generating (the server is stopping)."""
        for task in list(self._sending):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
