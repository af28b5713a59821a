"""The Llama family's layer as the fast paths see it: one description, `FusedLayer`, that the
eager span (`FastSpan._layer`), the packed many-session pass (`FastSpan._layer_packed`) and
the compiled decode step (`llama_graph.py`) all run.

A layer is fused from the eager module tree (`llama_layers.py`, transformers' names, which
checkpoints, GGUF files and quantization fill): q/k/v as one product, gate/up as one, the
norms as plain weights (`layer_ops.rms_norm`). What differs between the paths is only how
keys and values are cached and how the queries attend; the projections before and the
residual MLP after are `FusedLayer.project` and `FusedLayer.finish`, written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshnet.models import products
from meshnet.models.layer_ops import layer_window, rms_norm
from meshnet.models.products import Product

# the eager norms whose formula `layer_ops.rms_norm` is (`llama_layers.RMSNorm`)
RMS_NORMS = ("RMSNorm",)


@dataclass(frozen=True)
class Dims:
    """A span's attention shape: query heads, key/value heads, head width, score scale."""

    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: Any) -> Dims:
        heads = int(config.num_attention_heads)
        kv_heads = int(config.num_key_value_heads or heads)
        return cls(
            heads, kv_heads, int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        )

    @property
    def scale(self) -> float:
        return float(self.head_dim**-0.5)

    @property
    def qk_width(self) -> int:
        """Columns of the fused q/k/v product that are queries and keys."""
        return (self.heads + self.kv_heads) * self.head_dim


@dataclass(frozen=True)
class Norm:
    """An RMSNorm's weight ([W], or a row per head [heads, W]) and epsilon, without a module
    call: 17 us instead of 28 us a call here."""

    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    @classmethod
    def of(cls, module: nn.Module) -> Norm:
        return cls(torch.as_tensor(module.weight), float(module.variance_epsilon))  # type: ignore[arg-type]

    @classmethod
    def heads_of(cls, q_norm: nn.Module, k_norm: nn.Module, dims: Dims) -> Norm:
        """Qwen3's q/k norms over the query and key heads at once [..., heads + kv, D]: the
        same elementwise ops and per-row means as the two modules, a weight row per head."""
        q, k = torch.as_tensor(q_norm.weight), torch.as_tensor(k_norm.weight)  # [D] each
        q, k = q.detach(), k.detach()  # plain tensors: the compiled step reads them
        rows = torch.cat([q.expand(dims.heads, -1), k.expand(dims.kv_heads, -1)])
        return cls(rows, float(q_norm.variance_epsilon))  # type: ignore[arg-type]


@dataclass
class FusedLayer:
    """One decoder layer: its norms and its fused products."""

    input_norm: Norm
    qkv: Product  # -> [(heads + 2 kv_heads) * D]
    o: Product  # -> [H]
    post_norm: Norm
    gate_up: Product  # -> [2 I]
    down: Product  # -> [H]
    head_norm: Norm | None = None  # Qwen3's q/k norms
    window: int | None = None  # sliding-window attention over this many tokens

    def project(self, x: torch.Tensor, dims: Dims) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] -> queries and keys [..., heads + kv, D] (normed where the layer has
        q/k norms, not yet rotated) and values [..., kv, D]."""
        qkv = self.qkv(self.input_norm(x))  # [..., (heads + 2 kv) D]
        qk = qkv[..., : dims.qk_width].view(*qkv.shape[:-1], -1, dims.head_dim)
        qk = qk if self.head_norm is None else self.head_norm(qk)
        return qk, qkv[..., dims.qk_width :].view(*qkv.shape[:-1], -1, dims.head_dim)

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream x [..., H] after attention's output `attended` [..., heads D]:
        the output product, then the SiLU-gated MLP, each added to it."""
        x = x + self.o(attended)
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def fuse_layer(layer: Any, dims: Dims) -> FusedLayer | None:
    """The fused view of a Llama-style decoder layer, or None (nf4, or an unusual layer)."""
    attn, mlp = layer.self_attn, layer.mlp
    if mlp.act_fn.__class__.__name__ not in ("SiLU", "SiLUActivation"):
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(n.__class__.__name__ not in RMS_NORMS for n in norms):
        return None
    parts = [
        products.fuse([attn.q_proj, attn.k_proj, attn.v_proj]),
        products.fuse([attn.o_proj]),
        products.fuse([mlp.gate_proj, mlp.up_proj]),
        products.fuse([mlp.down_proj]),
    ]
    qkv, o, gate_up, down = parts
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    if len({type(p) for p in parts}) != 1:
        return None
    head_norm = Norm.heads_of(attn.q_norm, attn.k_norm, dims) if hasattr(attn, "q_norm") else None
    norm_in, norm_post = Norm.of(norms[0]), Norm.of(norms[1])
    return FusedLayer(norm_in, qkv, o, norm_post, gate_up, down, head_norm, layer_window(layer))
