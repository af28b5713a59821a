"""`TorchShardRunner`: a loaded `Shard` plus its sessions, behind the `ShardRunner` seam."""

from __future__ import annotations

import torch

from meshnet.models.cache import cache_bytes, new_cache, truncate
from meshnet.models.shard import Shard
from meshnet.node.sessions import SessionStore
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import FrameMeta


class TorchShardRunner:
    """Runs a real shard; a refused or failed call leaves the session's cache as it was."""

    def __init__(
        self, model: ModelId, shard: Shard, *, ttl_s: float = 600.0, max_cache_bytes: int = 1 << 30
    ) -> None:
        self.model = model
        self.span: LayerSpan = shard.span
        self.shard = shard
        self.sessions = SessionStore(new_cache, cache_bytes, ttl_s=ttl_s, max_bytes=max_cache_bytes)

    def forward(self, meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        session, chunks = self.sessions.checkout(meta)
        try:
            out = self.shard.forward(hidden, session.cache, meta.position)
        except BaseException:
            truncate(session.cache, session.length)
            raise
        self.sessions.commit(meta.session, session, hidden.shape[1], chunks)
        return out

    def drop(self, session: SessionId) -> bool:
        return self.sessions.drop(session)

    def session_count(self) -> int:
        return len(self.sessions)
