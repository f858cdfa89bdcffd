"""Keeping an sglang-router's worker list equal to the run's engines, over the router's HTTP API.

``POST /workers {"url"}`` answers 202 with a ``worker_id`` and registers in the background (the router checks the
worker's health, server and model info first); ``GET /workers`` lists the workers registered so far;
``DELETE /workers/<worker_id>`` removes one. The registrar remembers the id of every URL it added. These routes
take the run's token as the router's control-plane admin key (``--control-plane-api-keys``): without it, the router
answers 401.
"""

from __future__ import annotations

import time

import httpx

from miles_core import MilesError


class RouterRegistrar:
    """Registers and removes engines on one router; :meth:`sync` makes the router route to exactly ``urls``."""

    def __init__(self, url: str, *, admin_key: str = "", timeout_s: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.client = httpx.Client(base_url=self.url, timeout=10.0, headers=headers)
        self.worker_ids: dict[str, str] = {}  # engine URL -> the router's worker id

    def registered_urls(self) -> set[str]:
        """The URLs the router routes to now."""
        response = self.client.get("/workers")
        response.raise_for_status()
        return {worker["url"].rstrip("/") for worker in response.json()["workers"]}

    def sync(self, urls: list[str]) -> None:
        """Add the engines in ``urls`` the router lacks, remove the ones not in ``urls``, and wait until the router
        lists exactly ``urls`` (a :class:`MilesError` after ``timeout_s``)."""
        wanted = {url.rstrip("/") for url in urls}
        for url in sorted(set(self.worker_ids) - wanted):
            self.client.delete(f"/workers/{self.worker_ids.pop(url)}").raise_for_status()
        for url in sorted(wanted - set(self.worker_ids)):
            response = self.client.post("/workers", json={"url": url})
            if response.status_code not in (200, 202):
                raise MilesError(f"router {self.url} refused engine {url}: {response.status_code} {response.text}")
            self.worker_ids[url] = response.json()["worker_id"]
        self._wait_until(wanted)

    def _wait_until(self, wanted: set[str]) -> None:
        deadline = time.monotonic() + self.timeout_s
        while (listed := self.registered_urls()) != wanted:
            if time.monotonic() > deadline:
                raise MilesError(
                    f"router {self.url} lists {sorted(listed)} after {self.timeout_s:.0f} s, expected {sorted(wanted)}"
                )
            time.sleep(0.1)

    def close(self) -> None:
        self.client.close()
