"""HF checkpoint directories (config.json + safetensors + the tokenizer's files): loaded with transformers with
clear errors, and written by trainers."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.core_model_loading import revert_weight_conversion  # what save_pretrained calls

from miles_core.errors import ConfigError, MilesError
from miles_core.user_files import parse_json_text, read_text

MAX_CONFIG_BYTES = 16 << 20
"""A model's ``config.json`` is a few KiB (a large MoE's, with its per-layer lists, well under 1 MiB)."""


def require_checkpoint_dir(path: str | Path) -> Path:
    """``path`` as a Path, or an error when it is not a directory, holds no ``config.json``, or holds a FIFO, a
    device or a socket (transformers would wait on one forever, or read it without end)."""
    path = Path(path)
    try:
        info = os.stat(path)
    except (OSError, ValueError) as exc:  # ValueError: a NUL character
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise MilesError(f"model directory {str(path)!r}: {reason} (expected an HF checkpoint directory)") from None
    if not stat.S_ISDIR(info.st_mode):
        raise MilesError(
            f"model directory {str(path)!r} is not a directory (expected an HF checkpoint directory: "
            "config.json, weights and tokenizer files)"
        )
    for entry in os.scandir(path):
        try:
            mode = entry.stat().st_mode  # follows symlinks: what transformers would open
        except OSError:
            continue  # a dangling link: transformers reports it if it needs the file
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise MilesError(
                f"model directory {str(path)!r} holds {entry.name!r}, which is not a regular file (a "
                "FIFO, device or socket); remove it or point --model at a copy without it"
            )
    if not (path / "config.json").is_file():
        raise MilesError(f"model directory {str(path)!r} has no config.json (expected an HF checkpoint directory)")
    return path


def read_model_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of the checkpoint directory ``path`` as a mapping, read within bounds as strict JSON."""
    what = f"config.json of model directory {str(path)!r}"
    try:
        text = read_text(
            Path(require_checkpoint_dir(path)) / "config.json",
            what=what,
            expected="an HF config.json (a JSON object)",
            limit=MAX_CONFIG_BYTES,
        )
        data = parse_json_text(text, what=what)
    except ConfigError as exc:
        raise MilesError(f"cannot load model from {str(path)!r}: {exc}") from None
    if not isinstance(data, dict):
        raise MilesError(
            f"cannot load model from {str(path)!r}: {what} holds a {type(data).__name__}, not a JSON object"
        )
    return data


def checkpoint_family(path: str | Path) -> str:
    """The model family (``model_type`` of ``config.json``) of a checkpoint directory, read without transformers."""
    model_type = read_model_config(path).get("model_type")
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


CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""The ``config.json`` keys that bound a model's context, as the local engine reads them."""


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
