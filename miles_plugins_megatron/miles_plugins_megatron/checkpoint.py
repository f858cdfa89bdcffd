"""HF checkpoint directories for the Megatron backend: checked against their config before any rank starts and read
into one state dict (trainers write them with :func:`miles_core.models.hf_checkpoint.save_hf_checkpoint`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file

from miles_core import MilesError, checkpoint_named_tensors, require_checkpoint_dir
from miles_plugins_megatron.conversion import attention_geometry


def read_hf_config(path: str | Path) -> Any:
    """The HF config of the checkpoint directory ``path``, any architecture transformers knows."""
    path = require_checkpoint_dir(path)
    try:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises many types for a bad config.json
        raise MilesError(f"cannot read the HF config in {str(path)!r}: {type(exc).__name__}: {exc}") from None


def load_hf_config(path: str | Path) -> Any:
    """The HF config of a checkpoint of an architecture that the megatron-core GPTModel path supports."""
    config = read_hf_config(path)
    attention_geometry(config)  # unsupported architectures fail here
    return config


def safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MilesError(f"model directory {str(path)!r} holds no *.safetensors file")
    return files


def expected_hf_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config holds, under its checkpoint name (as ``save_pretrained`` writes
    it: transformers' conversion reversed, so a MoE's fused experts are one tensor per expert and DeepSeek-V4's
    tensors have its original names), with its shape (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    shapes = {name: tuple(tensor.shape) for name, tensor in checkpoint_named_tensors(model)}
    if hf_config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def check_checkpoint(path: str | Path, hf_config: Any) -> None:
    """Raise a :class:`MilesError` listing every tensor that is missing, unexpected or of the wrong shape."""
    expected = expected_hf_shapes(hf_config)
    found: dict[str, tuple[int, ...]] = {}
    for file in safetensors_files(Path(path)):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                found[name] = tuple(handle.get_slice(name).get_shape())
    if hf_config.tie_word_embeddings:
        found.pop("lm_head.weight", None)  # some writers store the tied head anyway
    problems = [f"{name}: missing" for name in expected if name not in found]
    problems += [f"{name}: not a weight of a {hf_config.model_type} model" for name in found if name not in expected]
    problems += [
        f"{name}: shape {found[name]}, the config needs {shape}"
        for name, shape in expected.items()
        if name in found and found[name] != shape
    ]
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise MilesError(f"checkpoint {str(path)!r} does not match its config.json ({len(problems)} problems): {shown}")


def read_hf_state(path: str | Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(Path(path)):
        state.update(load_file(str(file)))
    return state
