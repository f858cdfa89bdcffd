"""``miles train --task tool_lookup`` learns with an agent written against each client API that a session serves,
through the real, pinned client libraries: ``openai``'s Chat Completions (``tool_lookup``, the task's own agent) and
Responses API (``tool_lookup_responses``) and ``anthropic``'s Messages (``tool_lookup_anthropic``), each taking its
turns through its SDK's stream reader. Every sample is its session's trajectory, whole and consistent.

The settings are the cheapest found to learn on every seed tried: 16 prompts a step at lr 0.01 called the tool on
the held-out prompts (greedy eval 0.51-0.55, from 0.00) by step 10 to 30 on seeds 1, 2, 3, 4, 5 and 1234, and kept
it to step 35. The earlier 8 prompts at lr 0.005 took 20 to 45 steps where they learned (seeds 1, 2, 3, 5, 1234) and
never did on seed 4 in 70 (its policy lost the colon before it found the call: all rewards 0, no gradient again); 8
at lr 0.0075 took up to 50, at lr 0.01 learned and lost it (seed 1); 4 prompts a step (lr 0.005 to 0.02, or 4
optimizer steps a rollout) failed on some seed within 40 steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_train import metrics, train
from tests.test_train_agent import CHECKS, sample_lines

pytestmark = pytest.mark.slow

STEPS, PROMPTS = 35, 16
SAMPLES = PROMPTS * 8  # the default group size
RUN = ("--no-progress", "--task", "tool_lookup", "--run-eval-every", "0", "--run-checkpoint-every", "0")
SETTINGS = ("--num-steps", str(STEPS), "--rollout-batch-size", str(PROMPTS), "--train-lr", "0.01")


@pytest.mark.parametrize("agent", ["tool_lookup", "tool_lookup_responses", "tool_lookup_anthropic"])
def test_the_tool_task_learns_with_each_clients_agent(tmp_path: Path, agent: str) -> None:
    plugin = tmp_path / "checks.py"
    plugin.write_text(CHECKS)
    result = train(tmp_path / "run", *RUN, *SETTINGS, "--rollout-agent", agent, "--plugin", str(plugin), timeout_s=900)
    rows = metrics(tmp_path / "run")
    evals = [row["eval/reward_mean"] for row in rows if "eval/reward_mean" in row]
    assert evals[-1] >= evals[0] + 0.3, evals  # the held-out prompts: the policy calls the tool (0.5 a call)
    lines = sample_lines(result.stdout)
    assert [line[:3] for line in lines] == [[step, SAMPLES, SAMPLES] for step in range(1, STEPS + 1)]  # consistent
    assert lines[-1][3] > SAMPLES / 2  # most samples of the last step called the tool (two policy turns)
