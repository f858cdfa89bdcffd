"""The client of a reward server (``--reward-url URL``; the reward part named ``remote``).

The protocol (documented on the rewards page of the docs):

* ``GET {URL}/health`` answers 200 when the server can score: probed once when the run starts.
* ``POST {URL}/score`` with ``{"items": [{"prompt", "response", "label", "metadata"}, ...]}`` answers 200 with
  ``{"rewards": [number | null, ...]}``, one per item in order (``null``: that item could not be scored; an
  optional ``"errors": [string | null, ...]`` says why). Any other answer is ``{"error": message}`` with a 4xx or
  5xx status.
* With a token, every request carries ``Authorization: Bearer TOKEN``.

A request that fails to connect, times out or is answered 408, 429 or 5xx is retried (at most ``retries`` times,
backing off); then, as for any other refusal, its items score 0 and are counted as errors: a server that dies
costs the samples scored meanwhile, not the run.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from miles_core.errors import MilesError
from miles_core.http import parse_json_object
from miles_core.rollout.rewards import RewardInput, excerpt

RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
MAX_BACKOFF_S = 2.0
PROBE_TIMEOUT_S = 10.0
MAX_RESPONSE_BYTES = 64 << 20


class RewardServerError(Exception):
    """A request to the reward server that gave no rewards (its items score 0 and are counted)."""


class RemoteReward:
    """Scores batches on a reward server: ``batch_size`` items per request, ``concurrency`` requests at once."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        timeout_s: float,
        retries: int,
        batch_size: int,
        concurrency: int,
    ) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s, self.retries = timeout_s, retries
        self.batch_size, self.concurrency = batch_size, concurrency

    def probe(self) -> None:
        """``GET /health``; a server that cannot be reached or does not answer 200 is a :class:`MilesError`."""
        what = f"the reward server --reward-url {self.url}"
        try:
            answer = httpx.get(f"{self.url}/health", headers=self.headers, timeout=min(self.timeout_s, PROBE_TIMEOUT_S))
        except httpx.HTTPError as exc:
            raise MilesError(
                f"{what} cannot be reached ({type(exc).__name__}: {exc}): start it, or correct the URL"
            ) from None
        if answer.status_code != 200:
            hint = (
                "; give its token with --reward-url-token or MILES_REWARD_URL_TOKEN"
                if answer.status_code in (401, 403)
                else ""
            )
            raise MilesError(f"{what} answered GET /health with {answer.status_code} {excerpt(answer.text)}{hint}")

    async def score(self, items: list[RewardInput]) -> list[float | Exception]:
        """One reward per item, or the error that kept its request from being scored."""
        chunks = [items[i : i + self.batch_size] for i in range(0, len(items), self.batch_size)]
        limit = asyncio.Semaphore(self.concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers) as client:
            answers = await asyncio.gather(*(self._score_chunk(client, limit, chunk) for chunk in chunks))
        return [result for answer in answers for result in answer]

    async def _score_chunk(
        self, client: httpx.AsyncClient, limit: asyncio.Semaphore, chunk: list[RewardInput]
    ) -> list[float | Exception]:
        try:
            body = json.dumps({"items": [_item(item) for item in chunk]}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            return [RewardServerError(f"the items cannot be sent as JSON: {exc}")] * len(chunk)
        failure: Exception = RewardServerError("not sent")
        async with limit:
            for attempt in range(self.retries + 1):
                if attempt:
                    await asyncio.sleep(min(MAX_BACKOFF_S, 0.1 * 2**attempt))
                try:
                    answer = await client.post(
                        f"{self.url}/score", content=body, headers={"content-type": "application/json"}
                    )
                except httpx.HTTPError as exc:
                    failure = RewardServerError(f"POST {self.url}/score failed: {type(exc).__name__}: {exc}")
                    continue
                if answer.status_code in RETRIED_STATUSES:
                    failure = _refusal(self.url, answer)
                    continue
                if answer.status_code != 200:
                    return [_refusal(self.url, answer)] * len(chunk)
                return _rewards(self.url, answer, len(chunk))
        return [failure] * len(chunk)


def _item(item: RewardInput) -> dict[str, Any]:
    return {"prompt": item.prompt, "response": item.response, "label": item.label, "metadata": item.metadata}


def _refusal(url: str, answer: httpx.Response) -> RewardServerError:
    try:
        message = parse_json_object(answer.content[:MAX_RESPONSE_BYTES]).get("error", answer.text)
    except Exception:  # not JSON: its text says what happened
        message = answer.text
    return RewardServerError(f"POST {url}/score answered {answer.status_code}: {excerpt(message, 200)}")


def _rewards(url: str, answer: httpx.Response, count: int) -> list[float | Exception]:
    """The answer's rewards, checked against the protocol; a malformed answer fails all of its items."""
    try:
        data = parse_json_object(answer.content[:MAX_RESPONSE_BYTES])
    except Exception as exc:  # the toolkit's JSON errors: malformed, too deep, NaN
        return [RewardServerError(f"POST {url}/score answered malformed JSON: {exc}")] * count
    rewards, errors = data.get("rewards"), data.get("errors")
    if not isinstance(rewards, list) or len(rewards) != count:
        got = f"{len(rewards)} rewards" if isinstance(rewards, list) else f"rewards = {excerpt(rewards)}"
        return [RewardServerError(f"POST {url}/score answered {got} for {count} items")] * count
    if not (isinstance(errors, list) and len(errors) == count):
        errors = [None] * count
    return [
        RewardServerError(f"the reward server could not score it: {excerpt(error or 'no reason given', 200)}")
        if value is None
        else value
        for value, error in zip(rewards, errors, strict=True)
    ]
