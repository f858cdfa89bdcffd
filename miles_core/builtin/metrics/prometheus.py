"""The Prometheus exporter (``--metrics prometheus``): a scrape endpoint with every metric of the run.

What it serves, from a registry of its own (never prometheus-client's global one, which would also export this
process's and other libraries' collectors):

* one gauge per metric of ``on_metrics`` and ``on_eval`` (registered at its first value), named ``miles_`` + the
  metric name with every run of characters outside ``[a-zA-Z0-9_]`` replaced by ``_`` (``rollout/reward_mean`` is
  ``miles_rollout_reward_mean``; a name taken already gets ``_2``); its help text is ``miles metric NAME``, the
  name as in ``metrics.jsonl``. One gauge per metric rather than one family with a ``metric`` label: Prometheus
  names a kind of quantity by its metric name, and a sum over a label must mean something (a reward plus a loss
  does not);
* ``miles_step`` (the last step whose metrics were reported) and ``miles_weight_version``;
* ``miles_phase_seconds{phase=...}``: a histogram of the phase durations (rollout, train, weight_update, eval,
  checkpoint);
* ``miles_weight_updates_total``, ``miles_weight_update_bytes_total``, ``miles_weight_update_seconds_total``.

It is served by prometheus-client's own ASGI app, under uvicorn with the project's bounded protocol
(:class:`miles_core.http.BoundedHttpProtocol`) rather than prometheus-client's ``start_http_server``: that one is a
thread per connection with no deadline (a client that sends half a request holds its thread), answers any ``Host``
(a web page that rebinds its domain name to 127.0.0.1 could read it) and binds 0.0.0.0 by default. Only
``GET``/``HEAD /metrics`` is answered, to a ``Host`` naming the endpoint.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles_core.builtin.dashboard import hosts
from miles_core.builtin.metrics.values import numeric
from miles_core.errors import MilesError
from miles_core.http import BackgroundServer
from miles_core.workers.process import listening_socket

try:
    import prometheus_client
except ImportError:  # an optional dependency: the exporter names the package when it is missing
    prometheus_client = None

PACKAGE = "prometheus-client"
PATH = "/metrics"
PREFIX = "miles_"
PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, math.inf)
"""Phase durations, in seconds: from a tiny model's 10 ms phases to a large checkpoint's half hour."""
FIXED_NAMES = frozenset(
    {
        "miles_step",
        "miles_weight_version",
        "miles_phase_seconds",
        "miles_weight_updates",
        "miles_weight_update_bytes",
        "miles_weight_update_seconds",
    }
)
KEEP_ALIVE_S = 5
START_TIMEOUT_S = 30.0


def require_prometheus_client() -> None:
    """Raise a :class:`MilesError` naming the package to install when prometheus-client is missing."""
    if prometheus_client is None:
        raise MilesError(
            f"metrics.exporters (--metrics) names prometheus, which needs the package {PACKAGE}: "
            f"pip install {PACKAGE} (or miles-core[metrics])"
        )


def prometheus_name(name: str, taken: set[str]) -> str:
    """A Prometheus metric name for the metric ``name``, not in ``taken`` (a clash gets ``_2``, ``_3``, ...)."""
    base = PREFIX + (re.sub(r"[^a-zA-Z0-9_]+", "_", name).strip("_") or "metric")
    candidate, number = base, 2
    while candidate in taken or candidate in FIXED_NAMES:
        candidate, number = f"{base}_{number}", number + 1
    return candidate


class LatestValues:
    """The latest value of every metric the run reported: one gauge each, registered at the metric's first value
    (so the registry knows every name: prometheus-client's ``name[]`` filter works, and a clash is found)."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry
        self.gauges: dict[str, Any] = {}  # metric name -> its gauge
        self.taken: set[str] = set()

    def update(self, metrics: Mapping[str, Any]) -> None:
        for name, value in numeric(metrics).items():
            gauge = self.gauges.get(name) or self._new_gauge(name)
            gauge.set(value)

    def _new_gauge(self, name: str) -> Any:
        while True:
            prom_name = prometheus_name(name, self.taken)
            self.taken.add(prom_name)
            try:
                gauge = prometheus_client.Gauge(prom_name, f"miles metric {name}", registry=self.registry)
            except ValueError:  # a name the registry holds already (a histogram's _count, say): the next one
                continue
            self.gauges[name] = gauge
            return gauge


class PrometheusExporter:
    """The run's metrics in a private registry, served at ``http://HOST:PORT/metrics`` from the constructor on (the
    socket is bound there: a taken port is an ``OSError``) until :meth:`close`."""

    def __init__(self, *, host: str, port: int) -> None:
        require_prometheus_client()
        self.registry = prometheus_client.CollectorRegistry()
        self.latest = LatestValues(self.registry)
        metric = {"registry": self.registry}  # every metric in this registry, none in the global one
        self.step = prometheus_client.Gauge("miles_step", "the last step whose metrics were reported", **metric)
        self.version = prometheus_client.Gauge("miles_weight_version", "the weight version the engines hold", **metric)
        self.phases = prometheus_client.Histogram(
            "miles_phase_seconds", "duration of a phase of a step, seconds", ["phase"], buckets=PHASE_BUCKETS, **metric
        )
        self.updates = prometheus_client.Counter("miles_weight_updates", "weight updates published", **metric)
        self.update_bytes = prometheus_client.Counter("miles_weight_update_bytes", "bytes of weights sent", **metric)
        self.update_seconds = prometheus_client.Counter(
            "miles_weight_update_seconds", "seconds of weight updates", **metric
        )
        self.protocol = prometheus_client.Info(
            "miles_weight_transfer", "the protocol of the last weight update (auto/<chosen>)", **metric
        )
        self.server = _EndpointServer(prometheus_client.make_asgi_app(self.registry), host=host, port=port)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self, *, start_step: int) -> None:
        self.step.set(start_step)
        self.version.set(start_step)
        self.server.start()

    def resume(self, from_step: int) -> None:
        """Nothing to drop: the endpoint holds only the latest values of this process, no history. What a Prometheus
        server scraped from the interrupted run stays in its time series, which are keyed by time, not by step."""

    def metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.latest.update(metrics)
        self.step.set(step)

    def eval(self, step: int, metrics: Mapping[str, Any], seconds: float) -> None:
        self.latest.update(metrics)
        self.phases.labels(phase="eval").observe(seconds)

    def phase(self, step: int, phase: str, seconds: float) -> None:
        self.phases.labels(phase=phase).observe(seconds)

    def weight_update(self, version: int, report: Any) -> None:
        self.updates.inc()
        self.protocol.info({"protocol": str(report.protocol)})
        self.update_bytes.inc(max(int(report.num_bytes), 0))
        self.update_seconds.inc(max(float(report.seconds), 0.0))
        self.version.set(version)

    def close(self, status: str = "finished") -> None:
        self.server.stop()


class _EndpointServer:
    """prometheus-client's ASGI app behind the ``Host``, method and path checks, served by uvicorn in a daemon
    thread."""

    def __init__(self, app: Any, *, host: str, port: int) -> None:
        self.host = host
        self.prometheus_app = app
        self.socket = listening_socket(host, port)
        self.port = self.socket.getsockname()[1]
        self.allowed_names = hosts.allowed_host_names(host)
        self.background = BackgroundServer(
            self,
            self.socket,
            what=f"the Prometheus endpoint {self.url}",
            thread_name="miles-prometheus",
            keep_alive_s=KEEP_ALIVE_S,
            start_timeout_s=START_TIMEOUT_S,
        )

    @property
    def url(self) -> str:
        name = "127.0.0.1" if self.host in hosts.WILDCARD_HOSTS else hosts.url_name(self.host)
        return f"http://{name}:{self.port}{PATH}"

    def start(self) -> None:
        self.background.start()

    def stop(self) -> None:
        self.background.stop()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        refusal = self._refusal(scope)
        if refusal is None:
            await self.prometheus_app(scope, receive, send)
            return
        status, message, extra = refusal
        body = (message + "\n").encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"text/plain; charset=utf-8"),
                    (b"content-length", str(len(body)).encode()),
                    *extra,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _refusal(self, scope: dict[str, Any]) -> tuple[int, str, list[tuple[bytes, bytes]]] | None:
        """``(status, message, headers)`` for a request this endpoint does not answer, else ``None``."""
        host = next((value.decode("latin-1") for name, value in scope["headers"] if name == b"host"), None)
        if not hosts.host_header_matches(host, names=self.allowed_names, port=self.port):
            served = ", ".join(f"{name}:{self.port}" for name in sorted(self.allowed_names))
            return 421, f"Host {(host or '')[:100]!r} is not a name this endpoint serves ({served})", []
        if scope["method"] not in ("GET", "HEAD"):
            return (
                405,
                f"method {scope['method'][:20]} not allowed: the metrics endpoint is read-only (GET)",
                [(b"allow", b"GET, HEAD")],
            )
        if scope["path"] != PATH:
            return 404, f"no such path {scope['path'][:200]!r}: the metrics are at {PATH}", []
        try:
            scope["query_string"].decode("utf-8")  # prometheus-client decodes it, and fails on other bytes
        except UnicodeDecodeError:
            return 400, "the query string is not UTF-8 (the endpoint takes name[]=METRIC filters, or none)", []
        return None


def write_url_file(run_dir: Path, url: str) -> Path:
    """``RUN_DIR/prometheus.url``: the endpoint's URL, for scrape configs and scripts (the port may be a free one)."""
    path = run_dir / "prometheus.url"
    path.write_text(url + "\n")
    return path
