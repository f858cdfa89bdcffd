"""The dashboard's HTTP server: the JSON API (:mod:`miles_core.dashboard.api`), the page and its scripts.

A standard-library ``ThreadingHTTPServer``: the dashboard is read-only and small, runs inside the training process
(``miles train --dashboard``, in a daemon thread) or on its own (``miles dashboard RUN_DIR``), and must work with no
network, so everything it serves ships in this package (``static/``). It binds 127.0.0.1 unless told otherwise.

Every view of the page has its own URL (``/samples/3/12/1`` is step 3's sample with index 12, occurrence 1); the
server answers each of them with the page, which renders the view the URL names.
"""

from __future__ import annotations

import http.server
import json
import logging
import mimetypes
import re
import threading
import urllib.parse
from importlib import resources
from pathlib import Path
from typing import Any

from miles_core.dashboard.api import DashboardApi
from miles_core.dashboard.store import DashboardDatabaseError, db_path

logger = logging.getLogger("miles.dashboard")

PAGE_ROUTES = re.compile(r"/(|topology|charts|timeline|samples(/\d{1,9}(/\d{1,9}/\d{1,9})?)?)")
"""The page's views: ``/``, ``/topology``, ``/charts``, ``/timeline``, ``/samples[/STEP[/INDEX/OCCURRENCE]]``."""


def static_files() -> dict[str, tuple[bytes, str]]:
    """Every file of ``static/`` by name, with its content type (read once: nothing on disk is looked up by a
    requested path)."""
    files = {}
    for entry in resources.files("miles_core.dashboard").joinpath("static").iterdir():
        if entry.is_file():
            content_type = mimetypes.guess_type(entry.name)[0] or "application/octet-stream"
            if content_type.startswith("text/") or content_type.endswith("javascript"):
                content_type += "; charset=utf-8"
            files[entry.name] = (entry.read_bytes(), content_type)
    return files


class DashboardServer:
    """Serves the dashboard of the run in ``run_dir`` on ``host:port`` (port 0: a free port)."""

    def __init__(self, run_dir: Path | str, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.run_dir = Path(run_dir)
        handler = type("Handler", (_Handler,), {"api": DashboardApi(db_path(self.run_dir)), "files": static_files()})
        self.httpd = http.server.ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> DashboardServer:
        """Serve in a daemon thread (inside a training run)."""
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="miles-dashboard", daemon=True)
        self.thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until interrupted (``miles dashboard``)."""
        try:
            self.httpd.serve_forever()
        finally:
            self.httpd.server_close()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.thread is not None:
            self.thread.join(timeout=5)


class _Handler(http.server.BaseHTTPRequestHandler):
    api: DashboardApi
    files: dict[str, tuple[bytes, str]]
    server_version = "miles-dashboard"

    def do_GET(self) -> None:
        try:
            self._get()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the browser went away
        except Exception as exc:  # a bug must answer as JSON, and never stop the server (or a training run)
            logger.warning("dashboard: %s %s failed: %s: %s", self.command, self.path, type(exc).__name__, exc)
            self._json(500, {"error": f"internal error: {type(exc).__name__}: {exc}"})

    def _get(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(url.path)
        if path.startswith("/api/"):
            try:
                status, body = self.api.answer(path, urllib.parse.parse_qs(url.query))
            except DashboardDatabaseError as exc:  # the database went bad while serving
                status, body = 503, {"error": str(exc)}
            self._json(status, body)
        elif path.startswith("/static/") and path[len("/static/") :] in self.files:
            self._send(200, *self.files[path[len("/static/") :]], cache="max-age=60")
        elif PAGE_ROUTES.fullmatch(path):
            self._send(200, *self.files["index.html"])
        else:
            self._json(404, {"error": f"no such page {path[:200]!r}"})

    def _json(self, status: int, body: dict[str, Any]) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str, *, cache: str = "no-store") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", cache)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("dashboard: " + format, *args)
