"""HF checkpoint directories (config.json + safetensors + the tokenizer's files): loaded with transformers with
clear errors, and written by trainers."""

from __future__ import annotations

import itertools
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.core_model_loading import revert_weight_conversion  # what save_pretrained calls

from miles_core.errors import MilesError
from miles_core.models.checkpoint_dir import (  # re-exported: the directory checks read no tensors
    require_checkpoint_dir,
)


def load_causal_lm(
    path: str | Path, *, dtype: torch.dtype = torch.float32, **kwargs: object
) -> transformers.PreTrainedModel:
    """The checkpoint as a transformers causal LM (no hub access); a corrupt one is a :class:`MilesError`."""
    path = require_checkpoint_dir(path)
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, **kwargs)
    except Exception as exc:  # transformers raises many types for corrupt checkpoints
        raise MilesError(f"cannot load model from {str(path)!r}: {type(exc).__name__}: {exc}") from None


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def checkpoint_named_tensors(
    model: transformers.PreTrainedModel, named: Iterable[tuple[str, torch.Tensor]] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` (by default the model's ``state_dict()``) under the names the model's checkpoint files hold them,
    as ``save_pretrained`` writes them: transformers' own conversion mapping reversed (``revert_weight_conversion``,
    which ``save_pretrained`` calls), so a family that keeps tensors in another layout in memory than on disk is
    exported as on disk. Transformers 5 holds a MoE's experts fused (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
    ``mlp.experts.down_proj`` ``[E, H, I]``), its checkpoints per expert (``mlp.experts.{j}.gate_proj.weight``
    ``[I, H]``, ...): this is the one naming of MoE weights that every trainer sends and every engine (SGLang
    included) loads. Converted one decoder layer at a time (a conversion never spans layers), so an export holds a
    single layer's converted copies at once; a tensor no conversion touches is passed on as it is (no copy)."""
    items = model.state_dict().items() if named is None else named
    for _, group in itertools.groupby(items, key=lambda item: _layer_of(item[0])):
        yield from revert_weight_conversion(model, dict(group)).items()


def _layer_of(name: str) -> str:
    """The decoder layer ``name`` belongs to (``model.layers.3``), ``""`` outside the layers."""
    match = _LAYER.match(name)
    return match.group(1) if match else ""


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
"""The files an HF tokenizer may be saved as (every format transformers writes or reads)."""


def tokenizer_files(path: str | Path) -> list[Path]:
    """The tokenizer files present in the checkpoint directory ``path`` (empty when it holds no tokenizer)."""
    return [Path(path) / name for name in TOKENIZER_FILES if (Path(path) / name).is_file()]


def save_hf_checkpoint(
    directory: str | Path, tensors: Mapping[str, torch.Tensor], hf_config: Any, *, tokenizer_from: str | Path | None
) -> None:
    """Write ``config.json``, ``model.safetensors`` (HF names; a tied head left out, as transformers does) and a
    copy of the tokenizer files of the checkpoint directory ``tokenizer_from`` (the run's model), so that the
    checkpoint is a model directory of its own (``--model CHECKPOINT``). ``None`` writes no tokenizer."""
    from safetensors.torch import save_file  # deferred: only trainers write checkpoints

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(directory)
    save_file(
        {name: tensor.detach().contiguous() for name, tensor in tensors.items()},
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    if tokenizer_from is not None:
        copy_tokenizer_files(tokenizer_from, directory)


def copy_tokenizer_files(source: str | Path, directory: str | Path) -> list[Path]:
    """Copy the tokenizer files of the checkpoint directory ``source`` into ``directory``; an error when ``source``
    holds none (a checkpoint without its tokenizer cannot be used as a model)."""
    files = tokenizer_files(source)
    if not files:
        raise MilesError(
            f"model directory {str(source)!r} holds no tokenizer files (one of "
            f"{', '.join(TOKENIZER_FILES[:4])}, ...): a checkpoint needs its tokenizer"
        )
    return [Path(shutil.copy2(file, Path(directory) / file.name)) for file in files]


def load_tokenizer(model_path: Path) -> Any:
    """The tokenizer of the model directory; a directory without tokenizer files, or one transformers cannot
    load, is an error naming the directory and what is missing."""
    require_checkpoint_dir(model_path)
    if not tokenizer_files(model_path):
        raise MilesError(
            f"model directory {str(model_path)!r} holds no tokenizer files (one of "
            f"{', '.join(TOKENIZER_FILES)}): copy the tokenizer of the model it was trained from into "
            "it (checkpoints of miles train hold theirs)"
        )
    try:
        return transformers.AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except Exception as exc:  # transformers raises many types
        raise MilesError(f"cannot load a tokenizer from {str(model_path)!r}: {type(exc).__name__}: {exc}") from None
