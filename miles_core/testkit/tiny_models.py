"""Tiny HF checkpoints made on the spot (no model hub), for tests and benchmarks."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

TINY = dict(vocab_size=64, hidden_size=64, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)
"""What every tiny model here shares: a 64-token vocabulary (pad 0, eos 1, bos 2), hidden 64, 512 positions."""
TINY_MOE = dict(TINY, intermediate_size=112, moe_intermediate_size=32, tie_word_embeddings=False)
"""What the tiny Mixture-of-Experts models add: expert MLPs of 32 (dense ones of 112), untied embeddings."""


def tiny_llama_config(**overrides: object) -> transformers.LlamaConfig:
    """A two-layer Llama config with a 64-token vocabulary (pad 0, eos 1, bos 2)."""
    values = dict(TINY, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaConfig(**{**values, **overrides})


def save_tiny_llama(path: str | Path, *, seed: int = 0, **overrides: object) -> Path:
    """Save a randomly initialised tiny Llama checkpoint (config.json + model.safetensors) to ``path``."""
    return save_from_config(tiny_llama_config(**overrides), path, seed=seed)


def tiny_qwen3_moe_config(**overrides: object) -> transformers.PretrainedConfig:
    """A two-layer Qwen3-MoE config: hidden 64, 4 experts of which each token takes 2, expert MLPs of 32, a 64-token
    vocabulary (pad 0, eos 1, bos 2), untied embeddings."""
    values = dict(
        TINY_MOE,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return transformers.AutoConfig.for_model("qwen3_moe", **{**values, **overrides})


def save_tiny_qwen3_moe(path: str | Path, *, seed: int = 0, scale: float = 0.0, **overrides: object) -> Path:
    """Save a randomly initialised tiny Qwen3-MoE checkpoint to ``path``, as transformers writes it (one tensor per
    expert: ``model.layers.{i}.mlp.experts.{j}.gate_proj.weight``, ...). A ``scale`` above 0 adds seeded noise of
    that size to every weight (the routers' too), so that tokens spread over the experts rather than all taking the
    same ones."""
    return save_from_config(tiny_qwen3_moe_config(**overrides), path, seed=seed, scale=scale)


def tiny_deepseek_v3_config(**overrides: object) -> transformers.PretrainedConfig:
    """A two-layer DeepSeek-V3 config that the Megatron backend accepts (see miles_plugins_megatron/README.md): a dense
    layer then a MoE layer, hidden 64, 4 heads with multi-latent attention (query latent 24, key/value latent 16, head
    sizes 12 without and 8 with RoPE, values 16), 4 routed experts in 2 groups of which each token takes 2 from its best
    group (renormalised, scaled by 2.5), one shared expert, expert MLPs of 32; a 64-token vocabulary (pad 0, eos 1,
    bos 2), untied embeddings, default RoPE."""
    values = dict(
        TINY_MOE,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    return transformers.AutoConfig.for_model("deepseek_v3", **{**values, **overrides})


def save_tiny_deepseek_v3(path: str | Path, *, seed: int = 0, **overrides: object) -> Path:
    """Save a randomly initialised tiny DeepSeek-V3 checkpoint to ``path``, as transformers writes it (one tensor per
    routed expert, ``mlp.shared_experts.*``, and the router's ``mlp.gate.e_score_correction_bias``)."""
    return save_from_config(tiny_deepseek_v3_config(**overrides), path, seed=seed)


DSV4_LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
"""The three attention kinds a DeepSeek-V4 config can name, one layer each in the tiny DeepSeek-V4."""
DSV4_MLP_LAYER_TYPES = ["hash_moe", "moe", "moe"]
"""The two MoE kinds (hash-routed, then top-k routed) of the tiny DeepSeek-V4's three layers."""


def tiny_deepseek_v4_config(**overrides: object) -> transformers.PretrainedConfig:
    """A three-layer DeepSeek-V4 config that names every layer kind: sliding-window, compressed-sparse (compression 2,
    a lightning indexer of 2 heads of 8 keeping the top 2 entries) and heavily compressed (compression 4) attention;
    a hash-routed then two top-k routed MoE layers (4 experts of 32, 2 per token, sqrt-softplus scores scaled by
    1.5, one shared expert); 2 hyper-connection streams; hidden 64, 4 query heads of 16 (8 of them rotary) sharing one
    key/value head, query latent 32, a window of 4 tokens, the output projection in 2 groups of rank 16; a 64-token
    vocabulary (pad 0, eos 1, bos 2), untied embeddings."""
    values = dict(
        TINY_MOE,
        num_hidden_layers=3,
        layer_types=DSV4_LAYER_TYPES,
        mlp_layer_types=DSV4_MLP_LAYER_TYPES,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        partial_rotary_factor=0.5,
        q_lora_rank=32,
        sliding_window=4,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        hc_mult=2,
        hc_sinkhorn_iters=6,
    )
    return transformers.AutoConfig.for_model("deepseek_v4", **{**values, **overrides})


def save_tiny_deepseek_v4(path: str | Path, *, seed: int = 0, scale: float = 0.0, **overrides: object) -> Path:
    """Save a tiny DeepSeek-V4 (:func:`tiny_deepseek_v4_config`) to ``path`` as transformers writes it (the original
    DeepSeek names: ``model.layers.{i}.attn.wq_a.weight``, ``...ffn.experts.{j}.w1.weight``, ``head.weight``, ...).
    transformers initialises the hash layers' token-to-expert tables to zeros (real ones come with a checkpoint): here
    each token gets ``num_experts_per_tok`` distinct experts drawn with ``seed``, so hash routing is exercised.
    ``scale`` as in :func:`save_from_config`, also applied to the routers' selection biases."""
    config = tiny_deepseek_v4_config(**overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("gate.tid2eid"):
                draws = torch.rand(buffer.shape[0], config.n_routed_experts, generator=generator)
                buffer.copy_(draws.argsort(dim=-1)[:, : buffer.shape[1]])
            elif scale and name.endswith("e_score_correction_bias"):
                buffer.add_(torch.randn(buffer.shape, generator=generator) * scale)
        if scale:
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    model.save_pretrained(path)
    return Path(path)


def save_from_config(
    config: transformers.PretrainedConfig, path: str | Path, *, seed: int = 0, scale: float = 0.0
) -> Path:
    """Save a model built from ``config`` with torch seeded by ``seed`` (plus seeded noise of ``scale`` on every
    weight when above 0) to ``path``, as ``save_pretrained`` writes it."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if scale:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * scale)
    model.save_pretrained(path)
    return Path(path)


def perturbed_state(model: torch.nn.Module, *, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Every weight of ``model`` plus seeded noise (HF names)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + scale * torch.randn(tensor.shape, generator=generator)
        for name, tensor in model.state_dict().items()
    }
