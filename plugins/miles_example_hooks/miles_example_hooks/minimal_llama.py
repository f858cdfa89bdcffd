"""A plain-PyTorch Llama that loads and exports the HF checkpoint names of ``LlamaForCausalLM``.

A second implementation of the ``llama`` family, next to the core's ``transformers`` one: same checkpoint, same
names, same logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from miles_core import CausalLM, MilesError


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hidden.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads") or self.heads
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        bias = cfg.get("attention_bias", False)
        hidden = cfg["hidden_size"]
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        scores = (q @ k.transpose(2, 3)) / math.sqrt(self.head_dim)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        bias = cfg.get("mlp_bias", False)
        self.gate_proj = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"], bias=bias)
        self.up_proj = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"], bias=bias)
        self.down_proj = nn.Linear(cfg["intermediate_size"], cfg["hidden_size"], bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class MinimalLlama(CausalLM):
    """``llama/minimal``: parameters carry the HF names (``model.layers.0.self_attn.q_proj.weight``, ...)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBody(cfg)
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / (rope_theta(cfg) ** exponents), persistent=False)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32) -> MinimalLlama:
        path = Path(path)
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise MilesError(f"cannot read {path / 'config.json'}: {exc}") from exc
        if cfg.get("model_type") != "llama":
            raise MilesError(f"llama/minimal loads Llama checkpoints; {path} has model_type {cfg.get('model_type')!r}")
        model = cls(cfg)
        state = {}
        for file in sorted(path.glob("*.safetensors")):
            state.update(load_file(str(file)))
        if model.tied:
            state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise MilesError(f"checkpoint {path} does not match its config: missing {missing}, unexpected {unexpected}")
        return model.to(dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).float()
        freqs = torch.outer(positions, self.inv_freq.float())
        angles = torch.cat((freqs, freqs), dim=-1)
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = angles.cos().to(hidden.dtype), angles.sin().to(hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin)
        return self.lm_head(self.model.norm(hidden))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())


def rope_theta(cfg: dict[str, Any]) -> float:
    """The RoPE base; only the default (unscaled) RoPE is implemented."""
    parameters = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or parameters
    if scaling.get("rope_type", "default") != "default":
        raise MilesError(f"llama/minimal supports default RoPE only, not {scaling.get('rope_type')!r}")
    return float(cfg.get("rope_theta") or parameters.get("rope_theta") or 10000.0)
