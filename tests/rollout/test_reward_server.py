"""The --reward-url client against the example reward server (a real HTTP server in a process of its own)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from miles_core.errors import MilesError
from miles_core.rollout.prompts import Prompt
from miles_core.rollout.remote_reward import RemoteReward
from miles_core.rollout.rewards import CompositeReward, RewardPart, RewardPlan, RewardScorer
from miles_core.rollout.samples import Sample
from miles_core.workers.node import LOOPBACK
from miles_core.workers.process import free_ports
from tests.conftest import MILES

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-reward-token"
HELD_LAUNCH = (
    "import sys; from miles_core.testkit import reward_server; print('imported', flush=True); "
    "sys.stdin.readline(); sys.exit(reward_server.main(sys.argv[1:]))"
)
"""The example server, its imports done before it waits for a line on stdin to start: a restart that takes well
under a second once asked, so a test decides how long an outage lasts."""


class RewardServerProcess:
    """The example server, started and stopped by pid on one port (so it can come back where it was)."""

    def __init__(self, port: int, log: Path) -> None:
        self.port, self.log, self.process = port, log, None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> RewardServerProcess:
        return self.prepare().go()

    def prepare(self) -> RewardServerProcess:
        """Start the process up to the server's imports (the slow part), then hold it until :meth:`go`."""
        env = {**os.environ, "PYTHONPATH": str(ROOT), "REWARD_TOKEN": TOKEN}
        arguments = ["--port", str(self.port), "--token-env", "REWARD_TOKEN"]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", HELD_LAUNCH, *arguments], env=env, stdin=subprocess.PIPE, stdout=log, stderr=log
            )
        self.wait_until(lambda: "imported" in self.log.read_text(), "imported the server")
        return self

    def go(self) -> RewardServerProcess:
        """Let a prepared process start serving; back when it answers its health check."""
        self.process.stdin.write(b"go\n")
        self.process.stdin.close()
        self.wait_until(self.healthy, "served /health")
        return self

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_until(self, done, what: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-2000:]
            if done():
                return
            time.sleep(0.05)
        raise AssertionError(f"the reward server has not {what}: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


@pytest.fixture
def server(tmp_path: Path):
    process = RewardServerProcess(free_ports(1, LOOPBACK)[0], tmp_path / "server.log").start()
    yield process
    process.kill()


def client(url: str, *, token: str | None = TOKEN, retries: int = 1) -> RemoteReward:
    return RemoteReward(url, token=token, timeout_s=10, retries=retries, batch_size=3, concurrency=2)


def samples(count: int) -> list[Sample]:
    return [
        Sample(index=i, prompt=Prompt(f"{i}:", label="1", metadata={}), prompt_ids=[1], response=str(i % 7) * (i % 4))
        for i in range(count)
    ]


def scorer(remote: RemoteReward, *, limit: int = 16) -> RewardScorer:
    plan = RewardPlan(
        CompositeReward(
            "remote:1.0,exact:0.5",
            (RewardPart("remote", 1.0, batch=remote), RewardPart("exact", 0.5, fn=lambda *, response, label, **_: 0.0)),
        )
    )
    return RewardScorer(plan, timeout_s=10, workers=1, max_consecutive_failures=limit, log=lambda line: None)


def score(scorer: RewardScorer, batch: list[Sample]) -> list[Sample]:
    asyncio.run(scorer.score(batch, ["sample {index}"] * len(batch)))
    return batch


def test_the_server_scores_batches_the_same_as_one_by_one(server: RewardServerProcess) -> None:
    remote = client(server.url)
    remote.probe()
    batch = score(scorer(remote), samples(8))  # 3 requests of at most 3 items
    rewards = [s.reward_parts["remote"] for s in batch]
    assert all(0.0 < r < 1.0 for r in rewards) and len(set(rewards)) > 1  # a sigmoid, differing by input
    alone = [score(scorer(remote), [s])[0].reward_parts["remote"] for s in samples(8)[:3]]
    assert alone == pytest.approx(rewards[:3], abs=1e-5)  # padding in a batch changes nothing beyond float32 noise
    assert sum(s.reward_errors for s in batch) == 0


def test_a_wrong_token_is_refused_at_the_probe(server: RewardServerProcess) -> None:
    with pytest.raises(MilesError, match=r"answered GET /health with 401 .*give its token with --reward-url-token"):
        client(server.url, token="wrong").probe()


def test_a_server_that_dies_mid_run_costs_those_samples_and_scoring_resumes_when_it_is_back(
    server: RewardServerProcess,
) -> None:
    remote = client(server.url, retries=1)
    run = scorer(remote, limit=16)
    before = score(run, samples(6))
    assert sum(s.reward_errors for s in before) == 0
    server.kill()
    during = score(run, samples(6))  # 2 failed requests: every sample 0, each counted
    assert [s.reward for s in during] == [0.0] * 6 and [s.reward_errors for s in during] == [1] * 6
    server.start()
    after = score(run, samples(6))
    assert [s.reward_parts["remote"] for s in after] == pytest.approx([s.reward_parts["remote"] for s in before])
    assert sum(s.reward_errors for s in after) == 0


def test_a_server_that_stays_down_stops_the_run_after_the_failures_in_a_row(server: RewardServerProcess) -> None:
    run = scorer(client(server.url, retries=0), limit=2)
    server.kill()
    score(run, samples(3))  # one request: one failure in a row
    with pytest.raises(MilesError, match=r"reward remote failed 2 times in a row .* the last: reward remote POST "):
        score(run, samples(3))


def test_bad_requests_are_refused_with_an_error(server: RewardServerProcess) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    for body in (b"{", b"[]", b'{"items": []}', b'{"items": [{"prompt": 1}]}'):
        answer = httpx.post(f"{server.url}/score", content=body, headers=headers)
        assert answer.status_code == 400 and answer.json()["error"], body
    assert httpx.post(f"{server.url}/score", json={"items": []}).status_code == 401


REWARD_MODEL_STEPS = 45
REWARD_MODEL_MARGIN = 0.04
"""The greedy held-out reward's rise the run must show against the example reward model: 0.482 to 0.543 measured in
45 steps with an outage of 9 to 12 steps (three runs on a 2-core Xeon; without the outage, 0.482 to 0.564 in 60 on the
AMX machine). 60 steps once fell back to 0.46 in its last two (a random reward model is easy to over-fit), so 45. The
margin is two thirds of the rise measured: room for other CPUs' rounding, far above the 0.0 of a run that learns
nothing."""
OUTAGE_AT_STEP = 15
"""The server is killed once the run has recorded this step, and started again once a step shows the outage."""


def metric_rows(path: Path) -> list[dict]:
    """The complete lines of a metrics file that a running driver is still writing."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def wait_for_step(process: subprocess.Popen, metrics: Path, done, what: str, timeout_s: float = 240) -> None:
    """Poll the run's metrics until ``done(train rows)``; the run must still be going."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done([row for row in metric_rows(metrics) if "train/loss" in row]):
            return
        assert process.poll() is None, f"the run ended (status {process.returncode}) before {what}"
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout_s} s")


@pytest.mark.slow
def test_a_training_run_learns_against_the_reward_server_and_rides_out_its_death(
    server: RewardServerProcess, tmp_path: Path
) -> None:
    """The policy learns what the example reward model scores high (its held-out score rises), every sample scored
    over HTTP, the parts logged apart. The server killed mid-run: those steps' samples score 0, each counted in
    reward/errors, and the run goes on; started again on its port, scoring resumes with no error."""
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    command = [
        str(MILES), "train", "--output-dir", str(run_dir), "--no-progress", "--run-eval-every", "0",
        "--num-steps", str(REWARD_MODEL_STEPS), "--reward-url", server.url, "--reward", "remote:1.0,format:0.1",
        "--rollout-reward-url-batch-size", "32", "--rollout-reward-url-retries", "0",
        "--rollout-reward-max-consecutive-failures", "100000",  # an outage of seconds: many failed requests
    ]  # fmt: skip
    env = {**os.environ, "MILES_REWARD_URL_TOKEN": TOKEN}
    replacement = RewardServerProcess(server.port, tmp_path / "replacement.log")
    with open(tmp_path / "driver.log", "wb") as log:
        process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=log, stderr=log)
    try:
        replacement.prepare()  # imported while the run starts: it serves within a second of go()
        wait_for_step(process, metrics, lambda rows: len(rows) >= OUTAGE_AT_STEP, f"step {OUTAGE_AT_STEP}")
        server.kill()
        wait_for_step(process, metrics, lambda rows: rows[-1]["reward/errors"] > 0, "a step scored during the outage")
        replacement.go()
        assert process.wait(timeout=300) == 0, (tmp_path / "driver.log").read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        replacement.kill()
    rows = metric_rows(metrics)
    steps = [row for row in rows if "train/loss" in row]
    assert [row["step"] for row in steps] == list(range(1, REWARD_MODEL_STEPS + 1))
    errors = [row["reward/errors"] for row in steps]
    first, last = next(i for i, e in enumerate(errors) if e), max(i for i, e in enumerate(errors) if e)
    assert first >= OUTAGE_AT_STEP - 1 and last < REWARD_MODEL_STEPS - 1, errors  # the outage, then steps without
    assert all(e == 0 for e in errors[:first] + errors[last + 1 :]), errors
    outage = steps[first : last + 1]
    assert all(row["rollout/reward/remote"] < 1.0 for row in outage)
    assert any(row["rollout/reward/remote"] == 0.0 for row in outage)  # every sample of a step scored 0
    scored = steps[:first] + steps[last + 1 :]
    assert all(0.0 < row["rollout/reward/remote"] < 1.0 for row in scored)
    assert all(row["rollout/reward/format"] == 0.0 for row in steps)  # digits, no \boxed{}
    evals = [row["eval/reward_mean"] for row in rows if "eval/reward_mean" in row]
    assert len(evals) == 2 and evals[-1] >= evals[0] + REWARD_MODEL_MARGIN, evals
