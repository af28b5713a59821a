"""The Llama family's fast path: a span's layers as plain tensor code over a static KV cache.

transformers' layers spend part of a decode step outside the matrix products: the cache
concatenates keys and values every token, masks and positions are rebuilt, many small
modules are called. Here each layer runs one fused q/k/v product and one fused gate/up
product. Rotary and norms are computed as transformers computes them (the norms are its own
modules). Keys and values are written in place into `StaticKV`, and PyTorch's SDPA attends
over the cache. The fused weights are the layers' own storage: q/k/v and gate/up are
concatenated once at load and the modules' parameters become views into them, so memory
does not grow (ADR-0021).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshnet.models.cache import SpanCache, StaticKV
from meshnet.models.shard import causal_mask, positions_for


@dataclass
class FusedLayer:
    """One decoder layer's tensors: norms are transformers' modules, products fused."""

    input_norm: nn.Module
    qkv: torch.Tensor  # [(heads + 2 kv_heads) * D, H]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [H, heads * D]
    post_norm: nn.Module
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]


def fuse_rows(modules: list[nn.Linear]) -> torch.Tensor:
    """Concatenate the weights of `modules` row-wise; each module's weight becomes a view."""
    fused = torch.cat([m.weight.detach() for m in modules]).contiguous()
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


def fuse_layer(layer: Any) -> FusedLayer | None:
    """The fused view of a Llama-style decoder layer, or None (quantized or unusual layer)."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, *_mlp_linears(mlp)]
    if any(type(m) is not nn.Linear for m in linears) or mlp.act_fn.__class__.__name__ not in (
        "SiLU",
        "SiLUActivation",
    ):
        return None
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    biases = [m.bias for m in (q, k, v)]
    bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
    return FusedLayer(
        layer.input_layernorm,
        fuse_rows([q, k, v]),
        bias,
        attn.o_proj.weight,
        layer.post_attention_layernorm,
        fuse_rows([mlp.gate_proj, mlp.up_proj]),
        mlp.down_proj.weight,
    )


def _mlp_linears(mlp: Any) -> list[nn.Linear]:
    return [mlp.gate_proj, mlp.up_proj, mlp.down_proj]


class FastSpan:
    """Runs a span's layers over a `StaticKV`; same inputs and outputs as `run_layers`."""

    def __init__(self, fused: list[FusedLayer], config: Any, rotary: nn.Module) -> None:
        self.layers = fused
        self.rotary = rotary
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.scale = self.head_dim**-0.5

    def forward(self, hidden: torch.Tensor, cache: SpanCache, position: int) -> torch.Tensor:
        """`hidden` [B, T, H] (compute dtype) at `position` -> [B, T, H]; appends to cache."""
        batch, tokens, _ = hidden.shape
        if cache.static is None:
            cache.static = StaticKV(
                len(self.layers), batch, self.kv_heads, self.head_dim, hidden.dtype
            )
        kv = cache.static
        kv.reserve(tokens)
        cos, sin = self.rotary(hidden, position_ids=positions_for(hidden, position))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D]
        mask = causal_mask(hidden, position)  # None for one token or an empty cache
        for index, layer in enumerate(self.layers):
            hidden = self._layer(layer, hidden, cos, sin, kv, index, position, mask)
        kv.length = position + tokens
        return hidden

    def _layer(
        self,
        layer: FusedLayer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: StaticKV,
        index: int,
        position: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        batch, tokens, _ = x.shape
        qkv = F.linear(layer.input_norm(x), layer.qkv, layer.qkv_bias)
        sizes = [self.heads * self.head_dim, *(2 * [self.kv_heads * self.head_dim])]
        q, k, v = torch.split(qkv, sizes, dim=-1)
        q = _rotate(q.view(batch, tokens, -1, self.head_dim).transpose(1, 2), cos, sin)
        k = _rotate(k.view(batch, tokens, -1, self.head_dim).transpose(1, 2), cos, sin)
        end = position + tokens
        kv.keys[index, :, :, position:end] = k
        kv.values[index, :, :, position:end] = v.view(batch, tokens, -1, self.head_dim).transpose(
            1, 2
        )
        keys, values = kv.keys[index, :, :, :end], kv.values[index, :, :, :end]
        attended = self._attend(q, keys, values, mask, position)  # [B, heads, T, D]
        x = x + F.linear(attended.transpose(1, 2).reshape(batch, tokens, -1), layer.o)
        gate, up = F.linear(layer.post_norm(x), layer.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.down)

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        position: int,
    ) -> torch.Tensor:
        """Attention of q [B, heads, T, D] over keys/values [B, kv_heads, end, D].

        PyTorch's SDPA, as transformers calls it: the same kernel keeps results bit-for-bit
        equal (two small products were 1.5 ms a token faster, but rounded differently).
        """
        return F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None and position == 0,
            scale=self.scale,
            enable_gqa=self.kv_heads != self.heads,
        )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it (`rotate_half`)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def fast_span(layers: nn.ModuleList, config: Any, rotary: nn.Module) -> FastSpan | None:
    """The fast path for `layers`, or None when any layer cannot take it (e.g. quantized)."""
    if getattr(config, "hidden_act", "silu") != "silu":
        return None
    fused = [fuse_layer(layer) for layer in layers]
    if any(f is None for f in fused):
        return None
    return FastSpan([f for f in fused if f is not None], config, rotary)
