"""HF checkpoint directories (config.json + safetensors): loaded with transformers with clear errors, and written
by trainers."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers

from miles_core.errors import MilesError


def require_checkpoint_dir(path: str | Path) -> Path:
    """``path`` as a Path, or an error when it holds no ``config.json``."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise MilesError(f"model directory {str(path)!r} has no config.json (expected an HF checkpoint directory)")
    return path


def checkpoint_family(path: str | Path) -> str:
    """The model family (``model_type`` of ``config.json``) of a checkpoint directory, read without transformers."""
    config_file = require_checkpoint_dir(path) / "config.json"
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise MilesError(f"cannot load model from {str(path)!r}: config.json is not a JSON object: {exc}") from None
    if not isinstance(model_type, str) or not model_type:
        raise MilesError(f"cannot load model from {str(path)!r}: config.json has no model_type (the model family)")
    return model_type


def load_causal_lm(
    path: str | Path, *, dtype: torch.dtype = torch.float32, **kwargs: object
) -> transformers.PreTrainedModel:
    """The checkpoint as a transformers causal LM (no hub access); a corrupt one is a :class:`MilesError`."""
    path = require_checkpoint_dir(path)
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, **kwargs)
    except Exception as exc:  # transformers raises many types for corrupt checkpoints
        raise MilesError(f"cannot load model from {str(path)!r}: {type(exc).__name__}: {exc}") from None


def save_hf_checkpoint(directory: str | Path, tensors: Mapping[str, torch.Tensor], hf_config: Any) -> None:
    """Write ``config.json`` and ``model.safetensors`` (HF names; a tied head left out, as transformers does)."""
    from safetensors.torch import save_file  # deferred: only trainers write checkpoints

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(directory)
    save_file({name: tensor.detach().contiguous() for name, tensor in tensors.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
