"""The shard-runner seam: what `/forward` calls, and a fake that needs no model."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from meshnet.errors import SessionError, SessionNotFoundError
from meshnet.node.scheduler import Failed
from meshnet.node.sessions import PrefixStats, rewinds
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import ChunkState, FrameMeta, next_chunk_state
from meshnet.wire import headers as h
from meshnet.wire.frame import Hidden

Frame = tuple[FrameMeta, Hidden]  # a decoded frame: its metadata, hidden [B, T, H]


class ShardRunner(Protocol):
    """Runs one span of one model for many sessions, each with its own cache."""

    model: ModelId
    span: LayerSpan

    def forward(self, meta: FrameMeta, hidden: Hidden) -> Hidden:
        """`hidden` [batch, tokens, hidden] at `meta.position` -> same shape, bf16: a torch
        tensor for a tensor, bf16 bits (`wire.frame`) or a tensor for a numpy array."""
        ...

    def forward_many(self, frames: list[Frame]) -> list[Hidden | Failed]:
        """Frames of different sessions (decode steps, prefill chunks) as one pass
        (`forward`'s contract for each); a frame that is refused or fails gets its `Failed`
        and changes nothing."""
        ...

    def drop(self, session: SessionId, keep: bool = False) -> bool:
        """End a session: forget its cache, or with `keep` keep it as a prefix new sessions
        may fork from (ADR-0058); True when it existed."""
        ...

    def session_count(self) -> int:
        """Live sessions (kept prefixes are not)."""
        ...

    def prefix_stats(self) -> PrefixStats:
        """Forks from kept prefixes so far, and what the kept ones hold now."""
        ...

    def cache_bytes(self) -> int:
        """Bytes held by all its sessions' KV caches."""
        ...


class EchoRunner:
    """A fake runner: returns its input, but keeps the session contract of a real one.

    Each session must continue where it stopped (position == tokens seen so far) and chunk
    sequences must be well-formed; a refused call changes nothing.
    """

    def __init__(self, model: ModelId, span: LayerSpan, max_sessions: int = 1024) -> None:
        self.model = model
        self.span = span
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[SessionId, tuple[int, ChunkState | None]] = OrderedDict()
        self.kept: set[SessionId] = set()  # ended with keep: prefixes to fork from
        self.stats = PrefixStats()

    def forward(self, meta: FrameMeta, hidden: Hidden) -> Hidden:
        if meta.session in self.kept:
            raise SessionNotFoundError(f"session {meta.session} ended (kept)", field=h.SESSION)
        length, chunks = self._sessions.get(meta.session) or self._start(meta)
        if length and rewinds(meta, length):
            length = meta.position  # rejected drafts dropped (ADR-0038)
        if meta.position != length:
            raise SessionError(
                f"session {meta.session} holds {length} tokens; a call at "
                f"position {meta.position} does not continue it",
                field="position",
            )
        state = next_chunk_state(chunks, meta.chunk_index, meta.chunk_total)
        self._sessions[meta.session] = (length + hidden.shape[1], state)
        self._sessions.move_to_end(meta.session)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return hidden

    def _start(self, meta: FrameMeta) -> tuple[int, ChunkState | None]:
        """A new session: empty, or a fork of a session it holds (ADR-0045)."""
        if meta.fork is None:
            return 0, None
        parent = self._sessions.get(meta.fork)
        if parent is None or parent[0] < meta.position:
            raise SessionNotFoundError(
                f"cannot fork session {meta.fork} at {meta.position}", field=h.FORK
            )
        self.stats.hits += 1
        self.stats.tokens_reused += meta.position
        return meta.position, None

    def forward_many(self, frames: list[Frame]) -> list[Hidden | Failed]:
        return one_by_one(self.forward, frames)

    def drop(self, session: SessionId, keep: bool = False) -> bool:
        if keep and session in self._sessions:
            self.kept.add(session)
            return True
        self.kept.discard(session)
        return self._sessions.pop(session, None) is not None

    def session_count(self) -> int:
        return len(self._sessions) - len(self.kept & self._sessions.keys())

    def prefix_stats(self) -> PrefixStats:
        kept = len(self.kept & self._sessions.keys())
        return PrefixStats(self.stats.hits, self.stats.tokens_reused, kept, 0)

    def cache_bytes(self) -> int:
        return 0  # it keeps no activations


def one_by_one(
    forward: Callable[[FrameMeta, Hidden], Hidden], frames: list[Frame]
) -> list[Hidden | Failed]:
    """`forward_many` for a runner that cannot batch: each frame alone, failing alone."""
    results: list[Hidden | Failed] = []
    for meta, hidden in frames:
        try:
            results.append(forward(meta, hidden))
        except Exception as exc:  # each frame is its own request: it fails alone
            results.append(Failed(exc))
    return results
