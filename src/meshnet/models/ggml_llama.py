"""The Llama family's decoder layer as a ggml graph: llama (Llama, SmolLM2, Mistral files),
qwen2 (q/k/v biases) and qwen3 (per-head q/k norms), straight from llama.cpp's tensor names.

llama.cpp's converter interleaves the rotary halves of q/k rows for `llama` files only, so
those rotate adjacent pairs (mode 0) and the others rotate halves (NEOX).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from meshnet.models import ggml_graphs
from meshnet.models.ggml_graphs import (
    Params,
    Weights,
    attention,
    field_reader,
    read_params,
    rms_norm,
    rope,
)
from meshnet.models.ggml_lib import Builder, Tensor, gg

_LAYER = (
    "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q.bias",
    "attn_k.bias", "attn_v.bias", "attn_q_norm.weight", "attn_k_norm.weight",
    "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
    "ffn_down.weight",
)  # fmt: skip


class LlamaGraph:
    archs: tuple[str, ...] = ("llama", "qwen2", "qwen3")

    def params(self, fields: Mapping[str, Any], arch: str) -> Params:
        mode = 0 if arch == "llama" else gg.GGML_ROPE_TYPE_NEOX
        params = read_params(fields, arch, context=2048, rope_base=10000.0, rope_mode=mode)
        dims = field_reader(fields, arch)("rope.dimension_count", params.head_dim)
        window = fields.get(f"{arch}.attention.sliding_window")
        return replace(params, extra={"rope_dims": dims, "window": window})

    def tensor_names(self, index: int) -> list[str]:
        return [f"blk.{index}.{name}" for name in _LAYER] + ["rope_freqs.weight"]

    def layer(
        self,
        build: Builder,
        weights: Weights,
        params: Params,
        index: int,
        local: int,
        x: Tensor,
    ) -> Tensor:
        ctx, name = build.ctx, f"blk.{index}."
        tokens = x.contents.ne[1]
        cur = rms_norm(build, x, weights[name + "attn_norm.weight"], params.eps)
        heads = {}
        for part, count in (("q", params.heads), ("k", params.kv_heads), ("v", params.kv_heads)):
            out = gg.ggml_mul_mat(ctx, weights[f"{name}attn_{part}.weight"], cur)
            bias = weights.get(f"{name}attn_{part}.bias")
            out = out if bias is None else gg.ggml_add(ctx, out, bias)
            out = gg.ggml_reshape_3d(ctx, out, params.head_dim, count, tokens)
            norm = weights.get(f"{name}attn_{part}_norm.weight")
            heads[part] = out if norm is None else rms_norm(build, out, norm, params.eps)
        factors = weights.get("rope_freqs.weight")
        q = rope(build, heads["q"], params, params.rope_base, factors)
        k = rope(build, heads["k"], params, params.rope_base, factors)
        scale = 1.0 / math.sqrt(params.head_dim)
        mixed = attention(build, q, k, heads["v"], local, scale, params.extra["window"])
        x = gg.ggml_add(ctx, x, gg.ggml_mul_mat(ctx, weights[name + "attn_output.weight"], mixed))
        cur = rms_norm(build, x, weights[name + "ffn_norm.weight"], params.eps)
        gate = gg.ggml_mul_mat(ctx, weights[name + "ffn_gate.weight"], cur)
        up = gg.ggml_mul_mat(ctx, weights[name + "ffn_up.weight"], cur)
        cur = gg.ggml_swiglu_split(ctx, gate, up)  # silu(gate) * up
        return gg.ggml_add(ctx, x, gg.ggml_mul_mat(ctx, weights[name + "ffn_down.weight"], cur))


ggml_graphs.register(LlamaGraph())
