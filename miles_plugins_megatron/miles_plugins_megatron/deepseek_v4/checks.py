"""What the ``miles`` DeepSeek-V4 computes as transformers does, checked before anything is built: a config or a
parallel layout it does not support is a :class:`~miles_core.errors.MilesError` saying what would work."""

from __future__ import annotations

from typing import Any

import torch

from miles_core import MilesError
from miles_plugins_megatron.deepseek_v4.attention import LAYER_KINDS
from miles_plugins_megatron.deepseek_v4.moe import MLP_KINDS, SCORE_FUNCTIONS
from miles_plugins_megatron.deepseek_v4.parallel import Layout

DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes it computes in (under bfloat16 the tensors transformers keeps in float32 stay float32 here too)."""


def check_deepseek_v4(hf_config: Any, *, layout: Layout) -> None:
    """Raise a :class:`MilesError` listing every setting of ``hf_config`` or ``layout`` this implementation does not
    support, each with what would work."""
    problems = _config_problems(hf_config) + _layout_problems(hf_config, layout)
    if problems:
        raise MilesError(f"deepseek_v4/miles cannot run this model as configured: {'; '.join(problems)}")


def _config_problems(hf_config: Any) -> list[str]:
    problems = []
    if hf_config.model_type != "deepseek_v4":
        problems.append(f"model_type {hf_config.model_type!r} is not 'deepseek_v4'")
    unknown = sorted(set(hf_config.layer_types) - set(LAYER_KINDS))
    if unknown:
        problems.append(f"layer_types {unknown} (the layer kinds are {list(LAYER_KINDS)})")
    unknown = sorted(set(hf_config.mlp_layer_types) - set(MLP_KINDS))
    if unknown:
        problems.append(f"mlp_layer_types {unknown} (the MLP kinds are {list(MLP_KINDS)})")
    if hf_config.scoring_func not in SCORE_FUNCTIONS:
        problems.append(f"scoring_func {hf_config.scoring_func!r} (supported: {list(SCORE_FUNCTIONS)})")
    if hf_config.tie_word_embeddings:
        problems.append("tie_word_embeddings is true (DeepSeek-V4 checkpoints have a head of their own: set it false)")
    if hf_config.hidden_act != "silu":
        problems.append(f"hidden_act {hf_config.hidden_act!r} (DeepSeek-V4's experts use 'silu')")
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        problems.append("attention_bias or mlp_bias is set (DeepSeek-V4's projections have no biases)")
    return problems


def _layout_problems(hf_config: Any, layout: Layout) -> list[str]:
    problems = []
    if layout.dtype not in DTYPES:
        problems.append(f"dtype {layout.dtype} (supported: float32, bfloat16)")
    tp_divides = {
        "num_attention_heads": hf_config.num_attention_heads,
        "o_groups": hf_config.o_groups,
        "index_n_heads": hf_config.index_n_heads,
        "moe_intermediate_size": hf_config.moe_intermediate_size,
        "vocab_size": hf_config.vocab_size,
    }
    bad = [f"{name} ({size})" for name, size in tp_divides.items() if size % layout.tp_size]
    if bad:
        problems.append(f"tensor parallel size {layout.tp_size} does not divide {', '.join(bad)}")
    if hf_config.n_routed_experts % layout.ep_size:
        problems.append(
            f"expert parallel size {layout.ep_size} does not divide n_routed_experts ({hf_config.n_routed_experts})"
        )
    return problems
