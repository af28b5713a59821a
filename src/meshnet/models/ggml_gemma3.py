"""Gemma 3's decoder layer as a ggml graph, from llama.cpp's tensor names.

Five sliding-window layers (the last `sliding_window` positions, rotary base 10,000) to each
global one (the file's rotary base, and its scaling factor if any); q/k norms; a norm after
attention and after the MLP besides the two before; a GELU-tanh gated MLP; queries scaled by
1/sqrt(head_dim); embeddings scaled by sqrt(hidden) (`Params.extra["embed_scale"]`, the
head's). The file stores every norm weight as 1 + w, which is what ggml multiplies by.
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

LOCAL_ROPE_BASE = 10_000.0
PATTERN = 6  # every sixth layer (5, 11, ...) attends globally


def sliding(index: int) -> bool:
    return index % PATTERN < PATTERN - 1


class Gemma3Graph:
    archs: tuple[str, ...] = ("gemma3",)

    def params(self, fields: Mapping[str, Any], arch: str) -> Params:
        read = field_reader(fields, arch)
        params = read_params(
            fields, arch, context=32768, rope_base=1_000_000.0, rope_mode=gg.GGML_ROPE_TYPE_NEOX
        )
        extra = {
            "window": int(read("attention.sliding_window")),
            "embed_scale": math.sqrt(params.hidden),
            "rope_scale": 1.0 / float(read("rope.scaling.factor", 1.0)),
        }
        return replace(params, extra=extra)

    def tensor_names(self, index: int) -> list[str]:
        parts = (
            "attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm",
            "attn_output", "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up",
            "ffn_down", "post_ffw_norm",
        )  # fmt: skip
        return [f"blk.{index}.{part}.weight" for part in parts]

    def layer(
        self,
        build: Builder,
        weights: Weights,
        params: Params,
        index: int,
        local: int,
        x: Tensor,
    ) -> Tensor:
        ctx = build.ctx

        def w(part: str) -> Tensor:
            return weights[f"blk.{index}.{part}.weight"]

        tokens, local_layer = x.contents.ne[1], sliding(index)
        cur = rms_norm(build, x, w("attn_norm"), params.eps)
        heads = {}
        for part, count in (("q", params.heads), ("k", params.kv_heads), ("v", params.kv_heads)):
            out = gg.ggml_mul_mat(ctx, w(f"attn_{part}"), cur)
            heads[part] = gg.ggml_reshape_3d(ctx, out, params.head_dim, count, tokens)
        base = LOCAL_ROPE_BASE if local_layer else params.rope_base
        scale = 1.0 if local_layer else float(params.extra["rope_scale"])
        q, k = (
            rope(
                build,
                rms_norm(build, heads[p], w(f"attn_{p}_norm"), params.eps),
                params,
                base,
                None,
                scale,
            )
            for p in ("q", "k")
        )
        window = int(params.extra["window"]) if local_layer else None
        mixed = attention(build, q, k, heads["v"], local, 1 / math.sqrt(params.head_dim), window)
        cur = rms_norm(
            build,
            gg.ggml_mul_mat(ctx, w("attn_output"), mixed),
            w("post_attention_norm"),
            params.eps,
        )
        x = gg.ggml_add(ctx, x, cur)
        cur = rms_norm(build, x, w("ffn_norm"), params.eps)
        gate = gg.ggml_mul_mat(ctx, w("ffn_gate"), cur)
        up = gg.ggml_mul_mat(ctx, w("ffn_up"), cur)
        cur = gg.ggml_mul_mat(ctx, w("ffn_down"), gg.ggml_geglu_split(ctx, gate, up))
        return gg.ggml_add(ctx, x, rms_norm(build, cur, w("post_ffw_norm"), params.eps))


ggml_graphs.register(Gemma3Graph())
