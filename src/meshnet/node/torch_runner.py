"""`TorchShardRunner`: a loaded `Shard` plus its sessions, behind the `ShardRunner` seam."""

from __future__ import annotations

import torch

from meshnet.errors import WireError
from meshnet.models.cache import cache_bytes, new_cache, truncate
from meshnet.models.shard import Shard
from meshnet.node.sessions import SessionStore
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import FrameMeta
from meshnet.wire import headers as h


class TorchShardRunner:
    """Runs a real shard; a refused or failed call leaves the session's cache as it was."""

    def __init__(
        self,
        model: ModelId,
        shard: Shard,
        *,
        ttl_s: float = 600.0,
        max_cache_bytes: int = 1 << 30,
        evict_idle_s: float = 10.0,
    ) -> None:
        self.model = model
        self.span: LayerSpan = shard.span
        self.shard = shard
        self.sessions = SessionStore(
            new_cache,
            cache_bytes,
            ttl_s=ttl_s,
            max_bytes=max_cache_bytes,
            evict_idle_s=evict_idle_s,
        )

    def forward(self, meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        self._check(meta, hidden)
        session, chunks = self.sessions.checkout(meta, hidden.shape[1])
        if session.length and session.batch != hidden.shape[0]:
            raise WireError(
                f"session {meta.session} has batch {session.batch}, not {hidden.shape[0]}",
                field=h.SHAPE,
            )
        session.batch = hidden.shape[0]
        try:
            out = self.shard.forward(hidden, session.cache, meta.position)
        except BaseException:
            truncate(session.cache, session.length)
            raise
        self.sessions.commit(meta.session, session, hidden.shape[1], chunks)
        return out

    def _check(self, meta: FrameMeta, hidden: torch.Tensor) -> None:
        """Refuse (400) a frame this shard cannot run: wrong width, past the context."""
        width = int(self.shard.config.hidden_size)
        if hidden.shape[2] != width:
            raise WireError(
                f"hidden size {hidden.shape[2]} does not match the model's {width}", field=h.SHAPE
            )
        context = int(self.shard.config.max_position_embeddings)
        if meta.position + hidden.shape[1] > context:
            raise WireError(
                f"positions up to {meta.position + hidden.shape[1]} exceed the model's context "
                f"of {context} tokens",
                field=h.POSITION,
            )

    def drop(self, session: SessionId) -> bool:
        return self.sessions.drop(session)

    def session_count(self) -> int:
        return len(self.sessions)

    def cache_bytes(self) -> int:
        return self.sessions.total_bytes()
