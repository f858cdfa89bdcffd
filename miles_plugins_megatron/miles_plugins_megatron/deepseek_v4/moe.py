"""DeepSeek-V4's mixture of experts: a hash-routed (``hash_moe``: a fixed token-to-experts table, ``gate.tid2eid``)
or top-k routed (``moe``: the best scores plus a selection bias, ``gate.bias``) choice of ``num_experts_per_tok``
routed experts, weighted by their renormalised scores times ``routed_scaling_factor``, plus a shared expert. Every
expert is a SwiGLU MLP whose gate and up projections are clamped to ``swiglu_limit``.

Experts are split over expert-parallel ranks (each holds ``n_routed_experts / ep`` of them, the checkpoint's
``ffn.experts.{j}`` for its range of ``j``): each rank routes its own tokens, the ranks exchange them, each computes
its experts' share for every rank's tokens, and the shares are summed back to the tokens' ranks. Every expert's MLP
(and the shared expert's) is split over tensor-parallel ranks by its intermediate columns.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from miles_plugins_megatron.deepseek_v4.parallel import (
    Layout,
    column,
    expert_group,
    from_parallel_region,
    gather_tokens,
    return_tokens,
    row,
    sharded_parameter,
    split,
    to_parallel_region,
    token_counts,
)

MLP_KINDS = ("hash_moe", "moe")
SCORE_FUNCTIONS = ("sqrtsoftplus", "sigmoid")


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class Gate(nn.Module):
    """The router: scores of every expert from ``weight``, the experts chosen by ``tid2eid[token]`` (hash) or by the
    top-k of the scores plus ``bias`` (which selects but does not weight), their weights renormalised and scaled."""

    def __init__(self, hf_config: Any, *, hashed: bool) -> None:
        super().__init__()
        experts, self.topk = hf_config.n_routed_experts, hf_config.num_experts_per_tok
        if hf_config.scoring_func not in SCORE_FUNCTIONS:
            raise ValueError(f"scoring_func = {hf_config.scoring_func!r}: DeepSeek-V4 scores with {SCORE_FUNCTIONS}")
        self.score = ACT2FN[hf_config.scoring_func]
        self.scaling = hf_config.routed_scaling_factor
        self.hashed = hashed
        self.weight = nn.Parameter(torch.empty(experts, hf_config.hidden_size).normal_(std=0.02))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(hf_config.vocab_size, self.topk, dtype=torch.long))
        else:
            self.register_buffer("bias", torch.zeros(experts, dtype=torch.float32))

    def forward(self, tokens: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)``, both ``[N, k]``, for ``tokens`` ``[N, H]`` (``input_ids`` ``[N]``)."""
        scores = self.score(F.linear(tokens, self.weight))
        if self.hashed:
            chosen = self.tid2eid[input_ids].long()
        else:
            chosen = torch.topk(scores + self.bias, self.topk, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling, chosen


class Expert(nn.Module):
    """One routed expert's MLP, this rank's columns: ``w1`` (gate) and ``w3`` (up) ``[I/tp, H]``, ``w2`` (down)
    ``[H, I/tp]``; its output is partial (summed over tensor-parallel ranks by the caller)."""

    def __init__(self, hidden: int, columns: int) -> None:
        super().__init__()
        self.w1 = nn.Module()
        self.w3 = nn.Module()
        self.w2 = nn.Module()
        self.w1.weight = sharded_parameter(torch.empty(columns, hidden).normal_(std=0.02), dim=0, expert=True)
        self.w3.weight = sharded_parameter(torch.empty(columns, hidden).normal_(std=0.02), dim=0, expert=True)
        self.w2.weight = sharded_parameter(torch.empty(hidden, columns).normal_(std=0.02), dim=1, expert=True)

    def forward(self, tokens: torch.Tensor, limit: float) -> torch.Tensor:
        hidden = clamped_swiglu(F.linear(tokens, self.w1.weight), F.linear(tokens, self.w3.weight), limit)
        return F.linear(hidden, self.w2.weight)


class SharedExpert(nn.Module):
    """The shared expert's MLP: megatron-core column-parallel ``w1``/``w3`` and row-parallel ``w2``."""

    def __init__(self, hf_config: Any, layout: Layout) -> None:
        super().__init__()
        size = hf_config.moe_intermediate_size * hf_config.n_shared_experts
        self.w1 = column(layout, hf_config.hidden_size, size)
        self.w3 = column(layout, hf_config.hidden_size, size)
        self.w2 = row(layout, size, hf_config.hidden_size)
        self.limit = hf_config.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x)[0], self.w3(x)[0], self.limit))[0]


class MoE(nn.Module):
    """One layer's experts (``ffn``): the router, this rank's routed experts and the shared expert."""

    def __init__(self, hf_config: Any, layout: Layout, index: int) -> None:
        super().__init__()
        kind = hf_config.mlp_layer_types[index]
        if kind not in MLP_KINDS:
            raise ValueError(f"mlp_layer_types[{index}] = {kind!r}: DeepSeek-V4 MLP layers are one of {MLP_KINDS}")
        total = hf_config.n_routed_experts
        self.local = split(total, layout.ep_size, "n_routed_experts over expert-parallel ranks")
        self.first = layout.ep_rank * self.local
        self.ep_size, self.limit = layout.ep_size, hf_config.swiglu_limit
        columns = split(hf_config.moe_intermediate_size, layout.tp_size, "moe_intermediate_size over tensor ranks")
        self.gate = Gate(hf_config, hashed=kind == "hash_moe")
        self.experts = nn.ModuleList(Expert(hf_config.hidden_size, columns) for _ in range(self.local))
        self.shared_experts = SharedExpert(hf_config, layout)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        weights, chosen = self.gate(tokens, input_ids.reshape(-1))
        # each tensor-parallel rank uses the tokens and weights with its own expert columns: their gradients sum
        routed_in, weights = to_parallel_region(tokens), to_parallel_region(weights)
        if self.ep_size > 1:
            group = expert_group()
            counts = token_counts(tokens.shape[0], group, tokens.device)
            routed_in = gather_tokens(routed_in, group, counts)
            weights, chosen = gather_tokens(weights, group, counts), gather_tokens(chosen, group, counts)
        routed = self._local_experts(routed_in, weights, chosen)
        if self.ep_size > 1:
            routed = return_tokens(routed, group, counts)
        return from_parallel_region(routed).view(batch, length, hidden) + self.shared_experts(x)

    def _local_experts(self, tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """This rank's experts' weighted outputs for ``tokens`` (zero for tokens routed elsewhere)."""
        out = torch.zeros_like(tokens)
        for offset, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == self.first + offset)
            if rows.numel():
                out = out.index_add(0, rows, expert(tokens[rows], self.limit) * weights[rows, slot, None])
        return out
