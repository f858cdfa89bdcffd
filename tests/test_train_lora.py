"""``miles train --train-lora-rank``: a LoRA run learns the default task with the engines given the adapter alone,
its checkpoint loads with peft over an unchanged base, a resumed run's engines serve the checkpoint's adapter, and a
target module that matches no layer is refused before any worker starts."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import transformers

from miles_core.weight_transfer.digests import checksum
from tests.conftest import run_miles

pytestmark = pytest.mark.slow
QUICK = ["--no-progress", "--rollout-batch-size", "4", "--rollout-group-size", "4", "--run-eval-every", "0"]
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head"
LORA = ["--train-lora-rank", "16", "--train-lora-alpha", "16", "--train-lora-target-modules", TARGETS]
"""The default model's embedding is tied to its output head and its final norm is frozen with the base: adapters on
the linear layers alone cannot make its logits larger than about 0.02 x sqrt(64) (measured: entropy stays at ln 14
for 80 steps at lr 0.03), so the head (tied, frozen) gets an adapter too."""
SERVED_AS_TRAINED = 1e-6
"""``train/approx_kl_rollout`` (the mean of rollout minus trainer logprobs, squared, halved) when the engine served
the trainer's adapter: both compute in float32, logprobs a few float32 roundings apart (about 1e-14 measured); an
engine serving the base or an older adapter is off by half the square of a whole step's change of the logprobs."""


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(run_dir: Path, *args: str, ok: bool = True, timeout_s: float = 400):
    result = run_miles("train", "--output-dir", str(run_dir), *args, timeout_s=timeout_s)
    if ok:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_a_lora_run_learns_the_default_task_sending_only_the_adapter(tmp_path: Path) -> None:
    result = train(
        tmp_path, "--no-progress", "--num-steps", "200", "--run-eval-every", "0", *LORA, "--train-lr", "0.003"
    )
    assert "the engines load the adapter alone" in result.stdout
    rows = [row for row in metrics(tmp_path) if "train/loss" in row]
    assert [row["step"] for row in rows] == list(range(1, 201))
    assert {row["labels"]["weight_transfer/protocol"] for row in rows} == {"lora_adapter"}
    model_bytes = (tmp_path / "initial_model" / "model.safetensors").stat().st_size
    # the adapter's bytes: rank 16 on every linear layer of a 64-wide model is about 40 % of this tiny model
    assert all(row["weight_transfer/gb_per_s"] * row["weight_transfer/seconds"] * 1e9 < model_bytes for row in rows)
    assert all(row["train/approx_kl_rollout"] < SERVED_AS_TRAINED for row in rows)  # the trainer's adapter served
    evals = [row["eval/reward_mean"] for row in metrics(tmp_path) if "eval/reward_mean" in row]
    assert evals[-1] >= 0.5, evals
    checkpoint = tmp_path / "checkpoints" / "step_000200"
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    initial = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "initial_model")
    assert checksum(base.state_dict().items()) == checksum(initial.state_dict().items())  # the base never changed
    loaded = peft.PeftModel.from_pretrained(base, checkpoint / "adapter")
    assert loaded.peft_config["default"].r == 16


def test_a_resumed_lora_run_serves_the_checkpoint_s_adapter(tmp_path: Path) -> None:
    train(tmp_path, *QUICK, "--num-steps", "2", "--run-checkpoint-every", "1", *LORA, "--train-lr", "0.01")
    result = train(tmp_path, *QUICK, "--num-steps", "4", "--run-resume", "true", *LORA, "--train-lr", "0.01")
    assert result.returncode == 0
    rows = {row["step"]: row for row in metrics(tmp_path) if "train/loss" in row}
    assert sorted(rows) == [1, 2, 3, 4]
    # step 3's rollout ran on the engines' adapter of step 2, published from the checkpoint at the resume
    assert rows[3]["train/approx_kl_rollout"] < SERVED_AS_TRAINED
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["step_000003", "step_000004"]


def test_a_target_module_matching_no_layer_is_refused_before_workers_start(tmp_path: Path) -> None:
    result = train(
        tmp_path, *QUICK, "--num-steps", "1", "--train-lora-rank", "4", "--train-lora-target-modules", "qkv", ok=False
    )
    assert result.returncode != 0
    assert "'qkv' matches no linear layer of the model (llama)" in result.stderr
    assert not (tmp_path / "logs").exists()  # no engine was started
