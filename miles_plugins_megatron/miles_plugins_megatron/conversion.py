"""HF <-> Megatron weight layouts for the Llama, Qwen2 and Qwen3 families, and their tensor-parallel shards.

Megatron fuses the attention input projection per query group as ``[q heads of the group; k; v]`` and the MLP input
projection as ``[gate; up]``; everything else is a rename. Both directions are exact inverses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from miles_core.errors import MilesError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")

_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}


def attention_geometry(hf_config: Any) -> tuple[int, int, int, int]:
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise MilesError(f"unsupported architecture {hf_config.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
    heads = hf_config.num_attention_heads
    groups = hf_config.num_key_value_heads or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return heads, groups, head_dim, hf_config.hidden_size


def check_tensor_parallel(hf_config: Any, tensor_parallel: int) -> None:
    """A :class:`MilesError` unless ``tensor_parallel`` divides the heads, key/value heads and vocabulary."""
    heads, groups, _, _ = attention_geometry(hf_config)
    if tensor_parallel < 1 or heads % tensor_parallel or groups % tensor_parallel:
        raise MilesError(
            f"tensor parallel size {tensor_parallel} must divide the attention heads ({heads}) and the key/value "
            f"heads ({groups}) of this {hf_config.model_type} model (--megatron-tensor-parallel)"
        )
    if hf_config.vocab_size % tensor_parallel:
        raise MilesError(
            f"tensor parallel size {tensor_parallel} must divide the vocabulary ({hf_config.vocab_size}) of this "
            f"model: the vocabulary is split across tensor-parallel ranks (--megatron-tensor-parallel)"
        )


def hf_to_megatron(state: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """Megatron ``GPTModel`` parameters from an HF state dict."""
    heads, groups, head_dim, _ = attention_geometry(hf_config)
    out = {
        "embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": state["model.norm.weight"],
    }
    if not hf_config.tie_word_embeddings:
        out["output_layer.weight"] = state["lm_head.weight"]
    for layer in range(hf_config.num_hidden_layers):
        hf, mg = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for kind in ("weight", "bias"):
            parts = [state.get(f"{hf}self_attn.{p}_proj.{kind}") for p in "qkv"]
            if parts[0] is None:
                continue
            trailing = parts[0].shape[1:]
            q = parts[0].reshape(groups, heads // groups * head_dim, *trailing)
            k, v = (t.reshape(groups, head_dim, *trailing) for t in parts[1:])
            out[f"{mg}self_attention.linear_qkv.{kind}"] = torch.cat([q, k, v], dim=1).reshape(-1, *trailing)
        out[f"{mg}mlp.linear_fc1.weight"] = torch.cat(
            [state[f"{hf}mlp.gate_proj.weight"], state[f"{hf}mlp.up_proj.weight"]]
        )
        for hf_name, mg_name in _RENAMES.items():
            if f"{hf}{hf_name}" in state:
                out[f"{mg}{mg_name}"] = state[f"{hf}{hf_name}"]
    return out


def megatron_to_hf(state: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """HF names and layouts from Megatron ``GPTModel`` parameters (the exact inverse of :func:`hf_to_megatron`).

    ``state`` may hold only some layers (or only the embedding and head): only what is present is converted, so an
    exporter can convert layer by layer.
    """
    out = {}
    if "embedding.word_embeddings.weight" in state:
        out["model.embed_tokens.weight"] = state["embedding.word_embeddings.weight"]
    for layer in range(hf_config.num_hidden_layers):
        if f"decoder.layers.{layer}.mlp.linear_fc1.weight" in state:
            out.update(megatron_layer_to_hf(state, hf_config, layer))
    if "decoder.final_layernorm.weight" in state:
        out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
    if not hf_config.tie_word_embeddings and "output_layer.weight" in state:
        out["lm_head.weight"] = state["output_layer.weight"]
    return out


def megatron_layer_to_hf(state: Mapping[str, torch.Tensor], hf_config: Any, layer: int) -> dict[str, torch.Tensor]:
    """One decoder layer's HF tensors: the fused QKV split per query group, the fused gate/up split, renames."""
    heads, groups, head_dim, _ = attention_geometry(hf_config)
    q_rows = heads // groups * head_dim
    hf, mg = f"model.layers.{layer}.", f"decoder.layers.{layer}."
    out = {}
    for kind in ("weight", "bias"):
        fused = state.get(f"{mg}self_attention.linear_qkv.{kind}")
        if fused is None:
            continue
        trailing = fused.shape[1:]
        per_group = fused.reshape(groups, q_rows + 2 * head_dim, *trailing)
        q, k, v = per_group.split([q_rows, head_dim, head_dim], dim=1)
        for name, part in zip("qkv", (q, k, v), strict=True):
            out[f"{hf}self_attn.{name}_proj.{kind}"] = part.reshape(-1, *trailing)
    gate, up = state[f"{mg}mlp.linear_fc1.weight"].chunk(2, dim=0)
    out[f"{hf}mlp.gate_proj.weight"], out[f"{hf}mlp.up_proj.weight"] = gate, up
    for hf_name, mg_name in _RENAMES.items():
        if f"{mg}{mg_name}" in state:
            out[f"{hf}{hf_name}"] = state[f"{mg}{mg_name}"]
    return out


# -- tensor parallelism ----------------------------------------------------------------------------------------

FUSED_GATE_UP_SUFFIX = "mlp.linear_fc1.weight"
"""Megatron shards ``[gate; up]`` so that each rank holds ``[gate_r; up_r]``: it is not a plain slice of the
unsharded tensor, so sharding and gathering treat it apart."""


def shard_for_rank(name: str, full: torch.Tensor, local_shape: torch.Size, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the unsharded Megatron tensor ``full`` whose local shape is ``local_shape``.

    Tensors whose local shape equals the full one are replicated. Otherwise the partitioned dimension is the one
    that differs; fused QKV is laid out per query group, so contiguous slices hold whole groups.
    """
    if tuple(full.shape) == tuple(local_shape):
        return full
    dims = [d for d, (a, b) in enumerate(zip(full.shape, local_shape, strict=True)) if a != b]
    if len(dims) != 1 or full.shape[dims[0]] != local_shape[dims[0]] * size:
        raise MilesError(f"{name}: shape {tuple(full.shape)} does not shard into {size} x {tuple(local_shape)}")
    dim = dims[0]
    if name.endswith(FUSED_GATE_UP_SUFFIX):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    return full.chunk(size, dim=dim)[rank]


def merge_shards(name: str, shards: list[torch.Tensor], partition_dim: int) -> torch.Tensor:
    """The unsharded tensor from every rank's shard (the inverse of :func:`shard_for_rank`)."""
    if len(shards) == 1:
        return shards[0]
    if name.endswith(FUSED_GATE_UP_SUFFIX):
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([half[0] for half in halves] + [half[1] for half in halves])
    return torch.cat(shards, dim=partition_dim)
