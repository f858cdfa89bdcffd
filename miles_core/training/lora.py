"""LoRA through ``peft``: the adapter settings of a run, the check of its target modules against the model, adapters
put on a transformers model, and the tensors a LoRA trainer sends or saves (the adapter, the frozen base, or both
merged)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
import transformers

from miles_core.engines.weights import unique_named_tensors
from miles_core.errors import ConfigError, MilesError

if TYPE_CHECKING:
    import peft


def _peft() -> Any:
    """``peft``, imported on first use: only a LoRA run pays its import (about 2 s), not every run whose trainer or
    setup imports this module."""
    import peft

    return peft


ALL_LINEAR = "all-linear"
"""peft's preset: every linear layer but the output head."""
TARGET_PRESETS = (ALL_LINEAR,)
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
"""peft's file of an adapter's tensors (beside ``adapter_config.json``)."""
ADAPTER_NAME = "default"
"""The trainer's one adapter (peft's default name, so ``save_pretrained`` writes it at the directory's top)."""


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """A LoRA run's adapter: rank, alpha (scale alpha / rank), dropout and the modules it targets."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]

    @classmethod
    def of(cls, train: Any) -> LoraSettings | None:
        """The settings of a ``train`` config section, or ``None`` when LoRA is off (rank 0)."""
        if getattr(train, "lora_rank", None) is None:
            return None
        alpha = train.lora_alpha if train.lora_alpha is not None else float(train.lora_rank)
        return cls(train.lora_rank, alpha, train.lora_dropout, tuple(train.lora_target_modules))

    def peft_config(self) -> peft.LoraConfig:
        targets: str | list[str] = (
            ALL_LINEAR if self.target_modules == (ALL_LINEAR,) else [n for n in self.target_modules]
        )
        return _peft().LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
        )


def check_target_modules(model_config: transformers.PretrainedConfig, targets: tuple[str, ...]) -> None:
    """A :class:`ConfigError` naming the first target module that matches no linear layer of the model (built on the
    meta device: no memory, no weights read). peft matches a name against each module path's last parts."""
    if targets == (ALL_LINEAR,):
        return
    for preset in TARGET_PRESETS:
        if preset in targets:
            raise ConfigError(
                f"train.lora_target_modules (--train-lora-target-modules): {preset!r} is a preset; give it alone"
            )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(model_config)
    linear = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    for target in targets:
        if not any(name == target or name.endswith(f".{target}") for name in linear):
            last_parts = sorted({name.rsplit(".", 1)[-1] for name in linear})
            raise ConfigError(
                f"train.lora_target_modules (--train-lora-target-modules): {target!r} matches no linear layer of "
                f"the model ({model_config.model_type}); its linear layers are {', '.join(last_parts)} "
                f"(or use {ALL_LINEAR!r})"
            )


def add_adapter(model: transformers.PreTrainedModel, settings: LoraSettings) -> peft.PeftModel:
    """``model`` with a fresh LoRA adapter injected into its layers (in place; B is zero, so the model's outputs are
    unchanged); only the adapter's parameters require gradients."""
    return _peft().get_peft_model(model, settings.peft_config())


def adapter_tensors(model: peft.PeftModel, adapter_name: str = ADAPTER_NAME) -> dict[str, torch.Tensor]:
    """The adapter's own tensors under peft's saved names (``base_model.model....lora_A.weight``), detached; never a
    frozen base layer (peft would add an output head's or embedding's whole base weight to an adapter that targets
    it: the engines hold the base already)."""
    state = _peft().get_peft_model_state_dict(model, adapter_name=adapter_name, save_embedding_layers=False)
    return {name: tensor.detach() for name, tensor in state.items()}


def adapter_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the adapter's tensors, by sorted name, as float32 bytes (what trainer and engine compare)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def base_and_merged(model: torch.nn.Module, *, merged: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's own parameter names and tensors with the LoRA wrapping taken off: each wrapped layer's frozen
    base weight (``merged=False``) or base plus the adapter's delta (``merged=True``, a new tensor: the base is
    never touched); the adapter's own parameters are left out, tied tensors once."""
    deltas: dict[str, torch.Tensor] = {}
    if merged:
        lora_layer = _peft().tuners.lora.LoraLayer
        for path, module in model.named_modules():
            if isinstance(module, lora_layer) and ADAPTER_NAME in module.lora_A:
                deltas[f"{path}.base_layer.weight"] = module.get_delta_weight(ADAPTER_NAME).detach()
    # tied tensors dropped before merging: a merged tensor is new, and its memory may be reused once consumed
    kept = list(unique_named_tensors(model.state_dict().items()))
    lost = sorted(set(deltas) - {name for name, _ in kept})
    if lost:
        raise MilesError(
            f"the adapter of {lost[0].replace('.base_layer.weight', '')} cannot be merged: its weight is tied to "
            "another (a tied output head), which a checkpoint stores once; leave it out of "
            "--train-lora-target-modules for engines that take merged weights"
        )
    for name, tensor in kept:
        if ".lora_" in name:
            continue
        value = tensor.detach()
        if name in deltas:
            value = value + deltas[name].to(value.dtype)
        yield name.replace(".base_layer.", "."), value


def save_adapter(model: peft.PeftModel, directory: str | Path) -> Path:
    """The adapter in peft's own format (``adapter_config.json``, ``adapter_model.safetensors``), loadable with
    ``PeftModel.from_pretrained(base, directory)``: the two files ``PeftModel.save_pretrained`` writes, written
    directly (it renders a model card too, each step a cost on the weight update, and copies a targeted output
    head's or embedding's frozen base weight into the file)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.contiguous() for name, tensor in adapter_tensors(model).items()}
    safetensors.torch.save_file(tensors, directory / ADAPTER_WEIGHTS_FILE, metadata={"format": "pt"})
    config = copy.copy(model.peft_config[ADAPTER_NAME])
    config.inference_mode = True  # as peft saves it: loaded for serving unless a trainer asks otherwise
    config.save_pretrained(str(directory))
    return directory


def load_adapter_weights(model: peft.PeftModel, directory: str | Path, adapter_name: str = ADAPTER_NAME) -> None:
    """Set the tensors of ``model``'s adapter ``adapter_name`` from a directory that :func:`save_adapter` wrote (the
    same rank and targets), in place."""
    peft = _peft()
    loaded = peft.utils.load_peft_weights(str(directory), device="cpu")
    result = peft.set_peft_model_state_dict(model, loaded, adapter_name=adapter_name)
    missing = [name for name in result.missing_keys if ".lora_" in name and f".{adapter_name}." in name]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"the adapter in {directory} does not fit this model's LoRA: missing {missing[:3]}, unexpected "
            f"{list(result.unexpected_keys)[:3]}"
        )
