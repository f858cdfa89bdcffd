"""Building a megatron-core ``GPTModel`` from an HF config (Llama, Qwen2, Qwen3, Qwen3-MoE: GQA, RMSNorm, SwiGLU,
RoPE, qk-layernorm, tied or untied embeddings, routed experts)."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from miles_plugins_megatron.conversion import (
    QK_NORM_MODEL_TYPES,
    attention_geometry,
    check_expert_parallel,
    check_tensor_parallel,
    moe_layer_pattern,
    num_experts,
)

MOE_TOKEN_DISPATCHER = "allgather"
"""The dispatcher that runs on CPU and gloo: "alltoall" creates a CUDA stream when it is built."""


def _define_missing_transformer_engine_gemm() -> None:
    """megatron-core 0.16.1's router gating reads ``te_general_gemm``, which its ``moe_utils`` defines only when
    TransformerEngine imports (a ``NameError`` otherwise): define it as absent, so the torch path is taken."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def rope_theta(hf_config: Any) -> float:
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    return float(getattr(hf_config, "rope_theta", None) or parameters.get("rope_theta") or 10000.0)


def moe_settings(hf_config: Any, *, expert_parallel: int = 1) -> dict[str, Any]:
    """``TransformerConfig`` fields of the experts (none for a dense model).

    Qwen3-MoE routes by softmax over all experts, then top-k, renormalised over the k when ``norm_topk_prob``.
    Megatron's "pre-softmax" routing is the former; without it, it takes the softmax of the top-k logits, which is
    the renormalised form. No load-balancing loss and no capacity limit: the forward is transformers' exactly.
    """
    pattern = moe_layer_pattern(hf_config)
    if not any(pattern):
        return {}
    return {
        "num_moe_experts": num_experts(hf_config),
        "moe_router_topk": hf_config.num_experts_per_tok,
        "moe_ffn_hidden_size": hf_config.moe_intermediate_size,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not hf_config.norm_topk_prob,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": MOE_TOKEN_DISPATCHER,
        "moe_grouped_gemm": False,
        "moe_layer_freq": [int(sparse) for sparse in pattern],
        "expert_model_parallel_size": expert_parallel,
    }


def transformer_config(
    hf_config: Any, *, tensor_parallel: int = 1, expert_parallel: int = 1, dtype: torch.dtype = torch.float32
) -> TransformerConfig:
    """The ``TransformerConfig`` equivalent to an HF config (CPU initialisation, no dropout)."""
    heads, groups, head_dim, hidden = attention_geometry(hf_config)
    check_tensor_parallel(hf_config, tensor_parallel)
    check_expert_parallel(hf_config, expert_parallel)
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=hf_config.model_type == "qwen2",
        qk_layernorm=hf_config.model_type in QK_NORM_MODEL_TYPES,
        tensor_model_parallel_size=tensor_parallel,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        **moe_settings(hf_config, expert_parallel=expert_parallel),
    )


def build_gpt_model(
    hf_config: Any, *, tensor_parallel: int = 1, expert_parallel: int = 1, dtype: torch.dtype = torch.float32
) -> GPTModel:
    """An untrained ``GPTModel`` with the HF config's shapes (parallel state must be initialised)."""
    config = transformer_config(
        hf_config, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel, dtype=dtype
    )
    if config.num_moe_experts:  # per-layer specs: MoE layers and, where the HF config says so, dense ones
        _define_missing_transformer_engine_gemm()
        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    else:
        layer_spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(rope_theta(hf_config)),
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
    )
    # Every weight in ``dtype``, as megatron's Float16Module does: without Apex or TransformerEngine the norms come
    # from torch and ignore params_dtype (seen on an H200: float32 norms in a bfloat16 model).
    return model.to(dtype)
