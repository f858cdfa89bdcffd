"""The Prometheus exporter's endpoint, scraped over real HTTP on 127.0.0.1: what it serves, what it refuses, and
that it stops."""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

parser = pytest.importorskip(
    "prometheus_client.parser", reason="prometheus-client is not installed (pip install -e '.[test]' installs it)"
)

from miles_core.builtin.metrics.plugin import MetricsPlugin  # noqa: E402
from miles_core.builtin.metrics.prometheus import PrometheusExporter, prometheus_name  # noqa: E402
from miles_core.config.build import config_model  # noqa: E402
from miles_core.plugin_manager import MilesPluginManager  # noqa: E402
from miles_core.weight_transfer import TransferReport  # noqa: E402


@pytest.fixture
def exporter() -> Iterator[PrometheusExporter]:
    exporter = PrometheusExporter(host="127.0.0.1", port=0)
    exporter.start(start_step=0)
    yield exporter
    exporter.close()


def scrape(url: str) -> dict[str, object]:
    response = httpx.get(url, timeout=30)
    assert response.status_code == 200, response.text
    return {family.name: family for family in parser.text_string_to_metric_families(response.text)}


def test_every_metric_is_a_gauge_with_its_latest_value(exporter: PrometheusExporter) -> None:
    exporter.metrics(1, {"rollout/reward_mean": 0.25, "train/loss": -1.5e-7, "note": "text is skipped"})
    exporter.metrics(2, {"rollout/reward_mean": 0.0625, "train/grad_norm": float("nan"), "flag": True})
    families = scrape(exporter.url)
    assert families["miles_rollout_reward_mean"].samples[0].value == 0.0625  # the latest step's
    assert families["miles_rollout_reward_mean"].documentation == "miles metric rollout/reward_mean"
    assert families["miles_rollout_reward_mean"].type == "gauge"
    assert families["miles_train_loss"].samples[0].value == -1.5e-7  # exact: the text format writes repr(float)
    assert math.isnan(families["miles_train_grad_norm"].samples[0].value)
    assert families["miles_flag"].samples[0].value == 1.0
    assert families["miles_step"].samples[0].value == 2
    assert not any(name.startswith("miles_note") for name in families)


def test_names_that_clash_after_sanitizing_stay_apart(exporter: PrometheusExporter) -> None:
    exporter.metrics(1, {"a/b": 1.0, "a-b": 2.0, "step": 3.0, "é": 4.0, "phase_seconds_count": 5.0})
    families = scrape(exporter.url)
    helps = {family.documentation: name for name, family in families.items()}
    assert helps["miles metric a/b"] == "miles_a_b" and helps["miles metric a-b"] == "miles_a_b_2"
    assert helps["miles metric step"] == "miles_step_2"  # miles_step is the exporter's own
    assert families["miles_step"].samples[0].value == 1
    assert helps["miles metric phase_seconds_count"] == "miles_phase_seconds_count_2"  # the histogram's _count
    assert prometheus_name("é", set()) == "miles_metric"


def test_phases_and_weight_updates(exporter: PrometheusExporter) -> None:
    exporter.phase(1, "rollout", 0.3)
    exporter.phase(2, "rollout", 20.0)
    exporter.eval(2, {"eval/reward_mean": 0.5}, 1.5)
    exporter.weight_update(1, TransferReport("tensor", 1, 2_000_000, 0.5, 1))
    exporter.weight_update(2, TransferReport("auto/tensor", 2, 2_000_000, 0.25, 1))
    families = scrape(exporter.url)
    samples = {
        (s.name, s.labels.get("phase"), s.labels.get("le")): s.value for s in families["miles_phase_seconds"].samples
    }
    assert samples[("miles_phase_seconds_count", "rollout", None)] == 2
    assert samples[("miles_phase_seconds_sum", "rollout", None)] == 20.3
    assert samples[("miles_phase_seconds_bucket", "rollout", "0.5")] == 1
    assert samples[("miles_phase_seconds_count", "eval", None)] == 1
    assert families["miles_eval_reward_mean"].samples[0].value == 0.5
    updates = {
        s.name: s.value
        for name in ("miles_weight_updates", "miles_weight_update_bytes", "miles_weight_update_seconds")
        for s in families[name].samples
        if s.name.endswith("_total")
    }
    assert updates == {
        "miles_weight_updates_total": 2,
        "miles_weight_update_bytes_total": 4_000_000,
        "miles_weight_update_seconds_total": 0.75,
    }
    assert families["miles_weight_version"].samples[0].value == 2
    (info,) = families["miles_weight_transfer_info"].samples  # the last update's protocol, as auto chose it
    assert info.labels == {"protocol": "auto/tensor"} and info.value == 1


def test_a_private_registry_holds_nothing_else(exporter: PrometheusExporter) -> None:
    """Not the global registry: no process_ or python_ collectors, nor another exporter's metrics."""
    other = PrometheusExporter(host="127.0.0.1", port=0)
    try:
        other.start(start_step=0)
        other.metrics(1, {"only/here": 1.0})
        assert {name for name in scrape(exporter.url) if not name.startswith("miles_")} == set()
        assert "miles_only_here" not in scrape(exporter.url)
    finally:
        other.close()


@pytest.mark.parametrize(
    ("method", "path", "headers", "status", "message"),
    [
        ("GET", "/metrics", {"host": "evil.example:80"}, 421, "is not a name this endpoint serves"),
        ("POST", "/metrics", {}, 405, "the metrics endpoint is read-only"),
        ("DELETE", "/metrics", {}, 405, "the metrics endpoint is read-only"),
        ("GET", "/", {}, 404, "the metrics are at /metrics"),
        ("GET", "/metrics/../etc/passwd", {}, 404, "the metrics are at /metrics"),
    ],
)
def test_requests_it_does_not_answer(exporter: PrometheusExporter, method, path, headers, status, message) -> None:
    base = exporter.url.removesuffix("/metrics")
    response = httpx.request(method, base + path, headers=headers, timeout=30)
    assert response.status_code == status
    assert message in response.text


def test_a_query_that_is_not_utf8_is_refused_or_ignored(exporter: PrometheusExporter) -> None:
    """Raw non-ASCII bytes are a 400 (from the HTTP parser); percent-encoded ones filter by no name; never a 500."""
    port = int(exporter.url.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(b"GET /metrics?name[]=\xff\xfe HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n\r\n" % port)
        answer = b"".join(iter(lambda: conn.recv(65536), b""))
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    response = httpx.get(exporter.url + "?name[]=%ff%fe", timeout=30)
    assert (response.status_code, response.text) == (200, "")
    assert scrape(exporter.url)  # and the endpoint still answers


def test_name_filter_of_prometheus_client_works(exporter: PrometheusExporter) -> None:
    exporter.metrics(1, {"train/loss": 1.0, "train/kl": 2.0})
    response = httpx.get(exporter.url, params={"name[]": "miles_train_kl"}, timeout=30)
    assert set(f.name for f in parser.text_string_to_metric_families(response.text)) == {"miles_train_kl"}


def test_close_frees_the_port() -> None:
    exporter = PrometheusExporter(host="127.0.0.1", port=0)
    exporter.start(start_step=0)
    url = exporter.url
    scrape(url)
    exporter.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, timeout=30)


def test_a_taken_port_warns_and_the_run_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """As with the dashboard, exporting never stops training: the plugin warns and exports nothing."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        metrics = {"exporters": ["prometheus"], "prometheus_host": "127.0.0.1", "prometheus_port": port}
        config = config_model(MilesPluginManager.load(environ={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})).model_validate(
            {"metrics": metrics}
        )
        plugin = MetricsPlugin()
        with caplog.at_level(logging.WARNING, logger="miles.metrics"):
            plugin.on_run_start(config=config, run_dir=tmp_path, start_step=0)
        assert plugin.exporters == {}
        assert "metrics: starting the prometheus exporter failed: OSError" in caplog.text
        assert "training goes on" in caplog.text
        plugin.on_metrics(step=1, metrics={"a": 1.0})  # nothing to feed, nothing raised
        plugin.on_run_end(status="finished", error=None)
