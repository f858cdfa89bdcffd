"""``miles train`` with agents: every schedule trains on exactly the tokens the sessions recorded (the policy's with
loss mask 1, the agent's 0); an engine killed in the middle of a session loses no sample and trains on no half
trajectory; the tool task runs through the real sglang-router. That the tool task learns, with an agent of each
client API, is tests/rollout/test_tool_task_learns.py (in the parallel pass: no deadline)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_train import metrics, train

pytestmark = pytest.mark.slow

CHECKS = """\
from miles_core import hookimpl, Implementation
from miles_core.rollout.agents import fork_session, session_client

CONTROLLER = None
SESSIONS = 0
KILL_AT = int(__import__("os").environ.get("KILL_AT_SESSION", "0"))


@hookimpl
def prepare_rollout(rollout_id, controller):
    global CONTROLLER
    CONTROLLER = controller


def consistent(sample):
    # the transcript's spans cover the response; the policy's spans are trained, the agent's masked
    spans = sample.transcript
    if sum(span["tokens"] for span in spans) != len(sample.response_ids) or not sample.turns:
        return False
    mask = []
    for span in spans:
        mask += [1 if span["source"] == "policy" else 0] * span["tokens"]
    turns_ok = [span["source"] for span in spans][::2] == ["policy"] * len(sample.turns)
    return mask == sample.loss_mask and turns_ok and len(sample.logprobs) == len(sample.response_ids)


@hookimpl
def on_samples(rollout_id, step, samples):
    multi = sum(len(s.turns) == 2 for s in samples)
    print("SAMPLES", step, len(samples), sum(consistent(s) for s in samples), multi, flush=True)
    indices = sorted(s.index for s in samples)
    print("INDICES", step, len(set(indices)), flush=True)


async def killing_agent(*, base_url, prompt, metadata):
    # two turns, no tools; the KILL_AT-th session kills the engine between its turns
    global SESSIONS
    SESSIONS += 1
    session = SESSIONS
    client = session_client(base_url)
    messages = [{"role": "user", "content": prompt}]
    first = (await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)).choices[0]
    if session == KILL_AT:
        CONTROLLER.provider.processes["engine-0"].kill()
        print("KILLED engine-0 in session", session, flush=True)
    calls = [call.model_dump() for call in first.message.tool_calls or []]
    messages += [{"role": "assistant", "content": first.message.content, "tool_calls": calls}]
    messages += [{"role": "user", "content": "1"}]
    second = (await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)).choices[0]
    if session == KILL_AT:
        print("UNEXPECTED: the killed session's second turn succeeded", flush=True)
    return len(second.message.content or "") / 4


async def branching_agent(*, base_url, prompt, metadata):
    # one turn, then a fork: the session and its branch each take a second turn; one reward each
    client = session_client(base_url)
    messages = [{"role": "user", "content": prompt}]
    first = (await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)).choices[0]
    calls = [call.model_dump() for call in first.message.tool_calls or []]
    messages += [{"role": "assistant", "content": first.message.content, "tool_calls": calls}]
    messages += [{"role": "user", "content": "1"}]
    branch = session_client(await fork_session(base_url))
    answers = [
        (await session.chat.completions.create(model="policy", messages=messages, max_tokens=4)).choices[0]
        for session in (client, branch)
    ]
    return [len(answer.message.content or "") / 4 for answer in answers]


@hookimpl
def provide_agents():
    return [
        Implementation("killing", killing_agent, "two turns, killing the engine once between them"),
        Implementation("branching", branching_agent, "two turns, the second in the session and in a fork of it"),
    ]
"""


def sample_lines(stdout: str) -> list[list[int]]:
    return [[int(v) for v in line.split()[1:]] for line in stdout.splitlines() if line.startswith("SAMPLES")]


@pytest.mark.parametrize(("schedule", "agent"), [("one_step_off", "killing"), ("fully_async", "branching")])
def test_every_schedule_trains_on_the_sessions_tokens_and_an_engine_death_loses_no_sample(
    tmp_path: Path, schedule: str, agent: str
) -> None:
    """one_step_off: an engine killed between two turns of a session; fully_async: an agent that forks every
    session, so each sample comes with a branch (twice the samples, each whole and consistent)."""
    plugin = tmp_path / "checks.py"
    plugin.write_text(CHECKS)
    kill = agent == "killing"
    result = train(
        tmp_path / "run",
        "--no-progress",
        "--task",
        "tool_lookup",
        "--rollout-agent",
        agent,
        "--num-steps",
        "3",
        "--rollout-batch-size",
        "4",
        "--rollout-group-size",
        "4",
        "--run-eval-every",
        "0",
        "--run-schedule",
        schedule,
        "--rollout-session-servers",
        "2",
        "--plugin",
        str(plugin),
        env={"KILL_AT_SESSION": "84" if kill else "0"},  # after the 64 sessions of the eval before training
    )
    # every sample consistent and whole: two policy turns each (a replayed sample took its new session's tokens)
    count = 16 if kill else 32  # 4 prompts x 4 samples, each with its branch when the agent forks
    assert sample_lines(result.stdout) == [[step, count, count, count] for step in range(1, 4)]
    assert ("KILLED engine-0" in result.stdout) is kill and "UNEXPECTED" not in result.stdout
    indices = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("INDICES")]
    assert indices == [[str(step), "16"] for step in range(1, 4)]  # a branch shares its sample's index
    steps = [row for row in metrics(tmp_path / "run") if "train/loss" in row]
    assert [row["step"] for row in steps] == [1, 2, 3]


def test_the_tool_task_runs_through_the_real_sglang_router(tmp_path: Path) -> None:
    """Two local engines behind the real sglang-router, the session server in front of the router: every session's
    turns (a seed of its own each, batched by the session server) reach the engines through it. Before the client sent
    a router one request per setting, every eval session failed on the router's 422 and the run stopped."""
    plugin = tmp_path / "checks.py"
    plugin.write_text(CHECKS)
    engine = '["{python}", "-m", "miles_core.builtin.local_engine.server"]'
    result = train(
        tmp_path / "run",
        "--no-progress",
        "--task",
        "tool_lookup",
        "--engine",
        "sglang",
        "--sglang-launch-command",
        engine,
        "--sglang-router",
        "true",
        "--engine-num-engines",
        "2",
        "--num-steps",
        "2",
        "--rollout-batch-size",
        "4",
        "--run-eval-every",
        "0",
        "--run-checkpoint-every",
        "0",
        "--plugin",
        str(plugin),
    )
    assert "router pid" in result.stdout
    lines = sample_lines(result.stdout)
    assert [line[:3] for line in lines] == [[1, 32, 32], [2, 32, 32]], lines  # 4 prompts x 8, each consistent
    assert [row["step"] for row in metrics(tmp_path / "run") if "train/loss" in row] == [1, 2]
