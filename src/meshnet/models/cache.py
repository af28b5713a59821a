"""A shard's per-session KV cache: create, measure, and roll back to a length.

`SpanCache` is what a session holds. Its storage is chosen by the shard at the first forward
pass: transformers' `DynamicCache` for the eager layers, or `StaticKV` (pre-allocated key and
value tensors, no allocation per token) for the fast decode path (ADR-0021).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

MIN_CAPACITY = 64  # tokens a static cache first holds; it doubles when full


class StaticKV:
    """Keys and values of every layer of a span in two tensors [L, B, kv_heads, capacity, D].

    Tokens `[0, length)` are valid. Growing copies once into twice the capacity, so a session
    of n tokens allocates O(log n) times, never per token.
    """

    def __init__(
        self,
        layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        dtype: Any,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (layers, batch, kv_heads, MIN_CAPACITY, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[3])

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` more tokens after `length` (doubling the capacity)."""
        needed = self.length + tokens
        if needed <= self.capacity:
            return
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        for name in ("keys", "values"):
            old: torch.Tensor = getattr(self, name)
            new = old.new_zeros((*old.shape[:3], capacity, old.shape[4]))
            new[:, :, :, : self.length] = old[:, :, :, : self.length]
            setattr(self, name, new)

    def token_bytes(self) -> int:
        """Bytes one token takes in every layer (keys and values)."""
        per_layer = self.keys[:, :, :, 0].numel() * self.keys.element_size()
        return 2 * per_layer


class SpanCache:
    """One session's cache on one shard (see the module docstring)."""

    def __init__(self) -> None:
        self.dynamic: Any = None  # transformers.DynamicCache, for the eager layers
        self.static: StaticKV | None = None  # for the fast decode path

    def as_dynamic(self) -> Any:
        if self.dynamic is None:
            self.dynamic = DynamicCache()
        return self.dynamic


def new_cache() -> SpanCache:
    """An empty cache; its layers are numbered from 0 within the shard."""
    return SpanCache()


def cache_length(cache: SpanCache) -> int:
    """Tokens held (layer 0 is the shard's first layer)."""
    if cache.static is not None:
        return cache.static.length
    return int(cache.dynamic.get_seq_length(0)) if cache.dynamic is not None else 0


def cache_bytes(cache: SpanCache) -> int:
    """Bytes of keys and values held (for a static cache: of the tokens it holds; its
    allocation is at most twice that, plus `MIN_CAPACITY` tokens)."""
    if cache.static is not None:
        return cache.static.length * cache.static.token_bytes()
    total = 0
    for layer in cache.dynamic.layers if cache.dynamic is not None else []:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None and getattr(layer, "is_initialized", True):
                total += tensor.numel() * tensor.element_size()
    return total


def truncate(cache: SpanCache, length: int) -> None:
    """Drop every layer's entries beyond `length` tokens (undoes a failed forward pass)."""
    if cache.static is not None:
        cache.static.length = min(cache.static.length, length)
        return
    for layer in cache.dynamic.layers if cache.dynamic is not None else []:
        if getattr(layer, "is_initialized", False):
            current = layer.get_seq_length()
            if current > length:
                layer.crop(length - current)
