"""The dashboard in a real headless Chromium (Debian's, driven by Playwright): charts with data points, the sample
browser showing the run's samples, deep links, the empty state; screenshots saved to tests/artifacts/."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from miles_core.builtin.dashboard.store import DashboardStore
from miles_core.rollout.prompts import Prompt
from miles_core.rollout.samples import Sample
from tests.conftest import REPO
from tests.dashboard.browser import browser_page, wait_for_view
from tests.dashboard.conftest import RUN_STEPS, FinishedRun

ARTIFACTS = REPO / "tests" / "artifacts"
pytestmark = pytest.mark.slow  # a short real run, then Chromium
CHARTS = ("reward", "loss", "kl", "entropy", "step-time", "transfer")


def test_dashboard_of_a_finished_run_in_chromium(finished_run: FinishedRun, serve, tmp_path: Path) -> None:
    url = serve(finished_run.run_dir)
    last = RUN_STEPS  # steps as in the terminal: 0 (the eval before training), 1..RUN_STEPS
    api_samples = httpx.get(f"{url}api/steps/{last}/samples").json()["samples"]
    with browser_page() as page:
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(url)
        wait_for_view(page, "overview")
        points = {chart: int(page.get_attribute(f"#chart-{chart}", "data-points")) for chart in CHARTS}
        assert all(count >= RUN_STEPS for count in points.values()), points
        assert page.locator("#chart-loss circle.point").count() == RUN_STEPS
        assert page.locator("#chart-step-time path.line").count() >= 4  # step, rollout, train, weight_update
        engine = page.locator("[data-cell='engine-0']")
        assert engine.locator("[data-field='weight-version']").inner_text() == f"weight version: {RUN_STEPS}"
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-overview.png"), full_page=True)

        page.click("nav a[data-view='samples']")  # the latest step's samples
        wait_for_view(page, "samples")
        assert page.url == f"{url}samples/{last}"
        rows = page.locator("#samples tbody tr")
        assert rows.count() == len(api_samples) == 16
        assert [rows.nth(i).get_attribute("data-key") for i in range(rows.count())] == [
            f"{s['sample_index']}.{s['occurrence']}" for s in api_samples
        ]
        texts = [rows.nth(i).locator("td.text").all_inner_texts() for i in range(rows.count())]
        assert texts == [[s["prompt"], s["response"]] for s in api_samples]

        page.click("#samples tbody tr[data-key='5.0'] a")
        wait_for_view(page, "sample")
        assert page.url == f"{url}samples/{last}/5/0"
        assert page.inner_text("[data-field='response']") == api_samples[5]["response"]
        page.go_back()
        wait_for_view(page, "samples")
        assert page.url == f"{url}samples/{last}"

        first = httpx.get(f"{url}api/steps/1/samples/7/0").json()
        page.goto(f"{url}samples/1/7/0")  # a deep link, loaded from scratch
        wait_for_view(page, "sample")
        assert page.inner_text("h2") == "Step 1, sample 7 (occurrence 0)"
        assert page.inner_text("[data-field='response']") == first["response"]
        assert page.inner_text("[data-field='prompt']") == first["prompt"]

        page.goto(f"{url}timeline")
        wait_for_view(page, "timeline")
        phases = httpx.get(f"{url}api/phases").json()["phases"]
        assert page.locator("#timeline rect.phase").count() == len(phases) >= 3 * RUN_STEPS
        page.screenshot(path=str(ARTIFACTS / "dashboard-timeline.png"), full_page=True)

        page.goto(f"{url}samples/{RUN_STEPS + 5}")
        wait_for_view(page, "samples")
        assert page.inner_text("#error") == f"step {RUN_STEPS + 5} is not recorded (steps recorded: 0..{last})"
        assert errors == []

        # A step with no samples (a running run's current step) shows an empty state, not an error.
        store = DashboardStore(tmp_path)
        store.run_started(run_dir=str(tmp_path), start_step=0, num_steps=5, config={})
        store.add_phase(step=0, phase="rollout", started=1.0, ended=2.0)
        store.close()
        page.goto(f"{serve(tmp_path)}samples/0")
        wait_for_view(page, "samples")
        assert page.inner_text("#samples-empty") == "Step 0 has no samples yet."
        assert page.locator("#error").count() == 0
    assert (ARTIFACTS / "dashboard-overview.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_agents_sample_shows_turn_by_turn_which_tokens_the_policy_wrote(serve, tmp_path: Path) -> None:
    """The transcript of a multi-turn sample: the policy's turns (trained) apart from its agent's messages (masked)."""
    transcript = [
        {"source": "policy", "text": ":0:5<eos>", "tokens": 5},
        {"source": "agent", "text": "<bos>3:7<eos><bos>2:", "tokens": 7},
        {"source": "policy", "text": "7777<eos>", "tokens": 5},
    ]
    sample = Sample(index=3, prompt=Prompt("73915", "7", {"secret": "7"}), prompt_ids=[2, 4], transcript=transcript)
    store = DashboardStore(tmp_path)
    store.run_started(run_dir=str(tmp_path), start_step=0, num_steps=1, config={})
    store.add_samples(step=1, samples=[sample])
    store.close()
    with browser_page() as page:
        page.goto(f"{serve(tmp_path)}samples/1/3/0")
        wait_for_view(page, "sample")
        turns = page.locator("#transcript .turn")
        assert turns.count() == 3
        assert [turns.nth(i).get_attribute("data-source") for i in range(3)] == ["policy", "agent", "policy"]
        assert [turns.nth(i).locator("pre").inner_text() for i in range(3)] == [span["text"] for span in transcript]
        assert turns.nth(1).locator("small").inner_text() == "agent (masked), 7 token(s)"
        assert page.inner_text("#transcript h3") == "Turns (2 by the policy)"
        page.screenshot(path=str(ARTIFACTS / "dashboard-agent-sample.png"), full_page=True)
