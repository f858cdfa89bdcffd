"""The example plugin's training backend and engine backend (``plugins/miles_example_hooks``), written against the
flat ``miles_core`` API alone, run a real ``miles train``: REINFORCE on the minimal Llama, Miles' local engine as
the example's own command, weights published every step, and a checkpoint that is an HF model directory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import safetensors.torch
import torch
import transformers

from tests.conftest import run_miles


def test_the_example_trainer_and_engine_backend_run_a_training_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_miles(
        "train",
        "--trainer",
        "example-reinforce",
        "--engine",
        "example-local",
        "--num-steps",
        "3",
        "--run-eval-every",
        "0",
        "--no-progress",
        "--output-dir",
        str(run_dir),
    )  # fmt: skip  (the flags in pairs)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "miles: example-reinforce trainer, model llama/minimal" in result.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "train/loss" in row]
    assert [row["step"] for row in steps] == [1, 2, 3]
    assert all(math.isfinite(row["train/loss"]) and row["train/mean_logprob"] < 0 for row in steps)
    assert all(row["weight_transfer/seconds"] > 0 for row in steps)  # every step published its weights
    checkpoint = run_dir / "checkpoints" / "step_000003"
    trained = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)  # an HF model directory
    initial = safetensors.torch.load_file(run_dir / "initial_model" / "model.safetensors")
    changed = [
        name
        for name, tensor in trained.state_dict().items()
        if name in initial and not torch.equal(tensor, initial[name])
    ]
    assert changed, "three optimizer steps changed no weight"
