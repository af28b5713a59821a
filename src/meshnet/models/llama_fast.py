"""The Llama family's fast path: a span's layers as plain tensor code over a static KV cache.

Eager layers (transformers', or our `llama_layers` that copy them op for op) spend part of a
decode step outside the matrix products: the cache concatenates keys and values every token,
masks and positions are rebuilt, many small modules are called. Here each layer runs one
fused q/k/v product and one fused gate/up product (`models/products.py`: dense, or int8
weight-only). Rotary is read from a table and applied to queries and keys together; norms
run transformers' RMSNorm formula op for op, without a module call (`llama_fused.py`, the
layer as every fast path sees it). Keys and values are written in place into `StaticKV`.
int8 spans can also compile their decode step (`models/llama_graph.py`, ADR-0023).

Dense weights (fp32, bf16) attend with PyTorch's SDPA, as transformers does, and stay
bit-for-bit equal to transformers' layers. INT8 weights have no bit-exact reference (their
products already differ from bitsandbytes'), so a single decoded token in fp32 attends with
two small products instead of SDPA's kernel (~0.1 ms a layer here) (ADR-0021, ADR-0022). In
bf16 (int8 layers on hosts with fast bf16) those products cost more than SDPA: oneDNN's bf16
`bmm` takes ~45 us however small, SDPA ~30 us for both (ADR-0047).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshnet.models import products
from meshnet.models.cache import SpanCache, StaticKV
from meshnet.models.layer_ops import causal_mask, causal_mask_for, rotate
from meshnet.models.llama_fused import Dims, FusedLayer, fuse_layer
from meshnet.models.llama_graph import DecodeGraph, compiled_decode

MIN_ROPE_POSITIONS = 256  # positions the rotary table first holds; it doubles when needed


class RopeTable:
    """cos/sin [positions, D] from the model's rotary module, computed once per position.

    transformers computes each position's angles independently (an outer product, then
    cos/sin), so a row of the table equals what a per-call computation gives.
    """

    def __init__(self, rotary: nn.Module, dtype: torch.dtype) -> None:
        self.rotary = rotary
        self.dtype = dtype
        self.cos = self.sin = torch.empty(0)

    def rows(self, position: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [tokens, D] for positions `[position, position + tokens)`; the
        signed sin is [-sin, +sin] over the two halves of D (see `layer_ops.rotate`)."""
        end = position + tokens
        if end > self.cos.shape[0]:
            self._grow(max(end, 2 * self.cos.shape[0], MIN_ROPE_POSITIONS))
        return self.cos[position:end], self.sin[position:end]

    def _grow(self, positions: int) -> None:
        device = next(self.rotary.buffers(), torch.empty(0)).device  # its frequencies'
        probe = torch.empty(1, 1, 1, dtype=self.dtype, device=device)
        ids = torch.arange(positions, device=device).unsqueeze(0)
        cos, sin = self.rotary(probe, position_ids=ids)  # [1, positions, D]
        half = sin.shape[-1] // 2
        self.cos, self.sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)


class FastSpan:
    """Runs a span's layers over a `StaticKV`; same inputs and outputs as `run_layers`."""

    def __init__(self, fused: list[FusedLayer], dims: Dims, rotary: nn.Module) -> None:
        self.layers = fused
        self.dims = dims
        self.heads, self.kv_heads, self.head_dim = dims.heads, dims.kv_heads, dims.head_dim
        self.scale = dims.scale
        self.exact = isinstance(fused[0].qkv, products.Dense)  # SDPA, as transformers runs it
        self.rope: RopeTable | None = None
        self._rotary = rotary
        self.graph: DecodeGraph | None = None  # the compiled decode step (int8 only)

    def compile(self) -> bool:
        """Run single-token decode steps as one compiled graph (ADR-0023), where allowed:
        never for fp32/bf16 layers, which must stay bit-for-bit equal to transformers, and
        not on CUDA (ADR-0039: the per-session caches a step writes defeat CUDA graphs)."""
        on_cpu = self.layers[0].input_norm.weight.device.type == "cpu"
        if not self.exact and on_cpu:
            self.graph = compiled_decode(self.layers, self.dims)
        return self.graph is not None

    def forward(self, hidden: torch.Tensor, cache: SpanCache, position: int) -> torch.Tensor:
        """`hidden` [B, T, H] (compute dtype) at `position` -> [B, T, H]; appends to cache."""
        batch, tokens, _ = hidden.shape
        if cache.static is None:
            cache.static = StaticKV(
                len(self.layers), batch, self.kv_heads, self.head_dim, hidden.dtype, hidden.device
            )
        if self.rope is None or self.rope.dtype != hidden.dtype:
            self.rope = RopeTable(self._rotary, hidden.dtype)
        kv = cache.static
        kv.reserve(tokens)
        rope = self.rope.rows(position, tokens)  # [T, D] each, broadcast over [B, heads, T, D]
        if self.graph is not None and batch == 1 and tokens == 1:
            out = self._decode_compiled(hidden, kv, position, rope)
            if out is not None:
                return out
        windows = {layer.window for layer in self.layers}
        masks = {w: causal_mask(hidden, position, w) for w in windows}  # None: is_causal does
        caches = zip(kv.keys.unbind(0), kv.values.unbind(0), strict=True)  # [B, kv, cap, D]
        for layer, layer_kv in zip(self.layers, caches, strict=True):
            hidden = self._layer(layer, hidden, rope, layer_kv, position, masks[layer.window])
        kv.length = position + tokens
        return hidden

    def forward_many(
        self, hiddens: list[torch.Tensor], caches: list[SpanCache], positions: list[int]
    ) -> list[torch.Tensor]:
        """Several sessions in one pass: `hiddens[b]` [1, T_b, H] (compute dtype) at
        `positions[b]` of `caches[b]` -> one [1, T_b, H] each; appends to every cache.

        The tokens of all sessions are packed into one [1, sum T, H] row, so the products
        (norms, residuals, MLP) read the weights once for all of them: decode steps (T = 1)
        and prefill chunks alike. Rotary gathers each token's angles; keys, values and
        attention stay per session, over each session's own cache (no padding, no copy)."""
        lengths = [int(h.shape[1]) for h in hiddens]
        x = torch.cat(hiddens, dim=1)  # [1, N, H]
        kvs = [self._static(c, x, t) for c, t in zip(caches, lengths, strict=True)]
        assert self.rope is not None  # made by `_static`
        ends = [p + t for p, t in zip(positions, lengths, strict=True)]
        self.rope.rows(0, max(ends))  # grows the table to cover every session
        at = torch.cat([torch.arange(p, e) for p, e in zip(positions, ends, strict=True)])
        at = at.to(x.device)
        rope = (self.rope.cos[at], self.rope.sin[at])  # [N, D]: broadcast over [1, heads, N, D]
        spans = list(zip(positions, lengths, strict=True))
        for i, layer in enumerate(self.layers):
            layer_kv = [(kv.keys[i], kv.values[i]) for kv in kvs]  # [1, kv, cap, D] each
            x = self._layer_packed(layer, x, rope, layer_kv, spans)
        for kv, end in zip(kvs, ends, strict=True):
            kv.length = end
        return list(torch.split(x, lengths, dim=1))

    def _static(self, cache: SpanCache, x: torch.Tensor, tokens: int) -> StaticKV:
        """`cache`'s static keys and values (made on first use, like `x`), with room for
        `tokens`."""
        dtype = x.dtype
        if cache.static is None:
            cache.static = StaticKV(
                len(self.layers), 1, self.kv_heads, self.head_dim, dtype, x.device
            )
        if self.rope is None or self.rope.dtype != dtype:
            self.rope = RopeTable(self._rotary, dtype)
        cache.static.reserve(tokens)
        return cache.static

    def _layer_packed(
        self,
        layer: FusedLayer,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kvs: list[tuple[torch.Tensor, torch.Tensor]],
        spans: list[tuple[int, int]],
    ) -> torch.Tensor:
        """`_layer` for the packed tokens [1, N, H] of several sessions; `spans` gives each
        session's (position, tokens), in packing order."""
        tokens = x.shape[1]
        qk, values = layer.project(x, self.dims)  # [1, N, heads + kv, D], [1, N, kv, D]
        qk, values = rotate(qk.transpose(1, 2), *rope), values.transpose(1, 2)
        rows, start = [], 0  # [1, heads + kv, N, D] and [1, kv, N, D] now
        for (keys_b, values_b), (p, t) in zip(kvs, spans, strict=True):
            mine = slice(start, start + t)
            keys_b[:, :, p : p + t] = qk[:, self.heads :, mine]
            values_b[:, :, p : p + t] = values[:, :, mine]
            mask = causal_mask_for(t, p, x.device, layer.window)
            q = qk[:, : self.heads, mine]
            keys_p, values_p = keys_b[:, :, : p + t], values_b[:, :, : p + t]
            rows.append(self._attend(q, keys_p, values_p, mask, p, layer.window))
            start += t
        attended = torch.cat(rows, dim=2)  # [1, heads, N, D]
        return layer.finish(x, attended.transpose(1, 2).reshape(1, tokens, -1))

    def _decode_compiled(
        self,
        hidden: torch.Tensor,
        kv: StaticKV,
        position: int,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor | None:
        """One token through the compiled graph; None (and no graph from now on) when it
        could not be built."""
        assert self.graph is not None  # checked by the caller
        out = self.graph(hidden, rope, kv, position)
        if out is None:
            self.graph = None
            return None
        kv.length = position + 1
        return out

    def _layer(
        self,
        layer: FusedLayer,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        position: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        batch, tokens, _ = x.shape
        end = position + tokens
        qk, new_values = layer.project(x, self.dims)  # [B, T, heads + kv, D], [B, T, kv, D]
        # queries and keys rotate together: the same elementwise ops on the same numbers
        qk = rotate(qk.transpose(1, 2), *rope)  # [B, heads + kv, T, D]
        keys, values = kv
        keys[:, :, position:end] = qk[:, self.heads :]
        values[:, :, position:end] = new_values.transpose(1, 2)
        attended = self._attend(
            qk[:, : self.heads], keys[:, :, :end], values[:, :, :end], mask, position, layer.window
        )
        return layer.finish(x, attended.transpose(1, 2).reshape(batch, tokens, -1))

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        position: int,
        window: int | None = None,
    ) -> torch.Tensor:
        """Attention of q [B, heads, T, D] over keys/values [B, kv_heads, end, D] (`mask`
        carries a sliding `window`).

        PyTorch's SDPA, as transformers calls it: the same kernel keeps results bit-for-bit
        equal. Without that constraint (int8 weights) one fp32 token attends by two products,
        over the last `window` keys only; a bf16 one keeps SDPA, which is faster there
        (`bmm` on bf16 costs ~45 us a call on AVX-512 hosts, ADR-0047).
        """
        if not self.exact and q.shape[2] == 1 and q.dtype == torch.float32:
            if window is not None:
                keys, values = keys[:, :, -window:], values[:, :, -window:]
            return self._attend_one(q, keys, values)
        return F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None and position == 0,
            scale=self.scale,
            enable_gqa=self.kv_heads != self.heads,
        )

    def _attend_one(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """q [B, heads, 1, D] over keys/values [B, kv, end, D]; query heads are grouped by kv
        head as SDPA's GQA groups them. 3-d `bmm` directly: ~6 us a product, `matmul` ~14."""
        batch, end = q.shape[0], keys.shape[2]
        grouped = q.reshape(batch * self.kv_heads, -1, self.head_dim)  # [B kv, groups, D]
        keys = keys.reshape(batch * self.kv_heads, end, self.head_dim)
        values = values.reshape(batch * self.kv_heads, end, self.head_dim)
        scores = torch.bmm(grouped, keys.transpose(1, 2)).float() * self.scale
        probs = torch.softmax(scores, dim=-1).to(values.dtype)  # [B kv, groups, end]
        return torch.bmm(probs, values).view(batch, self.heads, 1, self.head_dim)


def fast_span(
    layers: nn.ModuleList, config: Any, rotary: nn.Module, compile: bool = False
) -> FastSpan | None:
    """The fast path for `layers`, or None when any layer cannot take it (nf4, GELU MLPs...)."""
    if getattr(config, "hidden_act", "silu") != "silu":
        return None
    dims = Dims.of(config)
    fused = [fuse_layer(layer, dims) for layer in layers]
    ready = [f for f in fused if f is not None]
    if len(ready) != len(fused) or len({type(f.qkv) for f in ready}) != 1:
        return None
    device = next(layers.parameters()).device
    if isinstance(ready[0].qkv, products.Int8Rows) and not products.int8_kernel_runs(device):
        return None
    span = FastSpan(ready, dims, rotary)
    if compile:
        span.compile()
    return span
