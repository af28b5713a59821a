"""`TorchShardRunner`: a torch `Shard` behind the runner seam (`node.span_runner`)."""

from __future__ import annotations

import torch

from meshnet.models.cache import cache_bytes, copy, new_cache, truncate
from meshnet.models.shard import Shard
from meshnet.node.span_runner import CacheOps, SpanRunner
from meshnet.types import ModelId
from meshnet.wire.frame import Hidden
from meshnet.wire.tensors import as_tensor


def torch_cache_ops(shard: Shard) -> CacheOps:
    return CacheOps(new_cache, cache_bytes, truncate, copy, expected_cache_bytes(shard))


def expected_cache_bytes(shard: Shard) -> int:
    """KV-cache bytes a token costs across the shard's layers, from its config (keys and
    values at the compute dtype)."""
    spec = shard.arch.spec_from_config(shard.config.to_dict())
    dtype_bytes = torch.empty(0, dtype=shard.compute_dtype).element_size()
    return len(shard.layers) * spec.kv_bytes_per_token(dtype_bytes)


class TorchShardRunner(SpanRunner):
    """Runs a torch shard; frames' bf16 bits become tensors over the same memory."""

    shard: Shard

    def __init__(
        self,
        model: ModelId,
        shard: Shard,
        *,
        ttl_s: float = 600.0,
        max_cache_bytes: int = 1 << 30,
        evict_idle_s: float = 10.0,
        max_kept_bytes: int | None = None,
    ) -> None:
        super().__init__(
            model,
            shard,
            ttl_s=ttl_s,
            max_cache_bytes=max_cache_bytes,
            evict_idle_s=evict_idle_s,
            cache_ops=torch_cache_ops(shard),
            max_kept_bytes=max_kept_bytes,
        )

    def take(self, hidden: Hidden) -> torch.Tensor:
        return as_tensor(hidden)
