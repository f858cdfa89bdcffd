"""What both HTTP faces of the local engine share (its SGLang-native routes in
:mod:`.server`, its OpenAI-compatible routes in :mod:`.openai_routes`):
the body limits, the prompt count of one request, the text an answer shows around stop strings, and cancelling
work whose client has left."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

MIB = 1 << 20
CONTROL_BODY_BYTES = 1 * MIB
"""Most routes carry a few fields."""
ROUTE_BODY_BYTES = {
    "/generate": 32 * MIB,  # a batch of long prompts as token-id lists
    "/update_weights_from_distributed": 16 * MIB,  # names, dtypes and shapes of every tensor of a large model
    "/update_weights_from_tensor": 1 << 30,  # weights may travel in the body (base64 safetensors)
    "/update_weights_from_staging": 64 * MIB,  # the layout of every tensor of a large model
}
MAX_PROMPTS_PER_REQUEST = 16384
"""A /generate batch's prompts at most (a rollout sends its share of one step: thousands). Each prompt costs Python
objects and a sampling-parameter check before the engine sees it, so 32 MiB of ``[[0],[0],...]`` (8 million
one-token prompts) would cost gigabytes and minutes of CPU."""
CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, but logs and tests see why it ended


async def unless_client_leaves(request: Request, work: Coroutine[Any, Any, Any]) -> Any:
    """Run ``work``, cancelling it if the client disconnects first (its requests leave their batch); then the
    answer is a :data:`CLIENT_GONE` response that nobody reads."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=CLIENT_GONE)


async def _disconnected(request: Request) -> None:
    """Return once the client has closed the connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def visible_text(text: str, finish_reason: dict | None) -> str:
    """``text`` as an answer shows it: cut before the stop string that ended it, as SGLang does."""
    matched = (finish_reason or {}).get("matched")
    if isinstance(matched, str) and matched in text:
        return text[: text.index(matched)]
    return text


def held_back(text: str, stops: list[str]) -> int:
    """How much of ``text`` a stream may send now: up to a stop string it holds, else all but a tail that may be
    the start of a stop string or an incomplete character (decoded as U+FFFD)."""
    found = [text.index(stop) for stop in stops if stop in text]
    if found:
        return min(found)
    end = len(text)
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                end = min(end, len(text) - size)
                break
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    return end
