"""The hop protocol, the entry's side: frames along a session's route of remote hops.

`Hops` is everything that talks to the hops and the tracker for one entry's model: it builds
every frame's metadata (`meta_for`), asks for routes around banned and slow nodes, sends a
frame through one hop (relayed) or a whole route (pushed, ADR-0034), replays a session's
inputs into a new hop, and reports failed nodes. What to do when a hop fails is
`entry/failover.py`'s; the spot checks that judge answers are `entry/spotcheck.py`'s, told of
every relayed answer through `AnswerCheck`. Neither is imported here: they build on this.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch

from meshnet.config import EntryConfig, WireConfig
from meshnet.entry.bans import Bans, banned
from meshnet.entry.latency import HopLatencies
from meshnet.entry.routes import RouteSource
from meshnet.entry.session import PipelineSession
from meshnet.entry.transport import Transport
from meshnet.errors import HopError, PrefixMissError, RouteError
from meshnet.observe.metrics import Metrics
from meshnet.security.ownership import PROCESS_KEYS, SessionKeys
from meshnet.types import Hop, LayerSpan, ModelId, NodeId, SessionId
from meshnet.wire import FrameMeta, split_prefill
from meshnet.wire.headers import FORK
from meshnet.wire.tensors import TensorChunk

log = logging.getLogger(__name__)


class AnswerCheck(Protocol):
    """What judges hop answers (the spot checker): its sampling rate, its bans, and a look
    at every relayed answer."""

    rate: float
    bans: Bans

    def offer(
        self, hops: Hops, session: PipelineSession, k: int, meta: FrameMeta, answer: torch.Tensor
    ) -> None:
        """Hop `k` of `session` answered `meta`'s frame with `answer` [1, T, H]."""
        ...


class NoCheck:
    """No spot checks; no bans."""

    rate = 0.0

    def __init__(self) -> None:
        self.bans = Bans(ban_s=0.0)

    def offer(
        self, hops: Hops, session: PipelineSession, k: int, meta: FrameMeta, answer: torch.Tensor
    ) -> None:
        return None


class Hops:
    """Sends one entry's frames of `model` along routes of remote hops after layer `start`."""

    def __init__(
        self,
        model: ModelId,
        start: int,
        routes: RouteSource,
        transport: Transport,
        wire: WireConfig = WireConfig(),
        config: EntryConfig = EntryConfig(),
        *,
        checker: AnswerCheck | None = None,
        metrics: Metrics | None = None,
        keys: SessionKeys = PROCESS_KEYS,
    ) -> None:
        self.model = model
        self.start = start  # the first layer after the entry's own span
        self.routes = routes
        self.transport = transport
        self.wire = wire
        self.retry = config.retry
        self.max_replay_bytes = config.max_replay_bytes  # per session, for failover
        self.checker = checker or NoCheck()
        self.bans = self.checker.bans
        self.metrics = metrics or Metrics()
        self.keys = keys  # session ids name keys only this process holds (ADR-0049)
        self.latencies = HopLatencies()  # decode frames timed per hop: slow ones avoided
        # hops send their outputs on themselves (ADR-0034); spot checks need every hop's
        # answer, so an entry that checks relays
        self.push = config.push and self.checker.rate == 0.0
        if config.push and not self.push:
            log.warning("spot checks need every hop's answer: relaying (push needs rate 0)")

    def meta_for(
        self,
        session: PipelineSession | SessionId,
        span: LayerSpan,
        position: int,
        index: int = 0,
        total: int = 1,
    ) -> FrameMeta:
        """A frame of this model: a live session's carries its rewind and fork flags; a
        replay's (a bare session id) neither."""
        if isinstance(session, PipelineSession):
            return FrameMeta(
                session.id, self.model, span, position, index, total,
                session.rewinding, session.forking,
            )  # fmt: skip
        return FrameMeta(session, self.model, span, position, index, total)

    async def route(
        self, start: int, end: int | None = None, exclude: frozenset[NodeId] = frozenset()
    ) -> list[Hop]:
        """Hops covering layers `[start, end)` without `exclude` (raises `RouteError`)."""
        return await self.routes.route(self.model, start, end=end, exclude=exclude)

    async def fresh_route(self) -> list[Hop]:
        """A new session's route from `start`, without banned nodes, and without slow ones
        when there is one without them."""
        banned = self.bans.active()
        slow = self.latencies.slow() - banned
        if slow:
            try:
                return await self.route(self.start, exclude=banned | slow)
            except RouteError:
                log.info("no route around the slow hops %s: taking them", sorted(slow))
        return await self.route(self.start, exclude=banned)

    async def report(self, node: NodeId, reason: str) -> None:
        """Tell the tracker `node` failed (never raises)."""
        await self.routes.report(node, reason)

    async def close(self, hop: Hop, session: SessionId, keep: bool = False) -> None:
        """Drop `session`'s cache on `hop`, or with `keep` keep it as a prefix (errors are
        logged, not raised)."""
        await self.transport.close_session(hop, session, keep)

    async def send(
        self, session: PipelineSession, k: int, chunk: TensorChunk, hidden: torch.Tensor
    ) -> torch.Tensor:
        """`hidden` [1, T, H], chunk `chunk`'s input to remote hop `k`, relayed through it:
        its output, once the session recorded what it was sent (raises `HopError`)."""
        hop = session.hops[k]
        index, total = (0, 1) if hop in session.fresh else (chunk.index, chunk.total)
        meta = self.meta_for(session, hop.span, chunk.position, index, total)
        if self.bans.has(hop.node_id):
            raise banned(hop)
        started = time.perf_counter()
        try:
            out = await self.transport.forward(hop, meta, hidden)
        except HopError as exc:
            if (miss := fork_miss(session, exc)) is None:
                raise
            raise miss from exc
        if hidden.shape[1] == 1:  # decode frames compare; prefill chunks vary
            self.latencies.record(hop, time.perf_counter() - started)
        session.record(k, hidden, self.max_replay_bytes)
        self.checker.offer(self, session, k, meta, out)
        return out

    async def push_through(self, session: PipelineSession, chunk: TensorChunk) -> torch.Tensor:
        """One chunk pushed through the whole route, each hop sending on to the next
        (ADR-0034): the last hop's output, once the session recorded what the first hop was
        sent (raises `HopError`)."""
        index, total = (0, 1) if session.fresh else (chunk.index, chunk.total)
        meta = self.meta_for(session, session.hops[0].span, chunk.position, index, total)
        for hop in session.hops:
            if self.bans.has(hop.node_id):
                raise banned(hop)
        try:
            out = await self.transport.push(session.hops, meta, chunk.hidden)
        except HopError as exc:
            if (miss := fork_miss(session, exc)) is None:
                raise
            raise miss from exc
        session.record(0, chunk.hidden, self.max_replay_bytes)
        return out

    async def replay(self, hop: Hop, session: SessionId, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden` [1, T, H] from position 0 through `hop` in wire chunks, relayed (a
        replacement's replay, a spot check's re-run): its output [1, T, H]."""
        outputs = []
        for chunk in split_prefill(hidden, 0, self.wire.chunk_tokens):
            meta = self.meta_for(session, hop.span, chunk.position, chunk.index, chunk.total)
            outputs.append(await self.transport.forward(hop, meta, chunk.hidden))
        return torch.cat(outputs, dim=1)

    async def replay_pushed(
        self, hops: list[Hop], session: SessionId, hidden: torch.Tensor
    ) -> None:
        """`hidden` [1, T, H] from position 0 pushed through `hops` in wire chunks."""
        for chunk in split_prefill(hidden, 0, self.wire.chunk_tokens):
            meta = self.meta_for(session, hops[0].span, chunk.position, chunk.index, chunk.total)
            await self.transport.push(hops, meta, chunk.hidden)


def fork_miss(session: PipelineSession, error: HopError) -> PrefixMissError | None:
    """The error to raise instead of `error` when it says a hop lacks the kept prefix
    `session` forks from (409 on its first frames, ADR-0058): no hop failed, so no failover;
    the entry prefills from nothing."""
    if not (session.reused and session.forking is not None and error.status == 409):
        return None
    return PrefixMissError(f"the prefix to fork from is gone: {error.message}", field=FORK)
