"""A shard's per-session KV cache: create, measure, and roll back to a length."""

from __future__ import annotations

from typing import Any

from transformers import DynamicCache


def new_cache() -> Any:
    """An empty cache; its layers are numbered from 0 within the shard."""
    return DynamicCache()


def cache_length(cache: Any) -> int:
    """Tokens held (layer 0 is the shard's first layer)."""
    return int(cache.get_seq_length(0))


def cache_bytes(cache: Any) -> int:
    """Bytes of keys and values held."""
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None and getattr(layer, "is_initialized", True):
                total += tensor.numel() * tensor.element_size()
    return total


def truncate(cache: Any, length: int) -> None:
    """Drop every layer's entries beyond `length` tokens (undoes a failed forward pass)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            current = layer.get_seq_length()
            if current > length:
                layer.crop(length - current)
