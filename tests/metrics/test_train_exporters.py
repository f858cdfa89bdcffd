"""``miles train --metrics prometheus,tensorboard`` as a user runs it: a probe plugin scrapes the endpoint during the
run, the event files are read back after it, and both must equal ``metrics.jsonl``."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("prometheus_client", reason="prometheus-client is not installed (pip install -e '.[test]')")
event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard is not installed (pip install -e '.[test]')",
)

from tests.test_train import QUICK, metrics, train  # noqa: E402

pytestmark = pytest.mark.slow

PROBE = """
import json
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from miles_core import hookimpl

RUN_DIR = []
SCRAPES = []


@hookimpl
def on_run_start(config, run_dir, start_step):
    RUN_DIR.append(Path(run_dir))


@hookimpl(trylast=True)  # after the exporter took this step's metrics
def on_metrics(step, metrics):
    url = (RUN_DIR[0] / "prometheus.url").read_text().strip()
    with urllib.request.urlopen(url, timeout=60) as response:
        families = list(text_string_to_metric_families(response.read().decode()))
    SCRAPES.append({
        "step": step,
        "url": url,
        "metrics": {f.documentation.removeprefix("miles metric "): f.samples[0].value for f in families
                    if f.documentation.startswith("miles metric ")},
        "names": {f.documentation.removeprefix("miles metric "): f.name for f in families
                  if f.documentation.startswith("miles metric ")},
        "samples": {s.name + json.dumps(s.labels, sort_keys=True): s.value for f in families for s in f.samples
                    if not f.documentation.startswith("miles metric ")},
    })
    (RUN_DIR[0] / "scrapes.json").write_text(json.dumps(SCRAPES))
"""


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def test_both_exporters_export_every_metric_of_the_run(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    run_dir = tmp_path / "run"
    result = train(run_dir, *QUICK, "--num-steps", "3", "--metrics", "prometheus,tensorboard", "--plugin", str(probe))
    rows = {row["step"]: row for row in metrics(run_dir)}
    assert sorted(rows) == [0, 1, 2, 3]  # the eval before training, then the steps
    scrapes = json.loads((run_dir / "scrapes.json").read_text())
    assert [scrape["step"] for scrape in scrapes] == [1, 2, 3]
    url = scrapes[0]["url"]
    assert f"miles: Prometheus metrics at {url}" in result.stdout and url.startswith("http://127.0.0.1:")
    check_scrapes(scrapes, rows)
    with pytest.raises(urllib.error.URLError):  # the endpoint stopped with the run
        urllib.request.urlopen(url, timeout=30)
    check_event_files(run_dir / "tensorboard", rows)
    assert f"miles: TensorBoard event files in {run_dir / 'tensorboard'}" in result.stdout


def check_scrapes(scrapes: list[dict], rows: dict[int, dict]) -> None:
    """Each step's scrape holds exactly that step's metrics (and the latest eval's), to the last bit."""
    for scrape in scrapes:
        step, row = scrape["step"], rows[scrape["step"]]
        expected = {**rows[0], **row}  # the eval metrics: the latest eval's (step 0, or this step's)
        # time: the reporter's own; labels: the step's facts that are not numbers (the protocol, checked below)
        expected = {k: v for k, v in expected.items() if k not in ("step", "time", "labels")}
        assert set(scrape["metrics"]) == set(expected), step
        for name, value in expected.items():
            assert same(scrape["metrics"][name], float(value)), (step, name, scrape["metrics"][name], value)
        samples = scrape["samples"]
        assert samples["miles_step{}"] == step and samples["miles_weight_version{}"] == step
        assert samples["miles_weight_updates_total{}"] == step
        assert samples["miles_weight_update_bytes_total{}"] > 0
        protocol = row["labels"]["weight_transfer/protocol"]  # the same in metrics.jsonl and in Prometheus
        assert protocol.startswith("auto/") and samples[f'miles_weight_transfer_info{{"protocol": "{protocol}"}}'] == 1
        for phase in ("rollout", "train", "weight_update"):
            assert samples[f'miles_phase_seconds_count{{"phase": "{phase}"}}'] == step
        assert samples['miles_phase_seconds_count{"phase": "eval"}'] == (2 if step == 3 else 1)
    assert scrapes[0]["names"]["rollout/reward_mean"] == "miles_rollout_reward_mean"
    assert scrapes[0]["names"]["eval/reward_mean"] == "miles_eval_reward_mean"


def check_event_files(log_dir: Path, rows: dict[int, dict]) -> None:
    """The event files hold one scalar per metric per step, each the metrics.jsonl value rounded to float32 (the
    type TensorBoard stores a scalar in: the only difference allowed)."""
    accumulator = event_accumulator.EventAccumulator(str(log_dir), size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    written = {
        (tag, event.step): event.value for tag in accumulator.Tags()["scalars"] for event in accumulator.Scalars(tag)
    }
    count = sum(len(accumulator.Scalars(tag)) for tag in accumulator.Tags()["scalars"])
    expected = {
        (name, step): value
        for step, row in rows.items()
        for name, value in row.items()
        if name not in ("step", "time", "labels")
    }
    assert count == len(written) == len(expected)  # each once: the eval's metrics are not written twice
    assert set(written) == set(expected)
    for key, value in expected.items():
        assert same(written[key], float(np.float32(value))), (key, written[key], value)
    assert ("eval/reward_mean", 0) in written and ("train/loss", 1) in written
