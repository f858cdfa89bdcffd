"""``TorchTrainer``: the built-in training backend. An HF transformers model trained with the PPO-clip loss on
GRPO advantages (importance ratio against the rollout logprobs), optional KL to a frozen reference model and an
entropy bonus; micro-batches, AdamW and gradient clipping; checkpoints in HF format plus optimizer state."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import transformers

from miles_core.errors import MilesError
from miles_core.models.hf_checkpoint import load_causal_lm
from miles_core.training.batch import TrainBatch
from miles_core.training.losses import entropy, kl_k3, masked_mean, ppo_clip_loss, token_logprobs
from miles_core.training.weight_iterator import ModuleHfWeightIterator

OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"


class TorchTrainer:
    """Trains ``model`` (a transformers causal LM) with the settings of a ``train`` config section."""

    def __init__(
        self, model: transformers.PreTrainedModel, settings: Any, *, seed: int = 0,
        reference: transformers.PreTrainedModel | None = None,
    ) -> None:  # fmt: skip
        torch.manual_seed(seed)
        self.model = model.train()
        self.settings = settings
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay, betas=(0.9, 0.99)
        )
        self.reference = _frozen_copy(reference or model) if settings.kl_coef > 0 else None
        self.step = 0

    @classmethod
    def from_pretrained(cls, path: str | Path, settings: Any, *, seed: int = 0) -> TorchTrainer:
        return cls(load_causal_lm(path), settings, seed=seed)

    @classmethod
    def for_run(cls, config: Any, *, model_path: Path, initial_model_path: Path, run_dir: Path, token: str,
                registries: Any) -> TorchTrainer:  # fmt: skip
        """The trainer of a ``miles train`` run (the training-backend interface every backend offers); the KL
        reference is the run's initial model, also when ``model_path`` is a checkpoint to resume from."""
        kl = config.train.kl_coef > 0 and Path(initial_model_path) != Path(model_path)
        reference = load_causal_lm(initial_model_path) if kl else None
        return cls(load_causal_lm(model_path), config.train, seed=config.run.seed, reference=reference)

    def close(self) -> None:
        """Nothing to release: the model lives in this process."""

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step over the batch, accumulated over micro-batches; returns averaged metrics."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = sum(len(s.response_ids) for s in batch.samples)
        if total_tokens == 0:
            raise MilesError("the batch has no response tokens to train on")
        sums: dict[str, float] = {}
        for micro in batch.micro_batches(self.settings.micro_batch_size):
            weight = sum(len(s.response_ids) for s in micro.samples) / total_tokens
            metrics = self._accumulate(micro, weight)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value * weight
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.max_grad_norm)
        self.optimizer.step()
        self.step += 1
        return {**sums, "grad_norm": float(grad_norm), "lr": self.settings.lr}

    def _accumulate(self, micro: TrainBatch, weight: float) -> dict[str, float]:
        tensors = micro.tensors(pad_token_id=self.model.config.pad_token_id or 0)
        input_ids, mask = tensors["input_ids"], tensors["response_mask"]
        logits = self.model(input_ids=input_ids).logits[:, :-1]
        targets = input_ids[:, 1:]
        logprobs = token_logprobs(logits, targets)
        loss, stats = ppo_clip_loss(
            logprobs, tensors["rollout_logprobs"], tensors["advantages"], mask,
            clip_eps=self.settings.clip_eps, clip_eps_high=self.settings.clip_eps_high,
        )  # fmt: skip
        token_entropy = masked_mean(entropy(logits), mask)
        kl = torch.zeros(())
        if self.reference is not None:
            with torch.no_grad():
                ref_logprobs = token_logprobs(self.reference(input_ids=input_ids).logits[:, :-1], targets)
            kl = kl_k3(logprobs, ref_logprobs, mask)
        total = loss + self.settings.kl_coef * kl - self.settings.entropy_coef * token_entropy
        (total * weight).backward()
        return {"loss": total.item(), "pg_loss": loss.item(), "kl": kl.item(), "entropy": token_entropy.item(),
                **{key: float(value) for key, value in stats.items()}}  # fmt: skip

    def weight_iterator(self, bucket_bytes: int) -> ModuleHfWeightIterator:
        """The HF-named weights, in buckets (the names are the transformers module's own)."""
        return ModuleHfWeightIterator(self.model, bucket_bytes=bucket_bytes)

    def save_checkpoint(self, directory: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
        """HF checkpoint (config + safetensors) plus optimizer state and the trainer's step, written atomically."""
        directory = Path(directory)
        partial = directory.with_name(directory.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(partial)
        torch.save(self.optimizer.state_dict(), partial / OPTIMIZER_FILE)
        (partial / STATE_FILE).write_text(json.dumps({"step": self.step, **(extra or {})}))
        if directory.exists():
            raise MilesError(f"checkpoint {directory} already exists")
        partial.rename(directory)
        return directory

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer and step from :meth:`save_checkpoint`'s directory; returns its state."""
        directory = Path(directory)
        loaded = load_causal_lm(directory)
        self.model.load_state_dict(loaded.state_dict())
        self.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, weights_only=True))
        state = json.loads((directory / STATE_FILE).read_text())
        self.step = state["step"]
        return state


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    reference = copy.deepcopy(model).eval()
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    return reference
