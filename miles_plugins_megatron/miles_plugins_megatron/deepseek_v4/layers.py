"""DeepSeek-V4's building blocks that hold no tensor-parallel state: the norms, the interleaved partial RoPE of its
two rope kinds, and the manifold-constrained hyper-connections (every rank holds them whole)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

ROPE_KINDS = ("main", "compress")
"""The rope kinds of ``config.rope_parameters``: ``main`` for sliding-window layers, ``compress`` for the compressed
ones (their compressors and indexers too)."""


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 with a float32 weight (``weight * x / rms(x)``), cast back to the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dimension (the rms in float32), without a weight."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Rotary(nn.Module):
    """The inverse frequencies of both rope kinds (plain RoPE, or any scaling transformers knows, such as YaRN), and
    cos/sin of one entry per rotated pair (the pairs are interleaved: channels 2i and 2i+1).

    The frequencies are float32 tensors held outside the module's buffers, so that casting the model to bfloat16
    never rounds them (transformers computes them in float32 whatever the model's dtype)."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.scaling: dict[str, float] = {}
        self.inv_freq: dict[str, torch.Tensor] = {}
        for kind in ROPE_KINDS:
            parameters = hf_config.rope_parameters[kind]
            if parameters.get("rope_type", "default") == "default":
                inv_freq, scaling = _default_inv_freq(hf_config, parameters), 1.0
            else:
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](hf_config, None, layer_type=kind)
            self.inv_freq[kind], self.scaling[kind] = inv_freq.float(), float(scaling)

    def forward(self, positions: torch.Tensor, kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[B, S, rope_dim / 2]`` at ``positions`` ``[B, S]``."""
        freqs = positions[..., None].float() * self.inv_freq[kind].to(positions.device)
        return (freqs.cos() * self.scaling[kind]).to(dtype), (freqs.sin() * self.scaling[kind]).to(dtype)


def _default_inv_freq(hf_config: Any, parameters: dict[str, Any]) -> torch.Tensor:
    dim = int(hf_config.head_dim * parameters.get("partial_rotary_factor", 1.0))
    return 1.0 / (parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, head_dim: int = 1) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` (interleaved pairs, in float32); the leading
    channels pass unchanged. ``cos``/``sin`` are ``[B, S, r]``; ``head_dim`` is where ``x`` has its head axis
    (1 for ``[B, H, S, D]``, 2 for ``[B, S, H, D]``)."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(head_dim)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(head_dim)
    rope_dim = cos.shape[-1]
    plain, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    swapped = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + swapped.float() * sin).to(x.dtype)
    return torch.cat([plain, rotated], dim=-1)


class HyperConnection:
    """The weights that collapse ``hc_mult`` residual streams into a block's input (``pre``), spread its output back
    over them (``post``) and mix the streams (``comb``, made doubly stochastic by Sinkhorn-Knopp iterations).

    The parameters live on the decoder block under the checkpoint's names (``hc_attn_fn``, ``hc_attn_base``,
    ``hc_attn_scale``, and ``hc_ffn_*``); this object only computes with them."""

    def __init__(self, hf_config: Any) -> None:
        self.streams = hf_config.hc_mult
        self.iterations = hf_config.hc_sinkhorn_iters
        self.hc_eps, self.norm_eps = hf_config.hc_eps, hf_config.rms_norm_eps

    def __call__(
        self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(post [B, S, N], comb [B, S, N, N], collapsed [B, S, D])`` of ``streams`` ``[B, S, N, D]``."""
        n = self.streams
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        pre_w, post_w, comb_w = F.linear(flat, fn.float()).split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb_w = comb_w.view(*comb_w.shape[:-1], n, n)
        comb = torch.softmax(comb_w * comb_scale + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iterations - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


def hyper_parameters(module: nn.Module, prefix: str, hf_config: Any) -> None:
    """Give ``module`` the parameters of one hyper-connection, ``{prefix}_fn``, ``{prefix}_base``, ``{prefix}_scale``
    (the checkpoint's names), in float32."""
    n, hidden = hf_config.hc_mult, hf_config.hidden_size
    mixes = (2 + n) * n
    module.register_parameter(f"{prefix}_fn", nn.Parameter(torch.empty(mixes, n * hidden).normal_(std=0.02)))
    module.register_parameter(f"{prefix}_base", nn.Parameter(torch.zeros(mixes)))
    module.register_parameter(f"{prefix}_scale", nn.Parameter(torch.ones(3)))


def mix_streams(streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The next residual streams: ``post`` spreads the block's ``output`` over the streams, ``comb`` (transposed)
    mixes the incoming ``streams``."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The final collapse of the streams into one hidden state (``model.hc_head.hc_fn``, ``hc_base``, ``hc_scale``)."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        n = hf_config.hc_mult
        self.hc_fn = nn.Parameter(torch.empty(n, n * hf_config.hidden_size).normal_(std=0.02))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.ones(1))
        self.hc_eps, self.norm_eps = hf_config.hc_eps, hf_config.rms_norm_eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float())
        return ((pre + self.hc_eps).unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
