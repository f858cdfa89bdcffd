"""``miles train --rollout-eval-samples K`` with local engines: the eval's pass@K and mean@K are the statistics of
the rewards its real samples got."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_miles
from tests.test_train import QUICK, metrics

pytestmark = pytest.mark.slow

LOGGED_REWARD = """\
import json


def by_length(*, prompt, response, label, metadata):
    reward = (len(response) % 3) / 2  # 0, 0.5 or 1: some samples pass, some do not
    with open("rewards.jsonl", "a") as out:  # the working directory: every reward in the order it was asked
        out.write(json.dumps(reward) + "\\n")
    return reward
"""


def test_a_run_reports_pass_and_mean_at_k_from_its_real_samples(tmp_path: Path) -> None:
    """``miles train --rollout-eval-samples 3`` with local engines (the 4 prompts are the eval prompts too): the eval
    before training scores its 4 greedy answers, then the 12 samples prompt by prompt; metrics.jsonl's eval/ metrics
    are those rewards' statistics."""
    (tmp_path / "rewards_mod.py").write_text(LOGGED_REWARD)
    (tmp_path / "evals.jsonl").write_text("".join(f'{{"prompt": "{n}:", "label": "{n % 10}"}}\n' for n in range(4)))
    args = ["--num-steps", "1", "--rollout-eval-samples", "3", "--prompts", "evals.jsonl"]
    result = run_miles("train", "--output-dir", "run", *QUICK, *args, "--reward", "rewards_mod:by_length", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["step"]: row for row in metrics(tmp_path / "run")}
    assert "eval/pass@3" in rows[1] and "eval/mean@3" in rows[1]  # the eval at the end too
    rewards = [float(line) for line in (tmp_path / "rewards.jsonl").read_text().splitlines()]
    greedy, sampled = rewards[:4], rewards[4:16]
    per_prompt = [sampled[3 * i : 3 * i + 3] for i in range(4)]
    assert rows[0]["eval/reward_mean"] == pytest.approx(sum(greedy) / 4, rel=1e-12)
    assert rows[0]["eval/pass@3"] == sum(any(r > 0 for r in rs) for rs in per_prompt) / 4
    assert rows[0]["eval/mean@3"] == pytest.approx(sum(sampled) / 12, rel=1e-12)  # float sums in another order
    assert f"pass@3 {rows[0]['eval/pass@3']:.3f}" in result.stdout + result.stderr
