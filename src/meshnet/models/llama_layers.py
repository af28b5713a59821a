"""The Llama family's decoder layer as our own modules, op for op transformers' (ADR-0041).

Parameter names are transformers' (`self_attn.q_proj.weight`, `input_layernorm.weight`...),
so checkpoints, GGUF names, quantization (which swaps `nn.Linear` children) and the fast path
(`llama_fast.py`) see the same tree; the arithmetic is transformers' own, so a span of these
layers equals transformers' model (tests compare them). What this saves is transformers'
modeling imports on every node that only runs layers.

Rotary types: `default`, `linear` and `llama3` are computed here; any other type (yarn,
dynamic...) takes transformers' rotary module for that model (`llama.py`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshnet.models.layer_ops import rms_norm, rotate_half
from meshnet.models.llama_config import FamilyConfig

NATIVE_ROPE = ("default", "linear", "llama3")


class RMSNorm(nn.Module):
    """transformers' Llama RMSNorm: the mean square in fp32, the weight in the input dtype."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)


def inverse_frequencies(rope: Mapping[str, Any], head_dim: int) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim / 2] for the `NATIVE_ROPE` types."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (float(rope["rope_theta"]) ** exponents)
    kind = rope["rope_type"]
    if kind == "linear":
        return inv_freq / float(rope["factor"])
    if kind != "llama3":
        return inv_freq
    factor, old = float(rope["factor"]), float(rope["original_max_position_embeddings"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """cos/sin [B, T, head_dim] for positions [B, T], as transformers' rotary module gives."""

    def __init__(self, config: FamilyConfig) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(config.rope, config.head_dim)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.attention_scaling = 1.0

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device, torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with rotary positions, optional q/k head norms (Qwen3) and an
    optional sliding window (the caller's mask carries it)."""

    def __init__(self, config: FamilyConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.sliding_window = config.windows[layer_idx]
        h, q, kv = config.hidden_size, self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, q, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, kv, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, kv, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q, h, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: Any,
    ) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; `cache.update(keys, values, layer_idx)` returns every
        cached key and value of this layer, the new ones appended."""
        batch, tokens, _ = x.shape
        shape = (batch, tokens, -1, self.head_dim)
        q, k = self.q_proj(x).view(shape), self.k_proj(x).view(shape)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), self.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = (e.unsqueeze(1) for e in embeddings)  # [B, 1, T, D]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None and tokens > 1,
            scale=self.scaling,
            enable_gqa=self.kv_heads != self.heads,
        )
        attended: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(batch, tokens, -1))
        return attended


class MLP(nn.Module):
    def __init__(self, config: FamilyConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, config: FamilyConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        """x [B, T, H] with rotary `embeddings` (cos, sin [B, T, D]) -> [B, T, H]."""
        x = x + self.self_attn(self.input_layernorm(x), embeddings, mask, cache)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out
