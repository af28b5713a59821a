"""Per-session KV caches on a node: continuity checks, idle expiry and a memory cap.

Decisions are pure functions (`expired`, `over_budget`) with the clock passed in; the
`SessionStore` applies them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from meshnet.errors import SessionError, SessionNotFoundError
from meshnet.types import SessionId
from meshnet.wire import ChunkState, FrameMeta, next_chunk_state


@dataclass
class Session:
    """One session's state on one shard."""

    cache: Any
    length: int = 0  # tokens in the cache
    chunks: ChunkState | None = None
    last_used_s: float = 0.0
    cache_bytes: int = 0


def expired(last_used_s: Mapping[SessionId, float], now_s: float, ttl_s: float) -> list[SessionId]:
    """Sessions idle for longer than `ttl_s`."""
    return [sid for sid, used in last_used_s.items() if now_s - used > ttl_s]


def over_budget(
    sizes_lru_first: Mapping[SessionId, int], max_bytes: int, keep: SessionId | None = None
) -> list[SessionId]:
    """Least-recently-used sessions to evict so the rest fit `max_bytes` (`keep` stays)."""
    total = sum(sizes_lru_first.values())
    victims = []
    for sid, size in sizes_lru_first.items():
        if total <= max_bytes:
            break
        if sid != keep:
            victims.append(sid)
            total -= size
    return victims


class SessionStore:
    """The sessions of one shard, least recently used first."""

    def __init__(
        self,
        new_cache: Callable[[], Any],
        measure: Callable[[Any], int],
        *,
        ttl_s: float = 600.0,
        max_bytes: int = 1 << 30,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.new_cache = new_cache
        self.measure = measure  # bytes held by a cache
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._sessions: OrderedDict[SessionId, Session] = OrderedDict()

    def checkout(self, meta: FrameMeta) -> tuple[Session, ChunkState]:
        """The session `meta` continues (new at position 0), and its chunk state after it.

        Refuses (changing nothing) a call that does not continue the cache exactly.
        """
        self.expire()
        session = self._sessions.get(meta.session)
        if session is None:
            if meta.position != 0:
                raise SessionNotFoundError(
                    f"session {meta.session} is unknown here (never started, expired or "
                    f"evicted); re-send its tokens from position 0",
                    field="X-Meshnet-Session",
                )
            session = Session(self.new_cache())
        elif meta.position != session.length:
            problem = "gap" if meta.position > session.length else "overlap"
            raise SessionError(
                f"session {meta.session} holds {session.length} tokens; a call at position "
                f"{meta.position} would leave a {problem}",
                field="X-Meshnet-Position",
            )
        return session, next_chunk_state(session.chunks, meta.chunk_index, meta.chunk_total)

    def commit(self, sid: SessionId, session: Session, tokens: int, chunks: ChunkState) -> None:
        """Record a successful call of `tokens` tokens, then enforce the memory cap."""
        session.length += tokens
        session.chunks = chunks
        session.last_used_s = self.clock()
        session.cache_bytes = self.measure(session.cache)
        self._sessions[sid] = session
        self._sessions.move_to_end(sid)
        sizes = {k: s.cache_bytes for k, s in self._sessions.items()}
        for victim in over_budget(sizes, self.max_bytes, keep=sid):
            del self._sessions[victim]

    def expire(self) -> list[SessionId]:
        gone = expired(
            {k: s.last_used_s for k, s in self._sessions.items()}, self.clock(), self.ttl_s
        )
        for sid in gone:
            del self._sessions[sid]
        return gone

    def drop(self, sid: SessionId) -> bool:
        return self._sessions.pop(sid, None) is not None

    def __len__(self) -> int:
        return len(self._sessions)

    def total_bytes(self) -> int:
        return sum(s.cache_bytes for s in self._sessions.values())
