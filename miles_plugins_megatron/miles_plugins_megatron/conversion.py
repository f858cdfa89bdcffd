"""HF <-> Megatron weight layouts for the Llama, Qwen2 and Qwen3 families (unsharded, TP=1).

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


def hf_to_megatron(state: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """Megatron ``GPTModel`` parameters from an HF state dict."""
    heads, groups, head_dim, _ = attention_geometry(hf_config)
    out = {"embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": state["model.norm.weight"]}  # fmt: skip
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
        out[f"{mg}mlp.linear_fc1.weight"] = torch.cat([state[f"{hf}mlp.gate_proj.weight"],
                                                       state[f"{hf}mlp.up_proj.weight"]])  # fmt: skip
        for hf_name, mg_name in _RENAMES.items():
            if f"{hf}{hf_name}" in state:
                out[f"{mg}{mg_name}"] = state[f"{hf}{hf_name}"]
    return out


def megatron_to_hf(state: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """HF names and layouts from Megatron ``GPTModel`` parameters (the exact inverse of :func:`hf_to_megatron`)."""
    heads, groups, head_dim, _ = attention_geometry(hf_config)
    q_rows = heads // groups * head_dim
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
           "model.norm.weight": state["decoder.final_layernorm.weight"]}  # fmt: skip
    if not hf_config.tie_word_embeddings:
        out["lm_head.weight"] = state["output_layer.weight"]
    for layer in range(hf_config.num_hidden_layers):
        hf, mg = f"model.layers.{layer}.", f"decoder.layers.{layer}."
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
