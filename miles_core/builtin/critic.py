"""``Critic``: the value model of an estimator that needs one (``ppo``), trained by the torch trainer beside the
policy. The policy's architecture with a scalar head (transformers' ``AutoModelForTokenClassification`` with one
label), started from the policy's initial checkpoint or from ``critic_model``, the head zeroed (every value starts
at 0); its own AdamW at ``critic_lr``, PPO's clipped value loss over the trained tokens, gradients clipped by the
run's ``max_grad_norm``. Saved beside the actor in each checkpoint (``critic/``: an HF checkpoint and the optimizer's
state); never sent to the engines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from miles_core.errors import ConfigError, MilesError
from miles_core.models.checkpoint_dir import require_checkpoint_dir
from miles_core.training.batch import TrainBatch
from miles_core.training.critic_targets import clipped_value_loss, response_values

CRITIC_DIR = "critic"
"""The critic's folder in a checkpoint."""
OPTIMIZER_FILE = "optimizer.pt"


def load_value_model(path: str | Path, *, vocab_size: int, what: str) -> torch.nn.Module:
    """The checkpoint ``path`` as a value model (its architecture with a scalar head); a checkpoint whose vocabulary
    differs from the policy's (``vocab_size``), or whose architecture has no token-classification form, is a
    :class:`ConfigError` naming ``what`` (the setting it came from)."""
    directory = require_checkpoint_dir(path)
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    if getattr(config, "vocab_size", vocab_size) != vocab_size:
        raise ConfigError(
            f"{what} = {str(path)!r}: its vocabulary has {config.vocab_size} tokens, the policy's {vocab_size}; the "
            "critic reads the policy's token ids: give a checkpoint of the same tokenizer"
        )
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # "newly initialized: score": the head, zeroed below on purpose
    try:
        model = transformers.AutoModelForTokenClassification.from_pretrained(
            directory, num_labels=1, local_files_only=True, torch_dtype=torch.float32
        )
    except (ValueError, KeyError) as exc:
        raise ConfigError(
            f"{what} = {str(path)!r}: model type {config.model_type!r} has no value-model form in transformers "
            f"(AutoModelForTokenClassification): {str(exc).splitlines()[0][:200]}"
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    head = model.get_output_embeddings() or getattr(model, "score", None) or getattr(model, "classifier", None)
    if head is None:
        raise ConfigError(f"{what} = {str(path)!r}: no scalar head found on {type(model).__name__}")
    with torch.no_grad():
        head.weight.zero_()
        if getattr(head, "bias", None) is not None:
            head.bias.zero_()
    for module in model.modules():  # values are regressed: no dropout noise in their targets or their gradient
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


class Critic:
    """A value model with its optimizer. ``settings``: the estimator's (``critic_lr``, ``value_clip``);
    ``train``: the run's ``train`` section (``max_grad_norm``, ``micro_batch_size``)."""

    def __init__(self, model: torch.nn.Module, settings: Any, train: Any) -> None:
        self.model = model
        self.settings = settings
        self.train = train
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=settings.critic_lr, weight_decay=0.0)

    def values(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The value of each position's next token ``[B, L-1]`` (aligned with the targets ``input_ids[:, 1:]``)."""
        return self.model(input_ids=input_ids).logits[:, :-1, 0].float()

    @torch.no_grad()
    def response_values(self, batch: TrainBatch, pad_token_id: int) -> list[torch.Tensor]:
        """Each sample's values at its response tokens (1-D), before the update, in eval mode."""
        self.model.eval()
        found = []
        for micro in batch.micro_batches(self.train.micro_batch_size):
            found += response_values(self.values(micro.tensors(pad_token_id=pad_token_id)["input_ids"]), micro)
        return found

    def step(self, micros: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, float]:
        """One optimizer step of the clipped value loss ``0.5 max((V - R)^2, (V_old + clip(V - V_old) - R)^2)``
        over the micro-batches (``returns`` and ``old_values`` aligned as ``response_mask``), each weighted by its
        share of the step."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for tensors, weight in zip(micros, weights, strict=True):
            loss = clipped_value_loss(self.values(tensors["input_ids"]), tensors, clip=self.settings.value_clip)
            (loss * weight).backward()
            total += float(loss.detach()) * weight
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train.max_grad_norm)
        self.optimizer.step()
        return {"critic/value_loss": total, "critic/grad_norm": float(grad_norm)}

    def save(self, directory: Path) -> None:
        self.model.save_pretrained(directory / CRITIC_DIR)
        torch.save(self.optimizer.state_dict(), directory / CRITIC_DIR / OPTIMIZER_FILE)

    def load(self, directory: Path) -> None:
        """Restore the critic and its optimizer from a checkpoint ``directory`` (its ``critic/`` folder)."""
        folder = directory / CRITIC_DIR
        if not (folder / OPTIMIZER_FILE).is_file():
            raise MilesError(f"checkpoint {directory} holds no critic ({CRITIC_DIR}/): it was not a ppo run's")
        loaded = transformers.AutoModelForTokenClassification.from_pretrained(folder, local_files_only=True)
        self.model.load_state_dict(loaded.state_dict())
        self.optimizer.load_state_dict(torch.load(folder / OPTIMIZER_FILE, weights_only=True))
