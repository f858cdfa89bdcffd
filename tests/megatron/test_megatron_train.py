"""``miles train --trainer megatron`` as a user runs it: the embedded default learns at TP=1 and TP=2 (ranks as
worker processes), a run resumes from its checkpoint, and a wrong model implementation is refused up front."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from safetensors import safe_open

from miles_core.default.tokenizer import DigitTokenizer
from miles_core.engines.staging import weight_staging_dir
from miles_core.engines.weights import read_checkpoint_dir
from miles_core.run_setup import load_tokenizer
from tests.conftest import run_miles
from tests.test_train_moe import LEARNING_MARGIN, held_out_rewards

pytestmark = pytest.mark.slow
CHECKPOINTS = ("step_000002", "step_000004")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(run_dir: Path, *args: str):
    result = run_miles("train", "--trainer", "megatron", "--output-dir", str(run_dir), "--no-progress", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_default_run_learns_with_megatron(tmp_path: Path) -> None:
    """TP=2 only: a TP=1 step equals the torch trainer's (test_megatron_trainer.py), whose run learns (test_train.py);
    a second 110-step run at TP=1 would add minutes of CI and nothing those two do not show."""
    tensor_parallel = "2"
    train(
        tmp_path,
        "--megatron-tensor-parallel",
        tensor_parallel,
        "--num-steps",
        "110",
        "--run-eval-every",
        "0",
        "--run-checkpoint-every",
        "0",
    )
    rows = metrics(tmp_path)
    evals = [row["eval/reward_mean"] for row in rows if "eval/reward_mean" in row]
    assert len(evals) == 2 and evals[-1] >= evals[0] + 0.2, evals
    assert [row["step"] for row in rows if "train/loss" in row] == list(range(1, 111))
    assert all(row["weight_transfer/gb_per_s"] > 0 for row in rows if "train/loss" in row)
    assert not list(weight_staging_dir().glob("miles-staging-*-holder*")), "the ranks' staged shares were left"
    final = tmp_path / "checkpoints" / "step_000110"
    assert (final / "model.safetensors.index.json").is_file()  # one shard per rank, written by the ranks
    ranks = int(tensor_parallel)
    assert sorted(p.name for p in final.glob("optimizer_rank*.pt")) == [
        f"optimizer_rank{r:03d}.pt" for r in range(ranks)
    ]
    assert all((tmp_path / "logs" / f"megatron-rank{r}.log").is_file() for r in range(ranks))


def test_megatron_run_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """Under the fully_async schedule (the trainer's ranks train while the stream generates): the checkpoint keeps
    which groups were used, and the resumed run continues at step 3."""
    quick = [
        "--run-schedule",
        "fully_async",
        "--rollout-batch-size",
        "4",
        "--rollout-group-size",
        "4",
        "--run-eval-every",
        "0",
        "--run-checkpoint-every",
        "2",
        "--megatron-tensor-parallel",
        "2",
        "--train-kl-coef",
        "0.01",
    ]
    train(tmp_path, *quick, "--num-steps", "2")
    train(tmp_path, *quick, "--num-steps", "4", "--run-resume", "true")
    assert [row["step"] for row in metrics(tmp_path) if "train/loss" in row] == [1, 2, 3, 4]
    state = json.loads((tmp_path / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["tensor_parallel"] == 2
    streams = [json.loads((tmp_path / "checkpoints" / c / "rollout_stream.json").read_text()) for c in CHECKPOINTS]
    settled = [stream["low"] + len(stream["above"]) for stream in streams]
    assert settled == [2 * 4, 4 * 4]  # the groups trained on (4 a step; none dropped or filtered at this pace)
    for checkpoint in CHECKPOINTS:  # each is a model directory: its tokenizer is in it
        tokenizer = load_tokenizer(tmp_path / "checkpoints" / checkpoint)
        assert tokenizer.encode("73915:") == DigitTokenizer().encode("73915:")


def test_megatron_trainer_refuses_other_model_implementations(tmp_path: Path) -> None:
    result = run_miles(
        "train", "--trainer", "megatron", "--model-impl", "llama=transformers", "--output-dir", str(tmp_path)
    )
    assert result.returncode != 0
    assert "model.implementations.llama = 'transformers': the megatron trainer trains megatron-core" in result.stderr
    result = run_miles(
        "train", "--trainer", "megatron", "--megatron-pipeline-parallel", "2", "--output-dir", str(tmp_path)
    )
    assert result.returncode != 0 and "megatron.pipeline_parallel" in result.stderr


def test_torch_trainer_trains_the_chosen_megatron_implementation(tmp_path: Path) -> None:
    result = run_miles(
        "train",
        "--model-impl",
        "llama=megatron",
        "--output-dir",
        str(tmp_path),
        "--no-progress",
        "--num-steps",
        "3",
        "--rollout-batch-size",
        "4",
        "--rollout-group-size",
        "4",
        "--run-eval-every",
        "0",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "miles: torch trainer, model llama/megatron" in result.stdout
    assert [row["step"] for row in metrics(tmp_path) if "train/loss" in row] == [1, 2, 3]
    assert (tmp_path / "checkpoints" / "step_000003" / "model.safetensors").is_file()  # the torch trainer's, one file


def test_ranks_placed_by_the_ray_provider(tmp_path: Path) -> None:
    result = train(
        tmp_path,
        "--run-worker-provider",
        "ray",
        "--megatron-tensor-parallel",
        "2",
        "--megatron-cpus-per-rank",
        "0.5",
        "--num-steps",
        "2",
        "--rollout-batch-size",
        "4",
        "--rollout-group-size",
        "4",
        "--run-eval-every",
        "0",
    )
    assert "miles: 2 megatron ranks by the ray provider: megatron-rank0 pid" in result.stdout
    assert "megatron-rank0 pid" in result.stdout and "bundle 0" in result.stdout and "bundle 1" in result.stdout
    assert [row["step"] for row in metrics(tmp_path) if "train/loss" in row] == [1, 2]


def test_the_megatron_trainer_learns_on_a_tiny_qwen3_moe_at_ep2(tmp_path: Path) -> None:
    """As tests/test_train_moe.py, with the megatron trainer at DP=2 x EP=2 sending its weights itself (``disk`` from
    the ranks: each writes one shard of every version, the driver only the index): its per-expert export is what the
    engines serve (checksums, combined from the ranks' digests, verified after every update), and the held-out reward
    rises (measured, run seeds 0, 1 and 1234: 0.0 -> 0.199, 0.090 and 0.109)."""
    work_dir = tmp_path / "weights"
    evals = held_out_rewards(
        tmp_path,
        "--trainer",
        "megatron",
        "--megatron-data-parallel",
        "2",
        "--megatron-expert-parallel",
        "2",
        "--weight-transfer-mode",
        "disk",
        "--weight-transfer-settings",
        json.dumps({"work_dir": str(work_dir), "keep_versions": 1}),
    )
    assert len(evals) == 2 and evals[-1] >= evals[0] + LEARNING_MARGIN, evals
    (last,) = work_dir.glob("v*")
    shards = sorted(last.glob("model-*.safetensors"))
    writers = set()
    for shard in shards:
        with safe_open(str(shard), framework="pt") as opened:
            writers.add((opened.metadata()["holder"], opened.metadata()["holder_pid"]))
    index = json.loads((last / "model.safetensors.index.json").read_text())["weight_map"]
    assert [shard.name for shard in shards] == sorted(set(index.values())) and len(shards) == 2
    assert {holder for holder, _ in writers} == {"0", "1"} and len({pid for _, pid in writers}) == 2  # two ranks
    final = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    saved = read_checkpoint_dir(final)
    experts = transformers.AutoConfig.from_pretrained(final).num_experts
    assert {f"model.layers.1.mlp.experts.{j}.down_proj.weight" for j in range(experts)} <= set(saved)  # both EP ranks'


def test_the_megatron_trainer_learns_on_a_tiny_deepseek_v3(tmp_path: Path) -> None:
    """As tests/test_train_moe.py, on the testkit's tiny DeepSeek-V3 with the megatron trainer (megatron-core's MLA and
    sigmoid-routed MoE layers with a shared expert), on one rank: the export (every routed expert and the selection
    bias by its HF name) is what the engines serve, checksums verified after every update, and the held-out reward
    rises. Measured, run seeds 0, 1 and 1234: 0.0 -> 0.117, 0.109 and 0.094 (at DP=2 x EP=2: 0.141, 0.109 and 0.125;
    that layout's step equals the torch trainer's in test_deepseek_v3.py, so CI runs the learning run once)."""
    evals = held_out_rewards(tmp_path, "--trainer", "megatron", family="deepseek_v3")
    assert len(evals) == 2 and evals[-1] >= evals[0] + LEARNING_MARGIN, evals


def test_the_megatron_trainer_learns_on_a_tiny_deepseek_v4_at_tp2(tmp_path: Path) -> None:
    """As tests/test_train_moe.py, on the testkit's tiny DeepSeek-V4 (every layer kind) with the megatron trainer and
    ``--dsv4-impl miles`` at TP=2: its export, gathered from both ranks under DeepSeek-V4's checkpoint names, is what
    the engine serves (checksums verified after every update), and the held-out reward rises. Measured, run seeds 0, 1
    and 1234: 0.020 -> 0.156, 0.078 and 0.109 (its step equals the torch trainer's at TP=1, TP=2, DP=2 x EP=2 and
    TP=2 x DP=2 x EP=2 in test_deepseek_v4.py)."""
    flags = ("--trainer", "megatron", "--dsv4-impl", "miles", "--megatron-tensor-parallel", "2")
    evals = held_out_rewards(tmp_path, *flags, family="deepseek_v4")
    assert len(evals) == 2 and evals[-1] >= evals[0] + LEARNING_MARGIN, evals
