"""A shard's per-session KV cache: create, measure, and roll back to a length.

`SpanCache` is what a session holds. Its storage is chosen by the shard at the first forward
pass: `EagerKV` (per-layer tensors that grow by concatenation, what transformers' layers and
ours call `update` on) for the eager layers, or `StaticKV` (pre-allocated key and value
tensors, no allocation per token) for the fast decode path (ADR-0021). Neither needs
transformers (ADR-0041).
"""

from __future__ import annotations

from typing import Any

import torch

from meshnet.errors import ModelError

MIN_CAPACITY = 64  # tokens a static cache first holds; it doubles when full
REWIND_TOKENS = 256  # tokens a sliding layer keeps beyond its window, for rollbacks


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

    def copy(self, length: int) -> StaticKV:
        """Another cache holding this one's first `length` tokens (in its own storage)."""
        other = object.__new__(StaticKV)
        other.keys, other.values = self.keys.clone(), self.values.clone()
        other.length = min(length, self.length)
        return other

    def token_bytes(self) -> int:
        """Bytes one token takes in every layer (keys and values)."""
        per_layer = self.keys[:, :, :, 0].numel() * self.keys.element_size()
        return 2 * per_layer


class EagerKV:
    """Each layer's keys and values [B, kv_heads, tokens, D], grown by `update`: the calls
    transformers' decoder layers make on their `DynamicCache`, and ours.

    A sliding-window layer (`slide`) keeps only its last `window + REWIND_TOKENS` tokens:
    what its queries can still see, plus room for a rollback (a failed chunk of at most 128
    tokens, rejected drafts of at most 63). `start(layer)` is the absolute position of the
    first token it keeps; the caller's masks drop the columns before it.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.windows: list[int | None] = []
        self.starts: list[int] = []

    def slide(self, windows: list[int | None]) -> None:
        """Each layer's sliding window (None: full attention), set before the first update."""
        if not self.keys:
            self.windows = list(windows)

    def start(self, layer: int) -> int:
        return self.starts[layer] if layer < len(self.starts) else 0

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer: int, *_: Any, **__: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `keys`/`values` [B, kv, T, D] to `layer`'s; returns all that layer keeps
        (from `start(layer)` as it was before this call) with the new ones."""
        if layer == len(self.keys):
            self.keys.append(keys)
            self.values.append(values)
            self.starts.append(0)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], keys], dim=2)
            self.values[layer] = torch.cat([self.values[layer], values], dim=2)
        seen = self.keys[layer], self.values[layer]
        window = self.windows[layer] if layer < len(self.windows) else None
        if window is not None and seen[0].shape[2] > window + REWIND_TOKENS:
            drop = seen[0].shape[2] - window - REWIND_TOKENS
            self.keys[layer] = seen[0][:, :, drop:].clone()  # a copy frees the old storage
            self.values[layer] = seen[1][:, :, drop:].clone()
            self.starts[layer] += drop
        return seen

    def get_seq_length(self, layer: int = 0) -> int:
        """Tokens seen (absolute), whatever a sliding layer dropped."""
        return self.start(layer) + int(self.keys[layer].shape[2]) if layer < len(self.keys) else 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.keys, *self.values])

    def copy(self, length: int) -> EagerKV:
        """Another cache holding this one's first `length` tokens (see `crop`)."""
        self._reachable(length)
        other = EagerKV()
        other.windows, other.starts = list(self.windows), list(self.starts)
        kept = [length - start for start in self.starts]  # tokens of each layer
        other.keys = [k[:, :, :n].clone() for k, n in zip(self.keys, kept, strict=True)]
        other.values = [v[:, :, :n].clone() for v, n in zip(self.values, kept, strict=True)]
        return other

    def _reachable(self, length: int) -> None:
        if any(length < start for start in self.starts):
            raise ModelError(
                f"cannot take this session back to {length} tokens: a sliding-window layer "
                f"keeps tokens from {max(self.starts)} on"
            )

    def crop(self, length: int) -> None:
        """Keep the first `length` tokens of every layer; ModelError when a sliding layer
        already dropped some of them (a rollback deeper than `REWIND_TOKENS`)."""
        self._reachable(length)
        self.keys = [k[:, :, : length - s] for k, s in zip(self.keys, self.starts, strict=True)]
        self.values = [v[:, :, : length - s] for v, s in zip(self.values, self.starts, strict=True)]


class SpanCache:
    """One session's cache on one shard (see the module docstring)."""

    def __init__(self) -> None:
        self.eager: EagerKV | None = None  # for the eager layers
        self.static: StaticKV | None = None  # for the fast decode path

    def as_eager(self) -> EagerKV:
        if self.eager is None:
            self.eager = EagerKV()
        return self.eager


def new_cache() -> SpanCache:
    """An empty cache; its layers are numbered from 0 within the shard."""
    return SpanCache()


def cache_length(cache: SpanCache) -> int:
    """Tokens held (layer 0 is the shard's first layer)."""
    if cache.static is not None:
        return cache.static.length
    return cache.eager.get_seq_length(0) if cache.eager is not None else 0


def cache_bytes(cache: SpanCache) -> int:
    """Bytes of keys and values held (for a static cache: of the tokens it holds; its
    allocation is at most twice that, plus `MIN_CAPACITY` tokens)."""
    if cache.static is not None:
        return cache.static.length * cache.static.token_bytes()
    return cache.eager.nbytes() if cache.eager is not None else 0


def copy(cache: SpanCache, length: int) -> SpanCache:
    """A new session's cache holding `cache`'s first `length` tokens (a fork, ADR-0045)."""
    other = SpanCache()
    other.static = cache.static.copy(length) if cache.static is not None else None
    other.eager = cache.eager.copy(length) if cache.eager is not None else None
    return other


def truncate(cache: SpanCache, length: int) -> None:
    """Drop every layer's entries beyond `length` tokens (undoes a failed forward pass)."""
    if cache.static is not None:
        cache.static.length = min(cache.static.length, length)
        return
    if cache.eager is not None and cache.eager.get_seq_length() > length:
        cache.eager.crop(length)
