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
