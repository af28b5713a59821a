"""A ggml span behind the runner seam (ADR-0051): `GgmlShard` gives a `GgmlSpan` the `Span`
surface `SpanRunner` drives (sessions, rewinds, forks and batching as for torch spans).

Torch-free (ADR-0052): a frame's bf16 bits are widened to float32 rows with numpy and the
output rounded back to bits. Only an entry hands in torch tensors (its own span's input);
those get tensors back.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from meshnet.errors import WireError
from meshnet.models.ggml_cache import PoolCache
from meshnet.models.ggml_span import GgmlSpan
from meshnet.node.span_runner import CacheOps, SpanRunner
from meshnet.types import LayerSpan, ModelId
from meshnet.wire import headers as h
from meshnet.wire.frame import Hidden, bf16_bits, bits_to_float32


class GgmlShard:
    """Layers of a GGUF file computed by ggml at the file's own types."""

    batches = True
    device = "cpu"
    quant = "gguf"
    fast = None

    def __init__(self, span: GgmlSpan) -> None:
        self.ggml = span
        self.span: LayerSpan = span.span
        self.config = span.config

    def forward(self, hidden: Hidden, cache: PoolCache, position: int) -> Hidden:
        """`hidden` [1, T, H] at `position` -> [1, T, H] bf16."""
        return self.forward_many([hidden], [cache], [position])[0]

    def forward_many(
        self, hiddens: Sequence[Hidden], caches: Sequence[PoolCache], positions: Sequence[int]
    ) -> list[Hidden]:
        rows = [_rows(hidden) for hidden in hiddens]
        outs = self.ggml.forward_many(rows, caches, positions)
        return [_like(hidden, out) for hidden, out in zip(hiddens, outs, strict=True)]

    def weight_bytes(self) -> int:
        return self.ggml.weight_bytes

    def cache_ops(self) -> CacheOps:
        return CacheOps(
            new=self.ggml.new_cache,
            measure=lambda cache: cache.nbytes,
            truncate=lambda cache, length: cache.truncate(length),
            copy=lambda cache, length: cache.copy(length),
            bytes_per_token=self.ggml.cache_bytes_per_token,
            stow=lambda cache: cache.stow(),  # kept prefixes leave the shared pool
            trim=self.ggml.pool.give_back,  # pages of cells past the last taken (review K1)
        )


def _rows(hidden: Hidden) -> np.ndarray:
    """[1, T, H] (bits, floats or a tensor) -> float32 [T, H]; a ggml span runs one sequence
    a frame."""
    if hidden.shape[0] != 1:
        raise WireError(f"a ggml span runs frames of batch 1, not {hidden.shape[0]}", field=h.SHAPE)
    if not isinstance(hidden, np.ndarray):  # a tensor, from an entry's own pipeline
        return hidden[0].float().numpy()
    if hidden.dtype == np.uint16:
        return bits_to_float32(hidden[0])
    return np.ascontiguousarray(hidden[0], dtype=np.float32)


def _like(hidden: Hidden, out: np.ndarray) -> Hidden:
    """float32 [T, H] -> [1, T, H] bf16: bits for an array, a tensor for a tensor."""
    bits = bf16_bits(out)[None]
    if isinstance(hidden, np.ndarray):
        return bits
    from meshnet.wire.tensors import bits_tensor  # torch is loaded: a tensor came in

    return bits_tensor(bits)


def ggml_runner(
    model: ModelId,
    path: Path,
    span: LayerSpan,
    *,
    threads: int,
    ttl_s: float,
    max_cache_bytes: int,
    evict_idle_s: float,
    max_kept_bytes: int | None = None,
) -> SpanRunner:
    shard = GgmlShard(GgmlSpan(path, span, threads))
    return SpanRunner(
        model,
        shard,
        ttl_s=ttl_s,
        max_cache_bytes=max_cache_bytes,
        evict_idle_s=evict_idle_s,
        cache_ops=shard.cache_ops(),
        max_kept_bytes=max_kept_bytes,
    )
