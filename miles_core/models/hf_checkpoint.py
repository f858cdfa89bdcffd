"""HF checkpoint directories (config.json + safetensors + the tokenizer's files): loaded with transformers with
clear errors, and written by trainers."""

from __future__ import annotations

import json
import shutil
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


TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "spiece.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
"""The files an HF tokenizer may be saved as (every format transformers writes or reads)."""


def tokenizer_files(path: str | Path) -> list[Path]:
    """The tokenizer files present in the checkpoint directory ``path`` (empty when it holds no tokenizer)."""
    return [Path(path) / name for name in TOKENIZER_FILES if (Path(path) / name).is_file()]


def save_hf_checkpoint(directory: str | Path, tensors: Mapping[str, torch.Tensor], hf_config: Any, *,
                       tokenizer_from: str | Path | None) -> None:  # fmt: skip
    """Write ``config.json``, ``model.safetensors`` (HF names; a tied head left out, as transformers does) and a
    copy of the tokenizer files of the checkpoint directory ``tokenizer_from`` (the run's model), so that the
    checkpoint is a model directory of its own (``--model CHECKPOINT``). ``None`` writes no tokenizer."""
    from safetensors.torch import save_file  # deferred: only trainers write checkpoints

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(directory)
    save_file({name: tensor.detach().contiguous() for name, tensor in tensors.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    if tokenizer_from is not None:
        copy_tokenizer_files(tokenizer_from, directory)


def copy_tokenizer_files(source: str | Path, directory: str | Path) -> list[Path]:
    """Copy the tokenizer files of the checkpoint directory ``source`` into ``directory``; an error when ``source``
    holds none (a checkpoint without its tokenizer cannot be used as a model)."""
    files = tokenizer_files(source)
    if not files:
        raise MilesError(f"model directory {str(source)!r} holds no tokenizer files (one of "
                         f"{', '.join(TOKENIZER_FILES[:4])}, ...): a checkpoint needs its tokenizer")  # fmt: skip
    return [Path(shutil.copy2(file, Path(directory) / file.name)) for file in files]
