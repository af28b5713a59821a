"""Per-session KV caches on a node: continuity checks, idle expiry and a memory cap.

Decisions are pure functions (`expired`, `over_budget`, `make_room`) with the clock passed in;
the `SessionStore` applies them. Before a call grows a cache, the store checks the cap: it
evicts kept prefixes first, then sessions idle for `evict_idle_s` (least recently used first)
when that makes room, and otherwise refuses the call (429) without touching any session.

A session its entry ended with `keep` stays as a **kept prefix** (ADR-0058): no longer live
(it counts against no session limit), only there for new sessions to fork from, and the
first to go when room is needed or more than `max_kept` are kept.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from meshnet.errors import LimitError, ModelError, SessionError, SessionNotFoundError
from meshnet.types import SessionId
from meshnet.wire import ChunkState, FrameMeta, next_chunk_state
from meshnet.wire.headers import FORK, MAX_REWIND_TOKENS


@dataclass
class Session:
    """One session's state on one shard."""

    cache: Any
    length: int = 0  # tokens in the cache
    chunks: ChunkState | None = None
    last_used_s: float = 0.0
    cache_bytes: int = 0
    batch: int = 0  # the batch size of its frames; every call of a session keeps it
    kept: bool = False  # ended by its entry, kept as a prefix to fork from (ADR-0058)


@dataclass
class PrefixStats:
    """What forks saved (new sessions copying another's first tokens: a kept prefix, a live
    prompt, another answer's prompt) and the tokens they did not compute; what kept
    prefixes hold now."""

    hits: int = 0
    tokens_reused: int = 0
    kept: int = 0
    kept_bytes: int = 0


def rewinds(meta: FrameMeta, length: int) -> bool:
    """Whether `meta` may continue a cache of `length` tokens from below its end: it asks to
    rewind, by at most `MAX_REWIND_TOKENS` (ADR-0038)."""
    return meta.rewind and length - MAX_REWIND_TOKENS <= meta.position <= length


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


def make_room(
    idle_lru_first: Mapping[SessionId, tuple[int, float]],
    used_bytes: int,
    need_bytes: int,
    max_bytes: int,
    min_idle_s: float,
) -> list[SessionId] | None:
    """Sessions to evict so `need_bytes` more fit, or None when evicting idle ones cannot.

    `idle_lru_first` maps each other session to (its bytes, seconds idle), least recent first;
    only sessions idle for at least `min_idle_s` may go.
    """
    victims, total = [], used_bytes
    for sid, (size, idle_s) in idle_lru_first.items():
        if total + need_bytes <= max_bytes:
            break
        if idle_s >= min_idle_s:
            victims.append(sid)
            total -= size
    return victims if total + need_bytes <= max_bytes else None


class SessionStore:
    """The sessions of one shard, least recently used first."""

    def __init__(
        self,
        new_cache: Callable[[], Any],
        measure: Callable[[Any], int],
        *,
        ttl_s: float = 600.0,
        max_bytes: int = 1 << 30,
        evict_idle_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        bytes_per_token: int = 0,
        truncate: Callable[[Any, int], None] = lambda cache, length: None,
        copy: Callable[[Any, int], Any] | None = None,
        max_kept: int = 256,
        stow: Callable[[Any], Any] = lambda cache: cache,
        max_kept_bytes: int | None = None,
    ) -> None:
        """`bytes_per_token`: what a token's cache is expected to cost before any is measured
        (0 left the first session's reservation unchecked: review finding 10); `truncate`
        drops a cache's tokens past a length (rewinds, ADR-0038); `copy` makes a new cache of
        a cache's first tokens (forks, ADR-0045; None: this store refuses forks); `stow`
        turns a cache into what a kept prefix holds (ADR-0058); `max_kept_bytes`: what kept
        prefixes may hold together (the node's KV reserve: review K1; None: `max_bytes`)."""
        self.new_cache = new_cache
        self.truncate = truncate
        self.copy = copy
        self.measure = measure  # bytes held by a cache
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self.evict_idle_s = evict_idle_s  # a session idle this long may be evicted for room
        self.bytes_per_token = bytes_per_token  # then learned from the caches measured
        self.refused = 0  # calls refused because the cache was full
        self.max_kept = max_kept  # kept prefixes at most; the least recently used go first
        self.max_kept_bytes = max_bytes if max_kept_bytes is None else max_kept_bytes
        self.stow = stow
        self.stats = PrefixStats()  # hits and tokens reused (kept and bytes: `prefix_stats`)
        self._sessions: OrderedDict[SessionId, Session] = OrderedDict()

    def checkout(
        self,
        meta: FrameMeta,
        tokens: int = 1,
        keep: AbstractSet[SessionId] = frozenset(),
        pending_bytes: int = 0,
    ) -> tuple[Session, ChunkState]:
        """The session `meta` continues (new at position 0), and its chunk state after it.

        Refuses (changing nothing) a call that does not continue the cache exactly, or whose
        `tokens` new tokens would not fit the memory cap. Sessions in `keep` (checked out for
        the same batch) are never evicted to make room, and `pending_bytes` (what they will
        add) counts as used.
        """
        self.expire()
        session = self._sessions.get(meta.session)
        forked = None
        if session is None:
            forked = self._parent(meta)
            if forked is None:
                session = Session(self.new_cache())
            else:  # its cache is copied once room is made for it
                session = Session(None, meta.position, batch=forked[1].batch)
                keep = keep | {forked[0]}
        elif session.kept:
            raise SessionNotFoundError(
                f"session {meta.session} ended (kept as a prefix to fork from); a new "
                f"session may fork from it",
                field="X-Meshnet-Session",
            )
        elif meta.position != session.length and not rewinds(meta, session.length):
            problem = "leave a gap" if meta.position > session.length else "overlap it"
            raise SessionError(
                f"session {meta.session} holds {session.length} tokens; a call at position "
                f"{meta.position} would {problem}"
                + (f" (a rewind drops at most {MAX_REWIND_TOKENS})" if meta.rewind else ""),
                field="X-Meshnet-Position",
            )
        chunks = next_chunk_state(session.chunks, meta.chunk_index, meta.chunk_total)
        kept = min(meta.position, session.length)
        self._reserve(meta.session, session, tokens - (session.length - kept), keep, pending_bytes)
        if forked is not None and self.copy is not None:  # room made: now the copy
            session.cache = self._copy(self.copy, meta, forked[1])
        if kept < session.length:  # the frame is taken: the rejected drafts go now (ADR-0038)
            self.truncate(session.cache, kept)
            session.length = kept
        return session, chunks

    def _parent(self, meta: FrameMeta) -> tuple[SessionId, Session] | None:
        """The session a new one forks from, with its id (None: it starts empty, at
        position 0), or the reason it cannot start here."""
        if meta.fork is None:
            if meta.position != 0:
                raise SessionNotFoundError(
                    f"session {meta.session} is unknown here (never started, expired or "
                    f"evicted); re-send its tokens from position 0",
                    field="X-Meshnet-Session",
                )
            return None
        parent = self._sessions.get(meta.fork)
        if parent is None or self.copy is None:
            raise SessionNotFoundError(
                f"session {meta.fork} to fork from is unknown here (never started, expired "
                f"or evicted); re-send session {meta.session}'s tokens from position 0",
                field=FORK,
            )
        if meta.position > parent.length:
            raise SessionError(
                f"session {meta.fork} holds {parent.length} tokens; a fork cannot start at "
                f"position {meta.position}",
                field=FORK,
            )
        return meta.fork, parent

    def _copy(self, copy: Callable[[Any, int], Any], meta: FrameMeta, parent: Session) -> Any:
        """The new session's cache: `parent`'s first `meta.position` tokens."""
        try:
            cache = copy(parent.cache, meta.position)
        except ModelError as exc:  # a sliding layer dropped them: as if the parent were gone
            raise SessionNotFoundError(
                f"session {meta.fork} no longer holds its first {meta.position} tokens "
                f"({exc.message}); re-send session {meta.session}'s tokens from position 0",
                field=FORK,
            ) from exc
        self.stats.hits += 1  # a kept prefix, a prompt being answered, or n > 1's prompt
        self.stats.tokens_reused += meta.position
        if parent.kept:
            parent.last_used_s = self.clock()  # a prefix in use is the last to go
            if meta.fork is not None and meta.fork in self._sessions:
                self._sessions.move_to_end(meta.fork)
        return cache

    def _reserve(
        self,
        sid: SessionId,
        session: Session,
        tokens: int,
        keep: AbstractSet[SessionId],
        pending_bytes: int,
    ) -> None:
        """Make room for `tokens` more of `session`, evicting idle sessions, or refuse (429)."""
        need = self.bytes_per_token * (session.length + tokens) - session.cache_bytes
        others = {k: s for k, s in self._eviction_order() if k != sid}
        used = sum(s.cache_bytes for s in others.values()) + pending_bytes
        now = self.clock()
        idle = {
            k: (s.cache_bytes, float("inf") if s.kept else now - s.last_used_s)
            for k, s in others.items()
            if k not in keep
        }
        victims = make_room(
            idle, used + session.cache_bytes, need, self.max_bytes, self.evict_idle_s
        )
        if victims is None:
            self.refused += 1
            raise LimitError(
                f"this node's KV cache is full ({used + session.cache_bytes} of "
                f"{self.max_bytes} bytes in use; {max(need, 0)} more needed); retry later",
                retry_after_s=1.0,
                field="X-Meshnet-Session",
            )
        for victim in victims:
            del self._sessions[victim]

    def commit(self, sid: SessionId, session: Session, tokens: int, chunks: ChunkState) -> None:
        """Record a successful call of `tokens` tokens, then enforce the memory cap."""
        session.length += tokens
        session.chunks = chunks
        session.last_used_s = self.clock()
        session.cache_bytes = self.measure(session.cache)
        if session.length:
            per_token = -(-session.cache_bytes // session.length)  # ceiling
            self.bytes_per_token = max(self.bytes_per_token, per_token)
        self._sessions[sid] = session
        self._sessions.move_to_end(sid)
        sizes = {k: s.cache_bytes for k, s in self._eviction_order()}
        for victim in over_budget(sizes, self.max_bytes, keep=sid):
            del self._sessions[victim]

    def _eviction_order(self) -> list[tuple[SessionId, Session]]:
        """Every session, the first to evict first: kept prefixes, then live sessions,
        each least recently used first."""
        items = list(self._sessions.items())
        return [i for i in items if i[1].kept] + [i for i in items if not i[1].kept]

    def keep(self, sid: SessionId) -> bool:
        """End `sid` but keep its cache as a prefix to fork from; True when it existed.
        Past `max_kept`, the least recently used kept prefix goes."""
        session = self._sessions.get(sid)
        if session is None:
            return False
        session.kept, session.chunks = True, None
        session.cache = self.stow(session.cache)
        session.cache_bytes = self.measure(session.cache)
        session.last_used_s = self.clock()
        self._sessions.move_to_end(sid)
        kept = {k: s.cache_bytes for k, s in self._sessions.items() if s.kept}
        victims = list(kept)[: max(len(kept) - self.max_kept, 0)]
        for victim in victims:
            del kept[victim]
        victims += over_budget(kept, self.max_kept_bytes)  # least recently used first
        for victim in victims:
            del self._sessions[victim]
        return True

    def prefix_stats(self) -> PrefixStats:
        """Hits and tokens reused so far; kept prefixes and their bytes now."""
        kept = [s for s in list(self._sessions.values()) if s.kept]
        sizes = sum(s.cache_bytes for s in kept)
        return PrefixStats(self.stats.hits, self.stats.tokens_reused, len(kept), sizes)

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
        """Live sessions (kept prefixes are not)."""
        return sum(not s.kept for s in list(self._sessions.values()))

    def total_bytes(self) -> int:
        # list() copies in one step: a scrape on the event loop may run while the worker
        # thread commits a prefill chunk
        return sum(s.cache_bytes for s in list(self._sessions.values()))
