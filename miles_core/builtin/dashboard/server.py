"""The dashboard's HTTP server: the JSON API (:mod:`miles_core.builtin.dashboard.api`), the page and its scripts.

An ASGI app served by uvicorn (asyncio: a slow or idle connection costs a socket, not a thread, so a flood of slow
clients does not keep anyone else waiting; a client that does not send its request head within 10 s, or idles on a
keep-alive connection for 5 s, is disconnected: :class:`miles_core.http.BoundedHttpProtocol`). The dashboard is
read-only and small, runs inside the training process (``miles train --dashboard``, in a daemon thread) or on its
own (``miles dashboard RUN_DIR``), and must work with no network, so everything it serves ships in this package
(``static/``).

It binds 127.0.0.1 unless told otherwise (an empty host is refused), and answers only requests whose ``Host``
names it (:mod:`.hosts`: a page that rebinds its own domain name to 127.0.0.1 cannot read the
run's config and samples).

Every view of the page has its own URL (``/samples/3/12/1`` is step 3's sample with index 12, occurrence 1); the
server answers each of them with the page, which renders the view the URL names.
"""

from __future__ import annotations

import asyncio
import json
import logging
import mimetypes
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

from miles_core.builtin.dashboard import hosts
from miles_core.builtin.dashboard.api import DashboardApi
from miles_core.builtin.dashboard.store import DashboardDatabaseError, db_path
from miles_core.http import BackgroundServer
from miles_core.workers.process import listening_socket

logger = logging.getLogger("miles.dashboard")

PAGE_ROUTES = re.compile(r"/(|topology|charts|timeline|samples(/[0-9]{1,9}(/[0-9]{1,9}/[0-9]{1,9})?)?)")
"""The page's views: ``/``, ``/topology``, ``/charts``, ``/timeline``, ``/samples[/STEP[/INDEX/OCCURRENCE]]``
(ASCII digits only: ``int`` would read other scripts' digits too)."""

KEEP_ALIVE_S = 5
"""An idle keep-alive connection is closed after this many seconds."""
START_TIMEOUT_S = 30.0

Scope = dict[str, Any]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def static_files() -> dict[str, tuple[bytes, str]]:
    """Every file of ``static/`` by name, with its content type (read once: nothing on disk is looked up by a
    requested path)."""
    files = {}
    for entry in resources.files("miles_core.builtin.dashboard").joinpath("static").iterdir():
        if entry.is_file():
            content_type = mimetypes.guess_type(entry.name)[0] or "application/octet-stream"
            if content_type.startswith("text/") or content_type.endswith("javascript"):
                content_type += "; charset=utf-8"
            files[entry.name] = (entry.read_bytes(), content_type)
    return files


class DashboardServer:
    """Serves the dashboard of the run in ``run_dir`` on ``host:port`` (port 0: a free port). The socket is bound
    here, so a taken port is an ``OSError`` of the constructor, and an empty host a
    :class:`~miles_core.builtin.dashboard.hosts.DashboardHostError`."""

    def __init__(self, run_dir: Path | str, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.run_dir = Path(run_dir)
        self.host = hosts.check_host(host)
        self.app = DashboardApp(DashboardApi(db_path(self.run_dir)), static_files())
        self.socket = listening_socket(self.host, port)
        self.port = self.socket.getsockname()[1]
        self.app.allowed_names = hosts.allowed_host_names(self.host)
        self.app.port = self.port
        if not hosts.is_loopback_host(self.host):
            logger.warning("dashboard: serving on %s: reachable from other machines, with no authentication", host)
        self.background = BackgroundServer(
            self.app,
            self.socket,
            what=f"the dashboard server on {self.url}",
            thread_name="miles-dashboard",
            keep_alive_s=KEEP_ALIVE_S,
            start_timeout_s=START_TIMEOUT_S,
        )

    @property
    def url(self) -> str:
        name = "127.0.0.1" if self.host in hosts.WILDCARD_HOSTS else hosts.url_name(self.host)
        return f"http://{name}:{self.port}/"

    def start(self) -> DashboardServer:
        """Serve in a daemon thread (inside a training run); returns once it answers."""
        self.background.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until SIGINT or SIGTERM (``miles dashboard``); the signal is raised again once the
        server has stopped, so the handler in place before (``KeyboardInterrupt``) still runs."""
        self.background.run()

    def stop(self) -> None:
        self.background.stop()


class DashboardApp:
    """The ASGI app: the ``Host`` check, then the API, the static files and the page's views (``GET``/``HEAD``)."""

    def __init__(self, api: DashboardApi, files: dict[str, tuple[bytes, str]]) -> None:
        self.api = api
        self.files = files
        self.allowed_names: frozenset[str] = frozenset(hosts.LOOPBACK_NAMES)
        self.port = 0

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[dict]], send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            status, body, content_type, headers = await asyncio.to_thread(self.answer, scope)
        except Exception as exc:  # a bug must answer as JSON, and never stop the server (or a training run)
            logger.warning(
                "dashboard: %s %s failed: %s: %s", scope["method"], scope["path"][:200], type(exc).__name__, exc
            )
            status, body, content_type, headers = _json(500, {"error": f"internal error: {type(exc).__name__}: {exc}"})
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type.encode()),
                    (b"content-length", str(len(body)).encode()),
                    (b"x-content-type-options", b"nosniff"),
                    *headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    def answer(self, scope: Scope) -> tuple[int, bytes, str, list[tuple[bytes, bytes]]]:
        """``(status, body, content type, extra headers)`` for one request."""
        host = next((value.decode("latin-1") for name, value in scope["headers"] if name == b"host"), None)
        if not hosts.host_header_matches(host, names=self.allowed_names, port=self.port):
            served = ", ".join(f"{name}:{self.port}" for name in sorted(self.allowed_names))
            return _json(
                421,
                {
                    "error": f"Host {(host or '')[:100]!r} is not a name this dashboard serves ({served}); "
                    f"open http://127.0.0.1:{self.port}/ on this machine"
                },
            )
        if scope["method"] not in ("GET", "HEAD"):
            status, body, content_type, headers = _json(
                405, {"error": f"method {scope['method'][:20]} not allowed: the dashboard is read-only (GET)"}
            )
            return status, body, content_type, [*headers, (b"allow", b"GET, HEAD")]
        path = scope["path"]
        if path.startswith("/api/"):
            query = urllib.parse.parse_qs(scope["query_string"].decode("latin-1"))
            try:
                return _json(*self.api.answer(path, query))
            except DashboardDatabaseError as exc:  # the database went bad while serving
                return _json(503, {"error": str(exc)})
        name = path[len("/static/") :] if path.startswith("/static/") else None
        if name in self.files:
            body, content_type = self.files[name]
            return 200, body, content_type, [(b"cache-control", b"max-age=60")]
        if PAGE_ROUTES.fullmatch(path):
            body, content_type = self.files["index.html"]
            return 200, body, content_type, [(b"cache-control", b"no-store")]
        return _json(404, {"error": f"no such page {path[:200]!r}"})


def _json(status: int, body: dict[str, Any]) -> tuple[int, bytes, str, list[tuple[bytes, bytes]]]:
    return status, json.dumps(body).encode(), "application/json", [(b"cache-control", b"no-store")]
