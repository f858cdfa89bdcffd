"""HF <-> Megatron weight layouts for the Llama, Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V3 families, and their parallel
shards.

Megatron fuses the attention input projection per query group as ``[q heads of the group; k; v]`` and the MLP input
projection as ``[gate; up]`` (each expert's too); everything else is a rename. Both directions are exact inverses.

Qwen3-MoE experts: transformers 5 holds them fused in memory (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, each
expert ``[gate; up]``, and ``mlp.experts.down_proj`` ``[E, H, I]``) but writes and reads checkpoints per expert
(``mlp.experts.{j}.gate_proj.weight`` and so on), the names the inference engines load. Both are read; the export
uses the per-expert checkpoint names. Megatron names expert ``j`` of an expert-parallel rank ``r`` holding ``L``
experts ``mlp.experts.local_experts.{j}``: it is global expert ``r * L + j``. A full (unsharded) Megatron state dict
here names every expert by its global index.

DeepSeek-V3: megatron-core's multi-latent attention keeps transformers' layouts (the query up projection per head as
``[nope; rope]``, the key/value down projection as ``[latent; rope]``, the key/value up projection per head as
``[k nope; v]``), so its attention is a rename; the router's ``e_score_correction_bias`` is Megatron's
``router.expert_bias`` and the shared experts' gate/up are fused as a dense MLP's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from miles_core import MilesError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
MOE_MODEL_TYPES = ("qwen3_moe", "deepseek_v3")
MLA_MODEL_TYPES = ("deepseek_v3",)
"""Multi-latent attention (megatron-core's ``MLASelfAttention``) instead of fused-QKV attention."""
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")

_COMMON_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_RENAMES = {
    **_COMMON_RENAMES,
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}
_MLA_RENAMES = {
    **_COMMON_RENAMES,
    "self_attn.q_proj.weight": "self_attention.linear_q_proj.weight",  # when q_lora_rank is None
    "self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
    "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight",
    "self_attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
    "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
    "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
    "mlp.gate.e_score_correction_bias": "mlp.router.expert_bias",
    "mlp.shared_experts.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
}


def attention_geometry(hf_config: Any) -> tuple[int, int, int, int]:
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise MilesError(f"unsupported architecture {hf_config.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
    if hf_config.model_type == "deepseek_v3":
        check_deepseek_v3(hf_config)
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
    if hf_config.model_type in MLA_MODEL_TYPES:
        latent = {"q_lora_rank": hf_config.q_lora_rank or 0}
        latent["kv_lora_rank + qk_rope_head_dim"] = hf_config.kv_lora_rank + hf_config.qk_rope_head_dim
        for what, size in latent.items():
            if size % tensor_parallel:
                raise MilesError(
                    f"tensor parallel size {tensor_parallel} must divide {what} ({size}) of this "
                    f"{hf_config.model_type} model: megatron-core splits the latent down projections across "
                    "tensor-parallel ranks (--megatron-tensor-parallel)"
                )
    if hf_config.vocab_size % tensor_parallel:
        raise MilesError(
            f"tensor parallel size {tensor_parallel} must divide the vocabulary ({hf_config.vocab_size}) of this "
            f"model: the vocabulary is split across tensor-parallel ranks (--megatron-tensor-parallel)"
        )


def check_deepseek_v3(hf_config: Any) -> None:
    """A :class:`MilesError` for a DeepSeek-V3 config whose forward megatron-core would not compute as transformers
    does (each case names the setting, its value and what is supported)."""
    name = "this deepseek_v3 model's config.json"
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") not in ("default", "yarn"):
        raise MilesError(f"{name} has rope_type {rope['rope_type']!r}: 'default' and 'yarn' RoPE are supported")
    if rope.get("rope_type") == "yarn":
        _check_yarn(name, rope)
    if not getattr(hf_config, "rope_interleave", True):
        raise MilesError(f"{name} has rope_interleave false: megatron-core's MLA rotates interleaved pairs only")
    if getattr(hf_config, "attention_bias", False):
        raise MilesError(f"{name} has attention_bias true: megatron-core's MLA projections have no bias")
    if hf_config.num_experts_per_tok > 1 and not hf_config.norm_topk_prob:
        raise MilesError(
            f"{name} has norm_topk_prob false: megatron-core's sigmoid router always renormalises the top-k "
            "weights; only norm_topk_prob true is supported"
        )
    groups, topk_groups = hf_config.n_group or 1, hf_config.topk_group or 1
    if topk_groups < groups and hf_config.num_experts_per_tok // topk_groups != 2:
        raise MilesError(
            f"{name} limits routing to topk_group={topk_groups} of n_group={groups} groups with "
            f"num_experts_per_tok={hf_config.num_experts_per_tok}: transformers scores a group by its top 2 experts, "
            "megatron-core by its top num_experts_per_tok // topk_group; supported when that quotient is 2"
        )
    if hf_config.first_k_dense_replace >= hf_config.num_hidden_layers:
        raise MilesError(
            f"{name} has first_k_dense_replace={hf_config.first_k_dense_replace} >= num_hidden_layers="
            f"{hf_config.num_hidden_layers}: a DeepSeek-V3 without MoE layers is not supported"
        )


def _check_yarn(name: str, rope: dict[str, Any]) -> None:
    """YaRN settings megatron-core's ``YarnRotaryEmbedding`` computes as transformers does (see ``yarn_settings``)."""
    if not rope.get("factor"):
        raise MilesError(f"{name} has YaRN RoPE without a factor: give rope_parameters.factor")
    if rope.get("attention_factor") is not None:
        raise MilesError(
            f"{name} sets YaRN's attention_factor ({rope['attention_factor']}): megatron-core derives it from factor, "
            "mscale and mscale_all_dim only; remove it"
        )
    if rope.get("mscale_all_dim") and not rope.get("mscale"):
        raise MilesError(
            f"{name} sets YaRN's mscale_all_dim ({rope['mscale_all_dim']}) without mscale: transformers then scales "
            "the rotary embedding by factor alone, which megatron-core cannot express; give mscale too"
        )
    if not rope.get("truncate", True):
        raise MilesError(f"{name} sets YaRN's truncate false: megatron-core rounds the correction range")


def num_experts(hf_config: Any) -> int:
    """The routed experts per MoE layer (0 for a dense model)."""
    if hf_config.model_type not in MOE_MODEL_TYPES:
        return 0
    return int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0) or 0)


def moe_layer_pattern(hf_config: Any) -> list[bool]:
    """Per decoder layer, whether its MLP is a mixture of experts: Qwen3-MoE makes layer ``i`` sparse unless it is
    in ``mlp_only_layers`` or ``(i + 1)`` is not a multiple of ``decoder_sparse_step``; DeepSeek-V3 makes the first
    ``first_k_dense_replace`` layers dense (transformers' rules)."""
    experts = num_experts(hf_config)
    if hf_config.model_type == "deepseek_v3":
        return [layer >= hf_config.first_k_dense_replace for layer in range(hf_config.num_hidden_layers)]
    dense_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    return [
        experts > 0 and layer not in dense_only and (layer + 1) % step == 0
        for layer in range(hf_config.num_hidden_layers)
    ]


def check_expert_parallel(hf_config: Any, expert_parallel: int, *, data_parallel: int | None = None) -> None:
    """A :class:`MilesError` unless ``expert_parallel`` divides the experts and (megatron-core's rule: the expert
    ranks are carved out of the data-parallel ranks) the data-parallel size; a dense model needs 1."""
    experts = num_experts(hf_config)
    if expert_parallel < 1 or (expert_parallel > 1 and not any(moe_layer_pattern(hf_config))):
        raise MilesError(
            f"expert parallel size {expert_parallel}: this {hf_config.model_type} model has no experts to split; "
            "use --megatron-expert-parallel 1"
        )
    if experts and experts % expert_parallel:
        raise MilesError(
            f"expert parallel size {expert_parallel} must divide the experts ({experts}) of this "
            f"{hf_config.model_type} model (--megatron-expert-parallel)"
        )
    if data_parallel is not None and data_parallel % expert_parallel:
        raise MilesError(
            f"expert parallel size {expert_parallel} must divide the data-parallel size ({data_parallel}): "
            "megatron-core places the expert-parallel ranks inside the data-parallel ones "
            "(--megatron-expert-parallel, --megatron-data-parallel)"
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
    moe = moe_layer_pattern(hf_config)
    mla = hf_config.model_type in MLA_MODEL_TYPES
    renames = _MLA_RENAMES if mla else _RENAMES
    for layer in range(hf_config.num_hidden_layers):
        hf, mg = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for kind in ("weight", "bias") if not mla else ():
            parts = [state.get(f"{hf}self_attn.{p}_proj.{kind}") for p in "qkv"]
            if parts[0] is None:
                continue
            trailing = parts[0].shape[1:]
            q = parts[0].reshape(groups, heads // groups * head_dim, *trailing)
            k, v = (t.reshape(groups, head_dim, *trailing) for t in parts[1:])
            out[f"{mg}self_attention.linear_qkv.{kind}"] = torch.cat([q, k, v], dim=1).reshape(-1, *trailing)
        if moe[layer]:
            out.update(_hf_experts_to_megatron(state, hf, mg, num_experts(hf_config)))
        else:
            out[f"{mg}mlp.linear_fc1.weight"] = torch.cat(
                [state[f"{hf}mlp.gate_proj.weight"], state[f"{hf}mlp.up_proj.weight"]]
            )
        if f"{hf}mlp.shared_experts.gate_proj.weight" in state:
            out[f"{mg}mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                [state[f"{hf}mlp.shared_experts.{part}_proj.weight"] for part in ("gate", "up")]
            )
        for hf_name, mg_name in renames.items():
            if f"{hf}{hf_name}" in state:
                out[f"{mg}{mg_name}"] = state[f"{hf}{hf_name}"]
    return out


def _hf_experts_to_megatron(
    state: Mapping[str, torch.Tensor], hf: str, mg: str, experts: int
) -> dict[str, torch.Tensor]:
    """One MoE layer's router and experts, from transformers' fused in-memory tensors or per-expert checkpoint
    names (whichever ``state`` holds)."""
    out = {f"{mg}mlp.router.weight": state[f"{hf}mlp.gate.weight"]}
    fused_gate_up = state.get(f"{hf}mlp.experts.gate_up_proj")
    for expert in range(experts):
        local = f"{mg}mlp.experts.local_experts.{expert}."
        if fused_gate_up is not None:  # [E, 2I, H]: expert j's [gate; up], already Megatron's fc1 layout
            out[f"{local}linear_fc1.weight"] = fused_gate_up[expert]
            out[f"{local}linear_fc2.weight"] = state[f"{hf}mlp.experts.down_proj"][expert]
            continue
        names = [f"{hf}mlp.experts.{expert}.{part}_proj.weight" for part in ("gate", "up", "down")]
        out[f"{local}linear_fc1.weight"] = torch.cat([state[names[0]], state[names[1]]])
        out[f"{local}linear_fc2.weight"] = state[names[2]]
    return out


def megatron_to_hf(state: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """HF names and layouts from Megatron ``GPTModel`` parameters (the exact inverse of :func:`hf_to_megatron`).

    ``state`` may hold only some layers (or only the embedding and head): only what is present is converted, so an
    exporter can convert layer by layer.
    """
    out = {}
    if "embedding.word_embeddings.weight" in state:
        out["model.embed_tokens.weight"] = state["embedding.word_embeddings.weight"]
    layers = {int(match.group(1)) for match in map(_LAYER.match, state) if match}
    for layer in sorted(layers):
        out.update(megatron_layer_to_hf(state, hf_config, layer))
    if "decoder.final_layernorm.weight" in state:
        out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
    if not hf_config.tie_word_embeddings and "output_layer.weight" in state:
        out["lm_head.weight"] = state["output_layer.weight"]
    return out


def megatron_layer_to_hf(state: Mapping[str, torch.Tensor], hf_config: Any, layer: int) -> dict[str, torch.Tensor]:
    """One decoder layer's HF tensors: the fused QKV split per query group, the fused gate/up split (per expert in a
    MoE layer, whose experts ``state`` names by their global index, and its shared experts'), renames."""
    heads, groups, head_dim, _ = attention_geometry(hf_config)
    q_rows = heads // groups * head_dim
    hf, mg = f"model.layers.{layer}.", f"decoder.layers.{layer}."
    mla = hf_config.model_type in MLA_MODEL_TYPES
    out = {}
    for kind in ("weight", "bias") if not mla else ():
        fused = state.get(f"{mg}self_attention.linear_qkv.{kind}")
        if fused is None:
            continue
        trailing = fused.shape[1:]
        per_group = fused.reshape(groups, q_rows + 2 * head_dim, *trailing)
        q, k, v = per_group.split([q_rows, head_dim, head_dim], dim=1)
        for name, part in zip("qkv", (q, k, v), strict=True):
            out[f"{hf}self_attn.{name}_proj.{kind}"] = part.reshape(-1, *trailing)
    if moe_layer_pattern(hf_config)[layer]:
        out[f"{hf}mlp.gate.weight"] = state[f"{mg}mlp.router.weight"]
        for expert in range(num_experts(hf_config)):
            local, expert_hf = f"{mg}mlp.experts.local_experts.{expert}.", f"{hf}mlp.experts.{expert}."
            gate, up = state[f"{local}linear_fc1.weight"].chunk(2, dim=0)
            out[f"{expert_hf}gate_proj.weight"], out[f"{expert_hf}up_proj.weight"] = gate, up
            out[f"{expert_hf}down_proj.weight"] = state[f"{local}linear_fc2.weight"]
        shared = state.get(f"{mg}mlp.shared_experts.linear_fc1.weight")
        if shared is not None:
            gate, up = shared.chunk(2, dim=0)
            out[f"{hf}mlp.shared_experts.gate_proj.weight"], out[f"{hf}mlp.shared_experts.up_proj.weight"] = gate, up
    else:
        gate, up = state[f"{mg}mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[f"{hf}mlp.gate_proj.weight"], out[f"{hf}mlp.up_proj.weight"] = gate, up
    for hf_name, mg_name in (_MLA_RENAMES if mla else _RENAMES).items():
        if f"{mg}{mg_name}" in state:
            out[f"{hf}{hf_name}"] = state[f"{mg}{mg_name}"]
    return out


# -- tensor parallelism ----------------------------------------------------------------------------------------

FUSED_GATE_UP_SUFFIX = "linear_fc1.weight"
"""Megatron shards ``[gate; up]`` (the dense MLP's and each expert's) so that each rank holds ``[gate_r; up_r]``: it
is not a plain slice of the unsharded tensor, so sharding and gathering treat it apart."""


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


# -- expert parallelism ----------------------------------------------------------------------------------------

_LOCAL_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def is_expert_parameter(name: str) -> bool:
    """Whether ``name`` is a routed expert's parameter (held by one expert-parallel rank only)."""
    return _LOCAL_EXPERT.match(name) is not None


def global_expert_name(name: str, *, expert_rank: int, local_experts: int) -> str:
    """The unsharded name of expert-parallel rank ``expert_rank``'s parameter ``name``: its local expert ``j`` is
    global expert ``expert_rank * local_experts + j`` (megatron-core's placement); other names are unchanged."""
    match = _LOCAL_EXPERT.match(name)
    if match is None:
        return name
    prefix, local, rest = match.groups()
    return f"{prefix}{expert_rank * local_experts + int(local)}{rest}"
