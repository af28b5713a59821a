"""A ggml span behind the runner seam: `GgmlShard` gives a `GgmlSpan` the torch `Shard`'s
surface (bf16 tensors [1, T, H] in and out), so `TorchShardRunner` keeps its sessions, rewinds,
forks and batching the same for both backends (ADR-0051)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from meshnet.errors import WireError
from meshnet.models.ggml_cache import PoolCache
from meshnet.models.ggml_head import GgmlHead
from meshnet.models.ggml_span import GgmlSpan
from meshnet.node.torch_runner import CacheOps, TorchShardRunner
from meshnet.types import LayerSpan, ModelId
from meshnet.wire import headers as h


class GgmlShard:
    """Layers of a GGUF file computed by ggml at the file's own types."""

    batches = True
    device = "cpu"
    quant = "gguf"
    compute_dtype = torch.float32  # ggml's activations between ops
    fast = None

    def __init__(self, span: GgmlSpan) -> None:
        self.ggml = span
        self.span: LayerSpan = span.span
        self.config = span.config

    def forward(self, hidden: torch.Tensor, cache: PoolCache, position: int) -> torch.Tensor:
        """`hidden` [1, T, H] at `position` -> [1, T, H] bf16."""
        return self.forward_many([hidden], [cache], [position])[0]

    def forward_many(
        self, hiddens: Sequence[torch.Tensor], caches: Sequence[PoolCache], positions: Sequence[int]
    ) -> list[torch.Tensor]:
        rows = [_rows(hidden) for hidden in hiddens]
        outs = self.ggml.forward_many(rows, caches, positions)
        return [torch.from_numpy(out).to(torch.bfloat16)[None] for out in outs]

    def weight_bytes(self) -> int:
        return self.ggml.weight_bytes

    def cache_ops(self) -> CacheOps:
        return CacheOps(
            new=self.ggml.new_cache,
            measure=lambda cache: cache.nbytes,
            truncate=lambda cache, length: cache.truncate(length),
            copy=lambda cache, length: cache.copy(length),
            bytes_per_token=self.ggml.cache_bytes_per_token,
        )


@dataclass(frozen=True)
class Vocabulary:
    num_embeddings: int


class GgmlHeadModule:
    """A `GgmlHead` with the torch `Head`'s surface: ids [B, T] in, hidden states
    [B, T, H] float32 out; logits [B, T, V] float32 in host memory."""

    int8_head = None

    def __init__(self, head: GgmlHead) -> None:
        self.ggml = head
        self.embed = Vocabulary(head.vocab)

    def embed_tokens(self, ids: torch.Tensor, position: int) -> torch.Tensor:
        out = self.ggml.embed(ids.reshape(-1).numpy())
        return torch.from_numpy(out).reshape(*ids.shape, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1]).float().numpy()
        return torch.from_numpy(self.ggml.logits(rows)).reshape(*hidden.shape[:-1], -1)


def _rows(hidden: torch.Tensor) -> np.ndarray:
    """[1, T, H] -> float32 [T, H]; a ggml span runs one sequence a frame."""
    if hidden.shape[0] != 1:
        raise WireError(f"a ggml span runs frames of batch 1, not {hidden.shape[0]}", field=h.SHAPE)
    return hidden[0].float().numpy()


def ggml_runner(
    model: ModelId,
    path: Path,
    span: LayerSpan,
    *,
    threads: int,
    ttl_s: float,
    max_cache_bytes: int,
    evict_idle_s: float,
) -> TorchShardRunner:
    shard = GgmlShard(GgmlSpan(path, span, threads))
    return TorchShardRunner(
        model,
        shard,  # type: ignore[arg-type]  # the Shard surface the runner uses
        ttl_s=ttl_s,
        max_cache_bytes=max_cache_bytes,
        evict_idle_s=evict_idle_s,
        cache_ops=shard.cache_ops(),
    )
