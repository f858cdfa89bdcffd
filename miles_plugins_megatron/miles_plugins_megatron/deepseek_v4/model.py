"""The ``miles`` DeepSeek-V4 model: megatron-core parallel layers (vocabulary-parallel embedding and head, column-
and row-parallel projections), heads and expert columns over tensor-parallel ranks, experts over expert-parallel
ranks. Its module and parameter names are the checkpoint's, as transformers writes a DeepSeek-V4 (``head.weight``,
``model.layers.{i}.attn.wq_a.weight``, ``model.layers.{i}.hc_attn_fn``, ``model.layers.{i}.ffn.experts.{j}.w1.weight``
...): :mod:`miles_plugins_megatron.deepseek_v4.naming` maps them to whole HF tensors and back."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from torch import nn

from miles_plugins_megatron.deepseek_v4.attention import Attention
from miles_plugins_megatron.deepseek_v4.checks import check_deepseek_v4
from miles_plugins_megatron.deepseek_v4.layers import (
    HyperConnection,
    HyperHead,
    RMSNorm,
    Rotary,
    hyper_parameters,
    mix_streams,
)
from miles_plugins_megatron.deepseek_v4.moe import MoE
from miles_plugins_megatron.deepseek_v4.parallel import Layout, column, init_weight, split


class Block(nn.Module):
    """One decoder layer: attention then experts, each between a hyper-connection's collapse and spread of the
    residual streams (``hc_attn_*``, ``hc_ffn_*``) and after its norm (``attn_norm``, ``ffn_norm``)."""

    def __init__(self, hf_config: Any, layout: Layout, index: int) -> None:
        super().__init__()
        self.attn = Attention(hf_config, layout, index)
        self.ffn = MoE(hf_config, layout, index)
        self.attn_norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.ffn_norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        hyper_parameters(self, "hc_attn", hf_config)
        hyper_parameters(self, "hc_ffn", hf_config)
        self.hyper = HyperConnection(hf_config)

    def forward(
        self, streams: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        post, comb, collapsed = self.hyper(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        streams = mix_streams(streams, self.attn(self.attn_norm(collapsed), positions, rotary), post, comb)
        post, comb, collapsed = self.hyper(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        return mix_streams(streams, self.ffn(self.ffn_norm(collapsed), input_ids), post, comb)


class Stack(nn.Module):
    """Embedding, decoder layers, the streams' final collapse (``hc_head``) and norm (the checkpoint's ``model.``)."""

    def __init__(self, hf_config: Any, layout: Layout) -> None:
        super().__init__()
        split(hf_config.vocab_size, layout.tp_size, "vocab_size over tensor-parallel ranks")
        self.embed_tokens = VocabParallelEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, init_method=init_weight, config=layout.megatron_config()
        )
        self.layers = nn.ModuleList(Block(hf_config, layout, index) for index in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.hc_head = HyperHead(hf_config)
        self.rotary = Rotary(hf_config)
        self.streams = hf_config.hc_mult

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embedded = self.embed_tokens(input_ids)
        streams = embedded.unsqueeze(2).expand(-1, -1, self.streams, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, positions, self.rotary)
        return self.norm(self.hc_head(streams))


class DeepseekV4Model(nn.Module):
    """This rank's shard of a DeepSeek-V4: ``forward(input_ids)`` gives this rank's vocabulary slice of the logits,
    ``[B, S, V / tp]``."""

    def __init__(self, hf_config: Any, layout: Layout) -> None:
        super().__init__()
        self.hf_config, self.layout = hf_config, layout
        self.config = layout.megatron_config()  # what the Megatron trainer reads of a model (no sequence parallelism)
        self.model = Stack(hf_config, layout)
        self.head = column(layout, hf_config.hidden_size, hf_config.vocab_size)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        """``[B, S, V / tp]`` for ``input_ids`` ``[B, S]`` at ``position_ids`` (default ``0..S-1``); other keywords
        (the Megatron trainer's causal ``attention_mask``) are ignored: every layer builds its own mask."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        return self.head(self.model(input_ids, position_ids))[0]


def build_deepseek_v4(hf_config: Any, *, dtype: torch.dtype = torch.float32) -> DeepseekV4Model:
    """This rank's untrained shard of the model (megatron-core's parallel state initialised), after
    :func:`~miles_plugins_megatron.deepseek_v4.checks.check_deepseek_v4`."""
    layout = Layout.current(dtype)
    check_deepseek_v4(hf_config, layout=layout)
    return keep_float32(DeepseekV4Model(hf_config, layout).to(dtype))


def keep_float32(model: DeepseekV4Model) -> DeepseekV4Model:
    """The tensors DeepSeek-V4 keeps in float32 whatever the model's dtype, as transformers does (its
    ``_keep_in_fp32_modules_strict``): every norm's weight, the hyper-connections and their final collapse, the
    attention sinks, the compressors' slot biases (``ape``) and the routers' selection biases."""
    for module in model.modules():
        if isinstance(module, RMSNorm | HyperHead):
            module.float()
    for name, tensor in model.named_parameters():
        if name.split(".")[-1].startswith(("hc_attn_", "hc_ffn_")) or name.endswith((".attn_sink", ".ape")):
            tensor.data = tensor.data.float()
    for name, buffer in model.named_buffers():
        if name.endswith(".gate.bias"):
            buffer.data = buffer.data.float()
    return model
