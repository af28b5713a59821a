"""Runnable model parts: a `Shard` of layers `[start, end)` and the entry node's `Head`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshnet.models.registry import Architecture
from meshnet.types import LayerSpan


def positions_for(hidden: torch.Tensor, position: int) -> torch.Tensor:
    """Absolute positions `[1, T]` of `hidden`'s tokens, the first at `position`."""
    return torch.arange(position, position + hidden.shape[1], device=hidden.device).unsqueeze(0)


def causal_mask(hidden: torch.Tensor, position: int) -> torch.Tensor | None:
    """The SDPA mask for `hidden` [B, T, H] after `position` cached tokens.

    None when SDPA's own `is_causal` is right: a single token (sees everything cached) or an
    empty cache. A chunk after cached tokens needs an explicit `[1, 1, T, position + T]` bool
    mask (True = attend): `is_causal` would align the triangle to the wrong corner.
    """
    tokens = hidden.shape[1]
    if tokens == 1 or position == 0:
        return None
    keys = torch.arange(position + tokens, device=hidden.device)
    queries = torch.arange(position, position + tokens, device=hidden.device)
    return (keys[None, :] <= queries[:, None])[None, None]


@dataclass
class Shard:
    """Layers `span` of one model, ready to run with a per-session cache."""

    arch: Architecture
    config: Any  # transformers PretrainedConfig
    span: LayerSpan
    layers: nn.ModuleList
    extras: Any  # what the architecture's layers need besides the cache (rotary embedding)
    compute_dtype: torch.dtype
    quant: str
    fast: Any = None  # the architecture's fast path (ADR-0021), or None: transformers' layers

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, cache: Any, position: int) -> torch.Tensor:
        """`hidden` [B, T, H] (any float) at `position` -> [B, T, H] bf16; appends to
        `cache` (a `models.cache.SpanCache`)."""
        x = hidden.to(self.compute_dtype)
        out: torch.Tensor
        if self.fast is not None:
            out = self.fast.forward(x, cache, position)
        else:
            out = self.arch.run_layers(self.layers, x, cache.as_dynamic(), position, self.extras)
        return out.to(torch.bfloat16)

    def weight_bytes(self) -> int:
        """Bytes of parameters and buffers (quantization states included)."""
        return module_bytes(self.layers)


class Head(nn.Module):
    """Embeddings (plus learned positions, for GPT-2), final norm and LM head."""

    def __init__(
        self,
        embed: nn.Embedding,
        pos_embed: nn.Embedding | None,
        norm: nn.Module,
        lm_head: nn.Linear,
    ) -> None:
        super().__init__()
        self.embed = embed
        self.pos_embed = pos_embed
        self.norm = norm
        self.lm_head = lm_head

    @torch.inference_mode()
    def embed_tokens(self, ids: torch.Tensor, position: int) -> torch.Tensor:
        """Token ids [B, T] at `position` -> hidden states [B, T, H] in the head's dtype."""
        hidden: torch.Tensor = self.embed(ids)
        if self.pos_embed is not None:
            hidden = hidden + self.pos_embed(positions_for(ids, position))
        return hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [B, T, H] (any float dtype) -> logits [B, T, V] in float32."""
        x = hidden.to(self.lm_head.weight.dtype)
        logits: torch.Tensor = self.lm_head(self.norm(x))
        return logits.float()


def module_bytes(module: nn.Module) -> int:
    """Bytes held by a module's parameters and buffers, bitsandbytes states included."""
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        total += tensor.numel() * tensor.element_size()
        state = getattr(tensor, "quant_state", None)  # nf4: absmax per block
        if state is not None:
            total += sum(t.numel() * t.element_size() for t in _state_tensors(state))
        scales = getattr(tensor, "SCB", None)  # int8: one scale per output row
        if isinstance(scales, torch.Tensor):
            total += scales.numel() * scales.element_size()
    return total


def _state_tensors(state: Any) -> list[torch.Tensor]:
    found = [getattr(state, name, None) for name in ("absmax", "code")]
    nested = getattr(state, "state2", None)
    if nested is not None:
        found += _state_tensors(nested)
    return [t for t in found if isinstance(t, torch.Tensor)]
