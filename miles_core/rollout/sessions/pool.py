"""``SessionServers``: the session servers of a run, started through its worker provider, and the rollout's client
of them (create a session, read its trajectory, end it). Sessions are spread over the servers in turn; each names the
engine (or the router) that generates its turns, so that a restarted engine's new address is used at once."""

from __future__ import annotations

import itertools
from typing import Any

import httpx

from miles_core.errors import MilesError
from miles_core.rollout.sessions.server import SessionLimits, session_server_spec
from miles_core.rollout.sessions.session import Trajectory, Turn
from miles_core.workers.provider import BaseWorkerProvider, WorkerInfo

SESSION_SERVER_PREFIX = "session-server"


class SessionError(MilesError):
    """A session server refused or failed a rollout request (its status and message are in the text)."""


class SessionServers:
    """``count`` session servers in front of the run's engines, and an HTTP client of their bearer routes."""

    def __init__(self, provider: BaseWorkerProvider, workers: list[WorkerInfo], *, timeout_s: float = 600.0) -> None:
        self.provider, self.workers = provider, workers
        self._next = itertools.cycle(range(len(workers)))
        headers = {"Authorization": f"Bearer {provider.token}"}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self._http = httpx.AsyncClient(headers=headers, timeout=timeout_s, limits=limits, trust_env=False)

    @classmethod
    async def start(
        cls,
        provider: BaseWorkerProvider,
        *,
        count: int,
        startup_timeout_s: float,
        engine_url: str,
        model_path: str,
        chat_format: str,
        limits: SessionLimits | None = None,
        engine_is_router: bool = False,
    ) -> SessionServers:
        """Start ``count`` servers (``session-server-0``, ...; ``rollout.session_servers``) through ``provider``,
        each given ``startup_timeout_s`` to answer its health check; one that fails to start stops the others."""
        workers: list[WorkerInfo] = []
        try:
            for index in range(count):
                spec = session_server_spec(
                    startup_timeout_s=startup_timeout_s,
                    name=f"{SESSION_SERVER_PREFIX}-{index}",
                    engine_url=engine_url,
                    model_path=model_path,
                    chat_format=chat_format,
                    limits=limits or SessionLimits(),
                    engine_is_router=engine_is_router,
                )
                workers.append(await provider.start(spec))
        except BaseException:
            for worker in workers:
                await provider.stop(worker.name)
            raise
        return cls(provider, workers)

    async def stop(self) -> None:
        await self._http.aclose()
        for worker in self.workers:
            await self.provider.stop(worker.name)

    def pick(self) -> str:
        """The URL of the server the next session goes to (in turn)."""
        return self.workers[next(self._next)].url

    async def create(
        self,
        server: str,
        *,
        sampling: dict[str, Any],
        metadata: dict[str, Any],
        engine_url: str,
        engine_is_router: bool = False,
    ) -> tuple[str, str]:
        """A new session on ``server``: its id and ``base_url`` (what the agent's OpenAI client is given)."""
        body = {
            "messages": [],
            "sampling": sampling,
            "metadata": metadata,
            "engine_url": engine_url,
            "engine_is_router": engine_is_router,
        }
        answer = await self._call("POST", f"{server}/sessions", json=body)
        return answer["session_id"], answer["base_url"]

    async def finish(self, server: str, session_id: str) -> list[Trajectory]:
        """End the session and its forks; their final trajectories, the session's first, then the forks' in the
        order they were made."""
        body = await self._call("DELETE", f"{server}/sessions/{session_id}")
        return [_trajectory(body["trajectory"]), *(_trajectory(branch) for branch in body.get("branches", []))]

    async def _call(self, method: str, url: str, **kwargs: Any) -> dict[str, Any]:
        answer = await self._http.request(method, url, **kwargs)
        if answer.status_code != 200:
            raise SessionError(f"{method} {url}: HTTP {answer.status_code}: {answer.text[:300]}")
        return answer.json()


def _trajectory(body: dict[str, Any]) -> Trajectory:
    turns = [Turn(**turn) for turn in body.pop("turns")]
    body.pop("finish_reasons", None)
    return Trajectory(**body, turns=turns)
