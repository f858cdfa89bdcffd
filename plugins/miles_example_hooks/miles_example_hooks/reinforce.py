"""An example training backend and engine backend written against the flat ``miles_core`` API alone.

``example-reinforce`` trains a :class:`~miles_example_hooks.minimal_llama.MinimalLlama` with plain REINFORCE: the loss
is minus the group-normalised advantage times the mean logprob of the response tokens (no clipping, no KL), one
AdamW step per batch. ``example-local`` launches Miles' local engine server as a command, one per cell, no router.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from miles_core import CommandWorkerSpec, HfWeightIterator, TrainBatch, WorkerSpec
from miles_example_hooks.minimal_llama import MinimalLlama

STATE_FILE = "reinforce_state.json"


class ReinforceTrainer:
    """A :class:`miles_core.TrainingBackend` in the driver process."""

    def __init__(self, model_path: Path, *, lr: float, seed: int) -> None:
        torch.manual_seed(seed)
        self.model_path = Path(model_path)
        self.model = MinimalLlama.from_pretrained(model_path)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.implementation = "llama/minimal"
        self.step = 0

    @classmethod
    def for_run(
        cls, config: Any, *, model_path: Path, initial_model_path: Path, run_dir: Path, token: str, registries: Any
    ) -> ReinforceTrainer:
        return cls(model_path, lr=config.train.lr, seed=config.run.seed)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        tensors = batch.tensors()
        logits = self.model(tensors["input_ids"])[:, :-1].float()
        targets = tensors["input_ids"][:, 1:]
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        mask = tensors["response_mask"]
        mean_logprob = (logprobs * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        loss = -(tensors["advantages"] * mean_logprob).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.step += 1
        return {"loss": loss.item(), "mean_logprob": mean_logprob.mean().item()}

    def weight_iterator(self, bucket_bytes: int) -> HfWeightIterator:
        return _StateIterator(self.model.hf_state_dict(), bucket_bytes=bucket_bytes)

    def save_checkpoint(self, directory: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
        """An HF checkpoint (the loop adds the run model's tokenizer files) and the step."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {name: tensor.detach().clone() for name, tensor in self.model.hf_state_dict().items()}  # tied: 2 copies
        safetensors.torch.save_file(state, directory / "model.safetensors")
        shutil.copy(self.model_path / "config.json", directory / "config.json")
        (directory / STATE_FILE).write_text(json.dumps({"step": self.step, **(extra or {})}))
        return directory

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        directory = Path(directory)
        self.model.load_state_dict(MinimalLlama.from_pretrained(directory).state_dict())
        state_file = directory / STATE_FILE
        state = json.loads(state_file.read_text()) if state_file.exists() else {"step": 0}
        self.step = state["step"]
        return state

    def rank_names(self) -> list[str]:
        return ["driver"]

    def close(self) -> None:
        """Nothing to release: the model lives in this process."""


class _StateIterator(HfWeightIterator):
    def __init__(self, state: dict[str, torch.Tensor], *, bucket_bytes: int) -> None:
        super().__init__(bucket_bytes=bucket_bytes)
        self.state = state

    def named_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        return ((name, tensor.detach()) for name, tensor in self.state.items())


class ExampleLocalEngines:
    """A :class:`miles_core.EngineBackend`: Miles' local engine server as a command, one per cell."""

    def engine_specs(self, config: Any, *, cell_id: str, model_path: str) -> list[WorkerSpec]:
        argv = [
            *(sys.executable, "-m", "miles_core.builtin.local_engine.server", "--model-path", model_path),
            *("--host", "{host}", "--port", "{port}", "--random-seed", str(config.run.seed)),
        ]
        health = "http://{host}:{port}/health_generate"
        return [CommandWorkerSpec(name=cell_id, argv=argv, ports=["port"], health_url=health, num_cpus=0)]

    def router_spec(self, config: Any) -> WorkerSpec | None:
        return None
