"""Building a megatron-core ``GPTModel`` from an HF config (Llama, Qwen2, Qwen3: GQA, RMSNorm, SwiGLU, RoPE,
qk-layernorm, tied or untied embeddings)."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from miles_plugins_megatron.conversion import attention_geometry, check_tensor_parallel


def rope_theta(hf_config: Any) -> float:
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    return float(getattr(hf_config, "rope_theta", None) or parameters.get("rope_theta") or 10000.0)


def transformer_config(
    hf_config: Any, *, tensor_parallel: int = 1, dtype: torch.dtype = torch.float32
) -> TransformerConfig:
    """The ``TransformerConfig`` equivalent to an HF config (CPU initialisation, no dropout)."""
    heads, groups, head_dim, hidden = attention_geometry(hf_config)
    check_tensor_parallel(hf_config, tensor_parallel)
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
        qk_layernorm=hf_config.model_type == "qwen3",
        tensor_model_parallel_size=tensor_parallel,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )


def build_gpt_model(hf_config: Any, *, tensor_parallel: int = 1, dtype: torch.dtype = torch.float32) -> GPTModel:
    """An untrained ``GPTModel`` with the HF config's shapes (parallel state must be initialised)."""
    config = transformer_config(hf_config, tensor_parallel=tensor_parallel, dtype=dtype)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm),
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(rope_theta(hf_config)),
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
    )
    # Every weight in ``dtype``, as megatron's Float16Module does: without Apex or TransformerEngine the norms come
    # from torch and ignore params_dtype (seen on an H200: float32 norms in a bfloat16 model).
    return model.to(dtype)
