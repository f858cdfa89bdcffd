"""Each built-in advantage estimator through a whole ``miles train`` (issue 46): chosen by flag, said at start, its
metrics recorded, the engines' checksum verified after every update (they hold the policy's weights, never the
critic's). Short runs: the formulas are tested in ``tests/training/test_algorithms.py``, learning by
``benchmarks/algorithms.py`` (its table is in docs/concepts/algorithms.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_miles

pytestmark = pytest.mark.slow

QUICK = ["--no-progress", "--rollout-batch-size", "4", "--rollout-group-size", "4", "--run-eval-every", "0"]
CHOSEN = {
    "grpo": "grpo advantages, ppo_clip loss, token-mean",
    "dr_grpo": "dr_grpo advantages, ppo_clip loss, seq-mean-token-sum-norm",
    "rloo": "rloo advantages, ppo_clip loss, token-mean",
    "reinforce_plus_plus": "reinforce_plus_plus advantages, ppo_clip loss, token-mean",
    "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline advantages, ppo_clip loss, token-mean",
    "gspo": "gspo advantages, gspo loss, seq-mean-token-mean",
    "ppo": "ppo advantages, ppo_clip loss, token-mean",
}


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def three_checkpointed_steps(run_dir: Path, estimator: str, *args: str, timeout_s: float = 300):
    """``miles train`` of 3 steps with ``estimator``, a checkpoint at step 3."""
    return run_miles(
        "train",
        "--output-dir",
        str(run_dir),
        *QUICK,
        "--num-steps",
        "3",
        "--run-checkpoint-every",
        "3",
        "--train-advantage-estimator",
        estimator,
        *args,
        timeout_s=timeout_s,
    )


@pytest.mark.parametrize("estimator", list(CHOSEN))
def test_each_estimator_trains_end_to_end(tmp_path: Path, estimator: str) -> None:
    run_dir = tmp_path / "run"
    result = three_checkpointed_steps(
        run_dir,
        estimator,
        "--train-kl-coef",
        "0.01",
        "--train-kl-estimator",
        "k2",
        "--weight-transfer-verify-checksum",
        "true",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"miles: algorithm: {CHOSEN[estimator]}" in result.stdout
    trained = [row for row in rows(run_dir) if "train/loss" in row]
    assert [row["step"] for row in trained] == [1, 2, 3]
    has_critic = (run_dir / "checkpoints" / "step_000003" / "critic" / "optimizer.pt").is_file()
    assert has_critic == (estimator == "ppo")
    if estimator == "ppo":
        assert all("train/critic/explained_variance" in row and "train/critic/value_loss" in row for row in trained)


def test_mini_batches_and_epochs_are_optimizer_steps(tmp_path: Path) -> None:
    result = run_miles(
        "train",
        "--output-dir",
        str(tmp_path / "run"),
        *QUICK,
        "--num-steps",
        "2",
        "--run-checkpoint-every",
        "0",
        "--train-mini-batches-per-rollout",
        "2",
        "--train-epochs-per-rollout",
        "2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [row["train/optimizer_steps"] for row in rows(tmp_path / "run") if "train/loss" in row] == [4.0, 4.0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--train-advantage-estimator", "grp0"], "unknown advantage estimator 'grp0'"),
        (["--rollout-group-size", "1", "--train-advantage-estimator", "rloo"], "needs groups of at least 2 samples"),
        (["--train-advantage-estimator-settings", '{"normalize_std": 1}'], "grpo setting normalize_std = 1"),
        (["--train-advantage-estimator", "ppo", "--train-advantage-estimator-settings", '{"gamma": 2}'], "gamma = 2"),
    ],
)
def test_bad_algorithm_input_is_one_line_before_anything_starts(tmp_path: Path, flags: list, message: str) -> None:
    result = run_miles("train", "--output-dir", str(tmp_path / "run"), *QUICK, *flags)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert not (tmp_path / "run" / "logs").exists()  # no worker started


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "ppo"])
def test_the_kl_in_the_reward_replaces_the_kl_loss_term(tmp_path: Path, estimator: str) -> None:
    """``--train-kl-placement reward``: the trainer subtracts ``kl_coef`` x KL per token from the rewards (recorded
    as ``train/kl_in_reward``, which grows from 0 as the policy leaves the reference) and the loss has no KL term."""
    result = run_miles(
        "train",
        "--output-dir",
        str(tmp_path / "run"),
        *QUICK,
        "--num-steps",
        "4",
        "--run-checkpoint-every",
        "0",
        "--train-advantage-estimator",
        estimator,
        "--train-kl-coef",
        "0.1",
        "--train-kl-placement",
        "reward",
        "--train-kl-estimator",
        "k2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    trained = [row for row in rows(tmp_path / "run") if "train/loss" in row]
    penalties = [row["train/kl_in_reward"] for row in trained]
    assert all(value >= 0 for value in penalties) and penalties[-1] > penalties[0], penalties
    assert all(row["train/kl"] == 0.0 for row in trained)  # not a loss term


def test_ppo_trains_its_critic_on_megatron_ranks_end_to_end(tmp_path: Path) -> None:
    """``--trainer megatron --megatron-tensor-parallel 2`` with ppo: the ranks train the critic beside the policy
    (its metrics every step), each rank's checkpoint file holds its critic shard and optimizer state, the engines
    get the policy's weights (checksum verified)."""
    import torch

    run_dir = tmp_path / "run"
    result = three_checkpointed_steps(
        run_dir,
        "ppo",
        "--trainer",
        "megatron",
        "--megatron-tensor-parallel",
        "2",
        "--weight-transfer-verify-checksum",
        "true",
        timeout_s=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"miles: algorithm: {CHOSEN['ppo']}" in result.stdout
    trained = [row for row in rows(run_dir) if "train/loss" in row]
    assert [row["step"] for row in trained] == [1, 2, 3]
    assert all("train/critic/explained_variance" in row and "train/critic/value_loss" in row for row in trained)
    for rank in (0, 1):
        state = torch.load(run_dir / "checkpoints" / "step_000003" / f"optimizer_rank{rank:03d}.pt", weights_only=True)
        assert {"critic", "critic_optimizer"} <= set(state)
        assert state["critic"]["output_layer.weight"].shape == (1, 64)  # the value head, not the vocabulary's
