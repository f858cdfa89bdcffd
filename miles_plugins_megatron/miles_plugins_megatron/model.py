"""Building a megatron-core ``GPTModel`` from an HF config (Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3: GQA or
multi-latent attention, RMSNorm, SwiGLU, RoPE, qk-layernorm, tied or untied embeddings, routed and shared experts)."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.transformer_config import MLATransformerConfig

from miles_plugins_megatron.conversion import (
    MLA_MODEL_TYPES,
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


def _disable_missing_transformer_engine_in_mla() -> None:
    """megatron-core 0.16.1's ``multi_latent_attention`` imports TransformerEngine's layers from its extension module,
    which stands in ``MagicMock`` objects when TransformerEngine is absent, so the import succeeds and the module
    believes TransformerEngine present: ``isinstance(self.linear_proj, TELinear)`` then raises ``TypeError: isinstance()
    arg 2 must be a type``. Tell it the truth."""
    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


class MLADotProductAttention(DotProductAttention):
    """megatron-core's local attention kernel for multi-latent attention: MLA passes the key and value head sizes
    (``k_channels``, ``v_channels``), which only TransformerEngine's kernel accepts (the local one raises ``TypeError:
    DotProductAttention.__init__() got an unexpected keyword argument 'k_channels'``). The local kernel takes the head
    sizes from its inputs and sizes its output by ``kv_channels``, which the config sets to the value head size."""

    def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)


def _with_mla_core_attention(layer_specs: list[Any]) -> None:
    for spec in layer_specs:
        spec.submodules.self_attention.submodules.core_attention = MLADotProductAttention


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
    if hf_config.model_type == "deepseek_v3":
        return _deepseek_v3_moe_settings(hf_config, expert_parallel=expert_parallel)
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


def _deepseek_v3_moe_settings(hf_config: Any, *, expert_parallel: int) -> dict[str, Any]:
    """DeepSeek-V3's router in megatron-core's terms: sigmoid scores; the selection bias ``e_score_correction_bias``
    (megatron's ``expert_bias``, held fixed: megatron-core updates it only in its own ``finalize_model_grads``, which
    Miles does not run, as transformers never updates it); top-k over the best ``topk_group`` of ``n_group`` groups;
    the top-k weights renormalised (``norm_topk_prob``, checked) and scaled by ``routed_scaling_factor``; the shared
    experts as one MLP of ``n_shared_experts`` times the expert size, added to the routed experts' output."""
    groups, topk_groups = hf_config.n_group or 1, hf_config.topk_group or 1
    limited = topk_groups < groups  # selecting every group is no limit
    return {
        "num_moe_experts": num_experts(hf_config),
        "moe_router_topk": hf_config.num_experts_per_tok,
        "moe_ffn_hidden_size": hf_config.moe_intermediate_size,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": groups if limited else None,
        "moe_router_group_topk": topk_groups if limited else None,
        "moe_router_topk_scaling_factor": float(hf_config.routed_scaling_factor),
        "moe_shared_expert_intermediate_size": hf_config.moe_intermediate_size * hf_config.n_shared_experts or None,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": MOE_TOKEN_DISPATCHER,
        "moe_grouped_gemm": False,
        "moe_layer_freq": [int(sparse) for sparse in moe_layer_pattern(hf_config)],
        "expert_model_parallel_size": expert_parallel,
    }


def mla_settings(hf_config: Any) -> dict[str, Any]:
    """``MLATransformerConfig`` fields of DeepSeek-V3's multi-latent attention (plain or YaRN RoPE). ``kv_channels`` is
    the value head size: the local attention kernel sizes its output by it."""
    return {
        "q_lora_rank": hf_config.q_lora_rank,
        "kv_lora_rank": hf_config.kv_lora_rank,
        "qk_head_dim": hf_config.qk_nope_head_dim,
        "qk_pos_emb_head_dim": hf_config.qk_rope_head_dim,
        "v_head_dim": hf_config.v_head_dim,
        "kv_channels": hf_config.v_head_dim,
        "rotary_base": rope_theta(hf_config),
        **yarn_settings(hf_config),
    }


def yarn_settings(hf_config: Any) -> dict[str, Any]:
    """MLA's RoPE fields: plain RoPE (``rotary_scaling_factor`` 1, so the softmax scale stays 1/sqrt(q head size)),
    or YaRN as transformers computes it (checked by ``conversion.check_deepseek_v3``). transformers scales cos/sin by
    ``mscale / mscale_all_dim`` (both YaRN's ``0.1 * m * ln(factor) + 1``) when both are given, else by the one of
    ``factor`` alone, and the softmax by the square of ``mscale_all_dim``'s; megatron-core always takes the ratio and
    the same softmax factor, so without ``mscale_all_dim`` it gets ``mscale`` 1 and ``mscale_all_dim`` 0."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "yarn":
        return {"rope_type": "rope", "rotary_scaling_factor": 1.0}
    both = bool(rope.get("mscale")) and bool(rope.get("mscale_all_dim"))
    return {
        "rope_type": "yarn",
        "rotary_scaling_factor": float(rope["factor"]),
        "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        "beta_fast": float(rope.get("beta_fast") or 32),
        "beta_slow": float(rope.get("beta_slow") or 1),
        "mscale": float(rope["mscale"]) if both else 1.0,
        "mscale_all_dim": float(rope["mscale_all_dim"]) if both else 0.0,
    }


def needs_sequence_parallel(hf_config: Any, tensor_parallel: int) -> bool:
    """Whether the model runs with sequence parallelism: megatron-core trains MoE layers under tensor parallelism
    only with it, and multi-latent attention's shared RoPE key gets its whole gradient only with it (see
    :class:`SequenceShardedDownProjection`). Other models keep whole sequences on every tensor-parallel rank."""
    return tensor_parallel > 1 and (any(moe_layer_pattern(hf_config)) or hf_config.model_type in MLA_MODEL_TYPES)


class SequenceShardedDownProjection(ColumnParallelLinear):
    """Multi-latent attention's down projection under sequence parallelism, answering as a replicated linear on the
    sequence shard: ``[s/tp, b, latent]``, every latent column on every rank.

    megatron-core's local spec makes the down projections column-parallel; MLA then gathers the latent over
    tensor-parallel ranks, whose backward keeps each rank's own columns of the gradient. That is the whole gradient
    for the latents, but not for the RoPE key (``k_pos_emb``), which every rank's heads share: each rank holds only
    its heads' part, so the other ranks' parts were lost (measured: a DeepSeek-V3 step's gradient norm 0.16% low).
    Answering sequence-sharded, MLA takes its other branch, which gathers the RoPE key over the sequence, and its
    backward (a reduce-scatter) sums every rank's part. The weight stays column-sharded: names, shapes and the
    export are unchanged."""

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        from megatron.core.tensor_parallel.mappings import (
            gather_from_tensor_model_parallel_region,
            scatter_to_sequence_parallel_region,
        )

        local, bias = super().forward(input_, *args, **kwargs)  # [s, b, latent/tp]: the sequence gathered
        return scatter_to_sequence_parallel_region(gather_from_tensor_model_parallel_region(local)), bias


def _with_sequence_sharded_down_projections(model: torch.nn.Module) -> None:
    """Give every multi-latent attention's down projections the :class:`SequenceShardedDownProjection` answer (the
    class is swapped after construction: megatron-core accepts only its own classes in the spec)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    for module in model.modules():
        if isinstance(module, MLASelfAttention):
            for name in ("linear_q_down_proj", "linear_kv_down_proj"):
                projection = getattr(module, name, None)
                if type(projection) is ColumnParallelLinear:
                    projection.__class__ = SequenceShardedDownProjection


class SequenceShardNorm:
    """torch's RMSNorm for a norm that sees this rank's shard of the sequence under sequence parallelism (the
    hidden-state norms, MLA's latent norms): its weight is marked ``sequence_parallel``, so its gradient, partial on
    each tensor-parallel rank, is summed over them. megatron-core's own torch norm refuses sequence parallelism, and
    its other norms need TransformerEngine or Apex."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm


class HeadNorm:
    """torch's RMSNorm for a per-head norm (qk-layernorm), which sees whole sequences of this rank's heads under
    sequence parallelism too (its gradient is summed over tensor-parallel ranks by name, not by the mark)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        return torch.nn.RMSNorm(hidden_size, eps=eps)


def _with_sequence_parallel_norms(spec: Any, num_layers: int) -> Any:
    """The block spec of ``spec`` (a block's, or one layer's for every layer) with torch norms that accept sequence
    parallelism (the layer specs share their submodules, which are changed in place)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    block_spec = (
        spec if isinstance(spec, TransformerBlockSubmodules) else TransformerBlockSubmodules([spec] * num_layers)
    )
    block_spec.layer_norm = SequenceShardNorm
    for spec in block_spec.layer_specs:
        layer = spec.submodules
        layer.input_layernorm, layer.pre_mlp_layernorm = SequenceShardNorm, SequenceShardNorm
        attention = layer.self_attention.submodules
        latent = hasattr(attention, "kv_layernorm")  # multi-latent attention: norms of the sequence-sharded latents
        for field in ("q_layernorm", "k_layernorm", "kv_layernorm"):
            if getattr(attention, field, IdentityOp) is not IdentityOp:
                setattr(attention, field, SequenceShardNorm if latent else HeadNorm)
    return block_spec


def transformer_config(
    hf_config: Any, *, tensor_parallel: int = 1, expert_parallel: int = 1, dtype: torch.dtype = torch.float32
) -> TransformerConfig:
    """The ``TransformerConfig`` equivalent to an HF config (CPU initialisation, no dropout; sequence parallelism
    where :func:`needs_sequence_parallel`)."""
    heads, groups, head_dim, hidden = attention_geometry(hf_config)
    check_tensor_parallel(hf_config, tensor_parallel)
    check_expert_parallel(hf_config, expert_parallel)
    mla = hf_config.model_type in MLA_MODEL_TYPES
    attention = mla_settings(hf_config) if mla else {"num_query_groups": groups, "kv_channels": head_dim}
    return (MLATransformerConfig if mla else TransformerConfig)(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=hf_config.model_type == "qwen2",
        qk_layernorm=hf_config.model_type in QK_NORM_MODEL_TYPES or mla,  # MLA: the latents' norms
        tensor_model_parallel_size=tensor_parallel,
        sequence_parallel=needs_sequence_parallel(hf_config, tensor_parallel),
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        **attention,
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
        layer_specs = layer_spec.layer_specs
    else:
        layer_spec = get_gpt_layer_local_spec(
            qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention
        )
        layer_specs = [layer_spec]
    if config.sequence_parallel:
        layer_spec = _with_sequence_parallel_norms(layer_spec, config.num_layers)
    if config.multi_latent_attention:
        _disable_missing_transformer_engine_in_mla()
        _with_mla_core_attention(layer_specs)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(rope_theta(hf_config)),
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
    )
    if config.multi_latent_attention and config.sequence_parallel:
        _with_sequence_sharded_down_projections(model)
    # Every weight in ``dtype``, as megatron's Float16Module does: without Apex or TransformerEngine the norms come
    # from torch and ignore params_dtype (seen on an H200: float32 norms in a bfloat16 model).
    return model.to(dtype)
