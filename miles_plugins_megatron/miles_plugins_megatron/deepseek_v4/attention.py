"""DeepSeek-V4's attention in its three kinds, heads split over tensor-parallel ranks.

Every kind is shared-KV multi-query attention over a sliding window with a learnt sink per head and a grouped output
projection; the compressed kinds add entries that summarise windows of ``compress_rate`` tokens: heavily compressed
attention (HCA) attends to every causally visible entry, compressed sparse attention (CSA) to the ``index_topk``
ones its lightning indexer picks. Module and parameter names are the checkpoint's (``attn.wq_a``, ``attn.wkv``,
``attn.compressor.wgate``, ``attn.indexer.compressor.ape``, ...).

Under tensor parallelism each rank holds ``1/tp`` of the query heads (``wq_b``, ``attn_sink``), of the output groups
(``wo_a``, and ``wo_b``'s inputs) and of the indexer's heads (``indexer.wq_b``, ``indexer.weights_proj``, whose
partial scores are summed over ranks); the single key/value head and the compressors are computed whole on every
rank, and their gradients summed over ranks (each rank's heads see them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from miles_plugins_megatron.deepseek_v4.layers import RMSNorm, Rotary, apply_rope, unweighted_rms_norm
from miles_plugins_megatron.deepseek_v4.parallel import (
    Layout,
    column,
    from_parallel_region,
    row,
    sharded_parameter,
    split,
    to_parallel_region,
)

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_KINDS = (SLIDING, CSA, HCA)


class Compressor(nn.Module):
    """One entry per window of ``rate`` tokens: the window's ``wkv`` projections weighted by a softmax over the window
    of its ``wgate`` projections plus a learnt bias per slot (``ape``), normed (``norm``) and rotated at the window's
    first position. ``overlap``: each token projects to two series, and an entry takes the previous window's first
    series with its own window's second (CSA and its indexer); without it, one series (HCA)."""

    def __init__(self, hf_config: Any, *, rate: int, dim: int, overlap: bool) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.rate, self.dim, self.overlap = rate, dim, overlap
        self.wkv = nn.Linear(hf_config.hidden_size, width, bias=False)
        self.wgate = nn.Linear(hf_config.hidden_size, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(rate, width))
        self.norm = RMSNorm(dim, hf_config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """The entries ``[B, T, dim]`` of the complete windows of ``hidden`` ``[B, S, H]`` (``T = S // rate``)."""
        batch, length, _ = hidden.shape
        windows = length // self.rate
        if windows == 0:
            return hidden.new_zeros((batch, 0, self.dim))
        usable = windows * self.rate
        kv = self.wkv(hidden)[:, :usable].view(batch, windows, self.rate, -1)
        gate = self.wgate(hidden)[:, :usable].view(batch, windows, self.rate, -1) + self.ape
        if self.overlap:
            kv, gate = self._overlapped(kv, gate)
        entries = self.norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
        positions = (torch.arange(windows, device=hidden.device) * self.rate).expand(batch, -1)
        cos, sin = rotary(positions, "compress", entries.dtype)
        return apply_rope(entries.unsqueeze(1), cos, sin).squeeze(1)

    def _overlapped(self, kv: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, W, 2 * rate, dim]``: the previous window's first series (none before window 0: weight 0), then this
        window's second series."""
        dim = self.dim
        previous_kv = F.pad(kv[:, :-1, :, :dim], (0, 0, 0, 0, 1, 0))
        previous_gate = F.pad(gate[:, :-1, :, :dim], (0, 0, 0, 0, 1, 0), value=float("-inf"))
        return torch.cat([previous_kv, kv[..., dim:]], dim=2), torch.cat([previous_gate, gate[..., dim:]], dim=2)


def visible_entries(positions: torch.Tensor, entries: int, rate: int) -> torch.Tensor:
    """``[B, S, T]``: whether the query at each position may see each entry (its whole window is at or before it)."""
    threshold = (positions + 1) // rate
    return torch.arange(entries, device=positions.device).view(1, 1, -1) < threshold.unsqueeze(-1)


class Indexer(nn.Module):
    """The lightning indexer of compressed sparse attention: its own compressor (``index_head_dim``), queries from the
    attention's query latent (``wq_b``, heads split over tensor-parallel ranks), and the score of an entry
    ``sum_h w_h * relu(q_h . k) / sqrt(dim)`` with per-token head weights (``weights_proj``)."""

    def __init__(self, hf_config: Any, layout: Layout) -> None:
        super().__init__()
        self.rate = hf_config.compress_rates[CSA]
        self.dim, self.topk = hf_config.index_head_dim, hf_config.index_topk
        self.heads = split(hf_config.index_n_heads, layout.tp_size, "index_n_heads over tensor-parallel ranks")
        self.weights_scaling = hf_config.index_n_heads**-0.5
        self.compressor = Compressor(hf_config, rate=self.rate, dim=self.dim, overlap=True)
        self.wq_b = column(layout, hf_config.q_lora_rank, hf_config.index_n_heads * self.dim)
        self.weights_proj = column(layout, hf_config.hidden_size, hf_config.index_n_heads)

    def forward(
        self, hidden: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        """``[B, S, T]``: whether each query attends to each compressed entry (the best ``index_topk`` visible ones)."""
        batch, length, _ = hidden.shape
        keys = self.compressor(hidden, rotary)
        cos, sin = rotary(positions, "compress", hidden.dtype)
        queries = apply_rope(self.wq_b(q_latent)[0].view(batch, length, self.heads, self.dim), cos, sin, head_dim=2)
        scores = F.relu(torch.matmul(queries.float(), keys.transpose(-1, -2).float().unsqueeze(1))) * self.dim**-0.5
        weights = self.weights_proj(hidden)[0].float() * self.weights_scaling
        scores = from_parallel_region((scores * weights.unsqueeze(-1)).sum(dim=2))  # [B, S, T], all heads
        visible = visible_entries(positions, keys.shape[1], self.rate)
        picked = scores.masked_fill(~visible, float("-inf")).topk(min(self.topk, keys.shape[1]), dim=-1).indices
        chosen = torch.zeros_like(visible).scatter_(-1, picked, True)
        return chosen & visible


class GroupedProjection(nn.Module):
    """The first half of the grouped output projection (``wo_a``): each group of heads projected on its own,
    ``[B, S, g, inputs] -> [B, S, g, rank]``; this rank's groups (``weight`` ``[g_local * rank, inputs]``)."""

    def __init__(self, inputs: int, rank: int, *, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = sharded_parameter(torch.empty(groups * rank, inputs).normal_(std=0.02), dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bsgi,gri->bsgr", x, self.weight.view(self.groups, -1, x.shape[-1]))


class Attention(nn.Module):
    """One layer's attention (``hf_config.layer_types[index]``), this rank's heads."""

    def __init__(self, hf_config: Any, layout: Layout, index: int) -> None:
        super().__init__()
        self.kind = hf_config.layer_types[index]
        if self.kind not in LAYER_KINDS:
            raise ValueError(f"layer_types[{index}] = {self.kind!r}: DeepSeek-V4 layers are one of {LAYER_KINDS}")
        heads, groups = hf_config.num_attention_heads, hf_config.o_groups
        self.dim, self.window, self.eps = hf_config.head_dim, hf_config.sliding_window, hf_config.rms_norm_eps
        self.heads = split(heads, layout.tp_size, "num_attention_heads over tensor-parallel ranks")
        self.groups = split(groups, layout.tp_size, "o_groups over tensor-parallel ranks")
        self.rope = "main" if self.kind == SLIDING else "compress"
        self.wq_a = nn.Linear(hf_config.hidden_size, hf_config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(hf_config.q_lora_rank, self.eps)
        self.wq_b = column(layout, hf_config.q_lora_rank, heads * self.dim)
        self.wkv = nn.Linear(hf_config.hidden_size, self.dim, bias=False)
        self.norm = RMSNorm(self.dim, self.eps)
        self.wo_a = GroupedProjection(heads * self.dim // groups, hf_config.o_lora_rank, groups=self.groups)
        self.wo_b = row(layout, groups * hf_config.o_lora_rank, hf_config.hidden_size)
        self.attn_sink = sharded_parameter(torch.zeros(self.heads), dim=0)
        self.compressor = self.indexer = None
        if self.kind != SLIDING:
            rate = hf_config.compress_rates[self.kind]
            self.compressor = Compressor(hf_config, rate=rate, dim=self.dim, overlap=self.kind == CSA)
        if self.kind == CSA:
            self.indexer = Indexer(hf_config, layout)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        batch, length, _ = hidden.shape
        cos, sin = rotary(positions, self.rope, hidden.dtype)
        q_latent = self.q_norm(self.wq_a(hidden))
        queries = self.wq_b(q_latent)[0].view(batch, length, self.heads, self.dim).transpose(1, 2)
        queries = apply_rope(unweighted_rms_norm(queries, self.eps), cos, sin)
        kv = apply_rope(self.norm(self.wkv(hidden)).unsqueeze(1), cos, sin)  # [B, 1, S, D]
        bias = self._window_bias(positions, hidden.dtype)
        if self.compressor is not None:
            entries = self.compressor(hidden, rotary)
            visible = (
                self.indexer(hidden, q_latent, positions, rotary)
                if self.indexer is not None
                else visible_entries(positions, entries.shape[1], self.compressor.rate)
            )
            kv = torch.cat([kv, entries.unsqueeze(1)], dim=2)
            bias = torch.cat([bias, self._bias(visible, hidden.dtype)], dim=-1)
        out = self._attend(queries, to_parallel_region(kv), bias)  # [B, h, S, D]
        out = apply_rope(out, cos, -sin).transpose(1, 2).reshape(batch, length, self.groups, -1)
        return self.wo_b(self.wo_a(out).flatten(2))[0]

    def _window_bias(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[B, 1, S, S]``: 0 where a query sees a key (causal, within ``sliding_window``), -inf elsewhere."""
        distance = positions.unsqueeze(-1) - positions.unsqueeze(-2)
        return self._bias((distance >= 0) & (distance < self.window), dtype)

    @staticmethod
    def _bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``visible`` ``[B, S, K]`` as an additive attention bias ``[B, 1, S, K]``: 0 or -inf."""
        bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        return bias.masked_fill(~visible, float("-inf")).unsqueeze(1)

    def _attend(self, queries: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Softmax attention of ``queries`` ``[B, h, S, D]`` over ``kv`` ``[B, 1, K, D]`` (keys are values), with
        each head's sink as one more logit that takes probability but carries no value (the softmax in the sinks'
        float32 under bfloat16, as transformers computes it)."""
        logits = torch.matmul(queries, kv.transpose(2, 3)) * self.dim**-0.5 + bias
        sinks = self.attn_sink.reshape(1, -1, 1, 1).expand(queries.shape[0], -1, queries.shape[2], 1)
        logits = torch.cat([logits, sinks], dim=-1)
        probs = F.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
        return torch.matmul(probs.to(kv.dtype), kv)
