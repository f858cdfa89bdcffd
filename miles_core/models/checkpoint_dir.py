"""An HF checkpoint directory's checks and its ``config.json``, read without torch or transformers: what a config
check needs (``miles config show`` must not wait for torch's import to learn a model's family)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from miles_core.errors import ConfigError, MilesError
from miles_core.user_files import parse_json_text, read_text

ADAPTER_CONFIG = "adapter_config.json"
"""The file that makes a directory a peft adapter (a LoRA checkpoint without its base)."""
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
        raise MilesError(_no_model_config(path))
    return path


def _no_model_config(path: Path) -> str:
    """Why a directory without ``config.json`` is no model: a LoRA adapter's (peft's ``adapter_config.json``) is
    named as one, with its base model where it records one."""
    if not (path / ADAPTER_CONFIG).is_file():
        return f"model directory {str(path)!r} has no config.json (expected an HF checkpoint directory)"
    base = ""
    try:
        what = f"{ADAPTER_CONFIG} of {str(path)!r}"
        text = read_text(path / ADAPTER_CONFIG, what=what, expected="peft's adapter config (JSON)", limit=1 << 20)
        recorded = parse_json_text(text, what=what)
        if isinstance(recorded, dict) and isinstance(recorded.get("base_model_name_or_path"), str):
            base = f" of the base model {recorded['base_model_name_or_path'][:200]!r}"
    except ConfigError:
        pass  # the adapter is named without its base
    return (
        f"model directory {str(path)!r} holds a LoRA adapter ({ADAPTER_CONFIG}{base}) without its base model: give "
        "the base model as --model (a LoRA run's own checkpoints hold the base and the adapter: --run-resume)"
    )


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


CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""The ``config.json`` keys that bound a model's context, as the local engine reads them."""
