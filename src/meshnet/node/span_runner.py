"""`SpanRunner`: a loaded span plus its sessions, behind the `ShardRunner` seam.

The span is anything with the `Span` surface: a torch `Shard` (`node.torch_runner`) or a ggml
span (`node.ggml_runner`), whose caches come with their `CacheOps`. Nothing here imports
torch: a node whose spans are all ggml runs without it (ADR-0052).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Protocol

from meshnet.errors import ComputeError, SessionError, WireError
from meshnet.node.runner import Frame, one_by_one
from meshnet.node.scheduler import Failed
from meshnet.node.sessions import PrefixStats, Session, SessionStore
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import ChunkState, FrameMeta
from meshnet.wire import headers as h
from meshnet.wire.frame import Hidden, all_finite

Ready = tuple[int, FrameMeta, Session, ChunkState]  # a checked-out frame of a batch


@dataclass(frozen=True)
class CacheOps:
    """How a span's per-session caches are made, measured, cut and copied (`SessionStore`)."""

    new: Callable[[], Any]
    measure: Callable[[Any], int]
    truncate: Callable[[Any, int], None]
    copy: Callable[[Any, int], Any]
    bytes_per_token: int
    stow: Callable[[Any], Any] = lambda cache: cache  # what a kept prefix holds instead
    trim: Callable[[], object] = lambda: None  # memory freed caches held back to the system


class Span(Protocol):
    """What a runner needs of a loaded span."""

    span: LayerSpan
    config: Any  # hidden_size, max_position_embeddings

    @property
    def batches(self) -> bool:
        """Whether `forward_many` runs many sessions in one pass."""
        ...

    @property
    def quant(self) -> str: ...

    @property
    def device(self) -> str: ...

    def forward(self, hidden: Any, cache: Any, position: int) -> Any:
        """[1, T, H] at `position` -> [1, T, H]."""
        ...

    def forward_many(self, hiddens: Any, caches: Any, positions: Any) -> Any:
        """Many sessions' [1, T, H] frames (each at its position) -> their outputs."""
        ...


class SpanRunner:
    """Runs a loaded span for its sessions; a refused or failed call leaves the session's
    cache as it was."""

    def __init__(
        self,
        model: ModelId,
        shard: Span,
        *,
        ttl_s: float = 600.0,
        max_cache_bytes: int = 1 << 30,
        evict_idle_s: float = 10.0,
        cache_ops: CacheOps,
        max_kept_bytes: int | None = None,
    ) -> None:
        self.model = model
        self.span: LayerSpan = shard.span
        self.shard = shard
        ops = self.cache_ops = cache_ops
        self.sessions = SessionStore(
            ops.new,
            ops.measure,
            ttl_s=ttl_s,
            max_bytes=max_cache_bytes,
            evict_idle_s=evict_idle_s,
            bytes_per_token=ops.bytes_per_token,
            truncate=ops.truncate,
            copy=ops.copy,
            stow=ops.stow,
            max_kept_bytes=max_kept_bytes,
        )

    def take(self, hidden: Hidden) -> Hidden:
        """`hidden` as the span computes it (the torch runner makes tensors of bits)."""
        return hidden

    def forward(self, meta: FrameMeta, hidden: Hidden) -> Hidden:
        hidden = self.take(hidden)
        session, chunks = self._checkout(meta, hidden)
        try:
            out: Hidden = self.shard.forward(hidden, session.cache, meta.position)
            _require_finite_output(meta, out)
        except BaseException:
            self.cache_ops.truncate(session.cache, session.length)
            raise
        self.sessions.commit(meta.session, session, hidden.shape[1], chunks)
        return out

    def forward_many(self, frames: list[Frame]) -> list[Hidden | Failed]:
        """Frames of many sessions (decode steps, prefill chunks) as one pass
        (`Shard.forward_many`).

        Each frame is checked and checked out alone (a refused one gets its error); the
        rest run together. A session whose output is non-finite fails alone, its cache
        rolled back; should the pass itself raise, every frame runs again on its own.
        """
        if len(frames) == 1 or not self.shard.batches:
            return one_by_one(self.forward, frames)
        frames = [(meta, self.take(hidden)) for meta, hidden in frames]
        results: list[Hidden | Failed | None] = [None] * len(frames)
        ready = self._checkout_all(frames, results)
        if ready:
            self._run_packed(frames, ready, results)
        return [r if r is not None else Failed(RuntimeError("frame not run")) for r in results]

    def _checkout_all(
        self, frames: list[Frame], results: list[Hidden | Failed | None]
    ) -> list[Ready]:
        ready: list[Ready] = []
        busy: set[SessionId] = set()
        pending = 0  # tokens the frames checked out so far will add
        for index, (meta, hidden) in enumerate(frames):
            try:
                if meta.session in busy:
                    raise SessionError(
                        f"session {meta.session} sent two frames at once; each continues the "
                        f"last one answered",
                        field=h.POSITION,
                    )
                if hidden.shape[0] != 1:
                    raise WireError("a batched frame holds one row", field=h.SHAPE)
                extra = pending * self.sessions.bytes_per_token
                session, chunks = self._checkout(meta, hidden, busy, extra)
            except Exception as exc:  # refused alone: the frame's own request gets it
                results[index] = Failed(exc)
                continue
            busy.add(meta.session)
            pending += hidden.shape[1]
            ready.append((index, meta, session, chunks))
        return ready

    def _run_packed(
        self,
        frames: list[Frame],
        ready: list[Ready],
        results: list[Hidden | Failed | None],
    ) -> None:
        hiddens = [frames[i][1] for i, *_ in ready]  # [1, T, H] each
        caches = [session.cache for _, _, session, _ in ready]
        try:
            outs = self.shard.forward_many(hiddens, caches, [m.position for _, m, _, _ in ready])
        except Exception:  # the pass as a whole: undo it, then each frame alone
            for _, _, session, _ in ready:
                self.cache_ops.truncate(session.cache, session.length)
            for index, *_ in ready:
                results[index] = one_by_one(self.forward, [frames[index]])[0]
            return
        for out, (index, meta, session, chunks) in zip(outs, ready, strict=True):
            try:
                _require_finite_output(meta, out)
            except ComputeError as exc:
                self.cache_ops.truncate(session.cache, session.length)
                results[index] = Failed(exc)
                continue
            self.sessions.commit(meta.session, session, out.shape[1], chunks)
            results[index] = out

    def _checkout(
        self,
        meta: FrameMeta,
        hidden: Hidden,
        busy: AbstractSet[SessionId] = frozenset(),
        pending_bytes: int = 0,
    ) -> tuple[Session, ChunkState]:
        self._check(meta, hidden)
        session, chunks = self.sessions.checkout(meta, hidden.shape[1], busy, pending_bytes)
        if session.length and session.batch != hidden.shape[0]:
            raise WireError(
                f"session {meta.session} has batch {session.batch}, not {hidden.shape[0]}",
                field=h.SHAPE,
            )
        session.batch = hidden.shape[0]
        return session, chunks

    def _check(self, meta: FrameMeta, hidden: Hidden) -> None:
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

    def drop(self, session: SessionId, keep: bool = False) -> bool:
        """End `session` (keeping its cache as a prefix, with `keep`); on the compute thread,
        which may then give its memory back (`CacheOps.trim`)."""
        ended = self.sessions.keep(session) if keep else self.sessions.drop(session)
        self.cache_ops.trim()
        return ended

    def prefix_stats(self) -> PrefixStats:
        return self.sessions.prefix_stats()

    def session_count(self) -> int:
        return len(self.sessions)

    def cache_bytes(self) -> int:
        return self.sessions.total_bytes()


def _require_finite_output(meta: FrameMeta, out: Hidden) -> None:
    if not all_finite(out):
        raise ComputeError(
            f"layers {meta.span} turned session {meta.session}'s activations into NaN or Inf",
            field="body",
        )
