"""The arithmetic every torch path of a decoder layer shares: positions, causal and sliding
masks, transformers' RMSNorm formula and rotary rotation.

The eager layers (`llama_layers.py`, and transformers' for Gemma 3), the fused fast path
(`llama_fast.py`) and its compiled decode step (`llama_graph.py`) all call these, so each
formula is written once; they are op for op transformers', which keeps dense spans
bit-for-bit equal to it.
"""

from __future__ import annotations

from typing import Any

import torch


def positions_for(hidden: torch.Tensor, position: int) -> torch.Tensor:
    """Absolute positions `[1, T]` of `hidden`'s tokens, the first at `position`."""
    return torch.arange(position, position + hidden.shape[1], device=hidden.device).unsqueeze(0)


def layer_window(layer: Any) -> int | None:
    """The sliding window a built decoder layer attends over, None for full attention."""
    window = layer.self_attn.sliding_window
    return int(window) if window else None


def kept_columns(mask: Any, cache: Any, layer: int) -> Any:
    """`mask` [1, 1, T, end] over the keys layer `layer` of the eager `cache` still keeps."""
    return mask if mask is None else mask[..., cache.start(layer) :]


def causal_mask(
    hidden: torch.Tensor, position: int, window: int | None = None
) -> torch.Tensor | None:
    """The SDPA mask for `hidden` [B, T, H] after `position` cached tokens (`causal_mask_for`)."""
    return causal_mask_for(hidden.shape[1], position, hidden.device, window)


def causal_mask_for(
    tokens: int, position: int, device: torch.device, window: int | None = None
) -> torch.Tensor | None:
    """The SDPA mask for `tokens` new tokens after `position` cached ones; with a sliding
    `window`, a query at q sees keys k with q - window < k <= q (transformers' rule).

    None when SDPA's own `is_causal` is right: a single token (sees everything cached) or an
    empty cache, and no key falls out of the window. Otherwise an explicit
    `[1, 1, T, position + T]` bool mask (True = attend): `is_causal` would align the triangle
    to the wrong corner.
    """
    end = position + tokens
    slides = window is not None and end > window
    if (tokens == 1 or position == 0) and not slides:
        return None
    keys = torch.arange(end, device=device)
    queries = torch.arange(position, end, device=device)
    visible = keys[None, :] <= queries[:, None]
    if window is not None and slides:
        visible &= keys[None, :] > queries[:, None] - window
    return visible[None, None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm of x [..., W]: the mean square in fp32, the weight [W]
    (or one row per head, [heads, W]) applied in the input dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[-x2, x1] of x = [x1, x2] split over its last dimension (transformers' rotary)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, equal to transformers' `x * cos + rotate_half(x) * sin`.

    rotate_half(x) * sin is roll(x, D/2) * [-sin_1, sin_2]: the same products up to an exact
    sign flip, in 2 ops instead of 5 (18 -> 10 us a call here).
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin
