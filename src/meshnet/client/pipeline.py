"""The entry node's pipeline: token ids in, next-token logits out, through every hop.

The entry node runs its own span (layers `[0, k)`) in this process, then sends the activations
through the remote hops of the session's route in order. Over the wire a prompt goes as chunks
of at most `chunk_tokens` tokens (ADR-0008): each chunk passes every remote hop before the next
chunk starts, and every hop appends it to the session's cache. The session remembers every
token id it fed, so any hop's cache can be rebuilt by replaying them.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from meshnet.client.failover import failover
from meshnet.client.routes import RouteSource
from meshnet.client.transport import Hop, Transport
from meshnet.config import RetryPolicy, WireConfig
from meshnet.errors import HopError
from meshnet.node.runner import ShardRunner
from meshnet.observe.metrics import Metrics
from meshnet.types import ModelId, NodeId, SessionId
from meshnet.wire import Chunk, FrameMeta, split_prefill

log = logging.getLogger(__name__)
T = TypeVar("T")


class Executor(Protocol):
    """Runs model work one call at a time (the node's `NodeService` is one)."""

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` alone, on the process's compute thread."""
        ...

    def admit_session(self) -> None:
        """Raise when this process takes no new session (draining, or at `max_sessions`)."""
        ...


class HeadLike(Protocol):
    def embed_tokens(self, ids: torch.Tensor, position: int) -> torch.Tensor:
        """Token ids [1, T] at `position` -> hidden states [1, T, H]."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [1, T, H] -> float32 logits [1, T, V]."""
        ...


@dataclass
class PipelineSession:
    """One generation's state at the entry node."""

    id: SessionId
    hops: list[Hop]  # the remote hops after the entry's own span, in order
    history: list[int] = field(default_factory=list)  # every token id fed, prompt first
    position: int = 0  # tokens every hop's cache holds
    # what each hop was sent, bf16 [1, T, H] pieces in order: replayed into a replacement hop
    inputs: list[list[torch.Tensor]] = field(default_factory=list)
    banned: set[NodeId] = field(default_factory=set)  # hops that failed this session
    fresh: set[Hop] = field(default_factory=set)  # replacements joined mid-prefill
    failover_pauses_s: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.inputs = self.inputs or [[] for _ in self.hops]


class Pipeline:
    """Feeds token ids through the entry's span and a route of remote hops."""

    def __init__(
        self,
        model: ModelId,
        num_layers: int,
        head: HeadLike,
        local: ShardRunner,
        executor: Executor,
        routes: RouteSource,
        transport: Transport,
        wire: WireConfig = WireConfig(),
        entry_id: str = "entry",
        retry: RetryPolicy = RetryPolicy(),
        local_chunk_tokens: int = 2048,
        metrics: Metrics | None = None,
    ) -> None:
        if local.span.start != 0:
            raise ValueError(f"an entry node serves layers from 0, not {local.span}")
        self.model = model
        self.num_layers = num_layers
        self.head = head
        self.local = local
        self.executor = executor
        self.routes = routes
        self.transport = transport
        self.wire = wire
        self.local_chunk_tokens = local_chunk_tokens
        self.retry = retry
        self.entry_hop = Hop(NodeId(entry_id), "local", local.span)  # this node's own span
        self.metrics = metrics or Metrics()

    async def open(self) -> PipelineSession:
        """A new session with a route for the layers after the entry's span; the entry's own
        span counts against its process's session limit like any hop's."""
        self.executor.admit_session()
        start = self.local.span.end
        hops = await self.routes.route(self.model, start) if start < self.num_layers else []
        return PipelineSession(SessionId(f"s-{uuid.uuid4().hex}"), hops)

    async def feed(self, session: PipelineSession, ids: list[int]) -> torch.Tensor:
        """Run `ids` after the session's tokens; float32 logits [V] for the next token.

        The entry's own work is one compute-thread call (embeddings and its span, plus the
        logits when there is no remote hop): each hand-off costs ~0.2 ms a token.
        """
        tokens = torch.tensor([ids], dtype=torch.long)
        last = not session.hops
        out = await self.executor.call(self._run_local, session, tokens, last)
        if not last:
            for chunk in split_prefill(out, session.position, self.wire.chunk_tokens):
                out = await self._remote(session, chunk)
            out = await self.executor.call(self._logits, out)
        session.position += len(ids)
        session.history.extend(ids)
        session.fresh.clear()  # replacements take part in the next chunk sequence from its start
        return out

    def _run_local(
        self, session: PipelineSession, tokens: torch.Tensor, logits: bool
    ) -> torch.Tensor:
        """Compute thread: embeddings and the entry's own span -> hidden [1, T, H], or the
        logits [V] of the last token. The span runs in pieces of `local_chunk_tokens`: no
        wire, so no 128-token limit; chunks of 128 cost ~1.3x one pass on a CPU (masked
        attention, small GEMMs), and the bound keeps a long prompt's attention memory in check.
        """
        hidden = self.head.embed_tokens(tokens, session.position)
        outputs = []
        for piece in split_prefill(hidden, session.position, self.local_chunk_tokens):
            meta = FrameMeta(
                session.id, self.model, self.local.span, piece.position, piece.index, piece.total
            )
            outputs.append(self.local.forward(meta, piece.hidden))
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        return self._logits(out) if logits else out

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Compute thread: hidden [1, T, H] -> float32 logits [V] of the last token."""
        return self.head.logits(hidden[:, -1:])[0, -1]

    async def _remote(self, session: PipelineSession, chunk: Chunk) -> torch.Tensor:
        """One chunk through every remote hop in order; the last hop's output.

        A hop that fails is replaced (`failover`) and the same chunk goes to its replacement.
        """
        hidden, k = chunk.hidden, 0
        while k < len(session.hops):
            hop = session.hops[k]
            index, total = (0, 1) if hop in session.fresh else (chunk.index, chunk.total)
            meta = FrameMeta(session.id, self.model, hop.span, chunk.position, index, total)
            try:
                out = await self.transport.forward(hop, meta, hidden)
            except HopError as exc:
                if not exc.retryable:
                    raise
                await failover(self, session, k, exc)
                self.metrics.failovers.inc()
                continue
            session.inputs[k].append(hidden)
            hidden, k = out, k + 1
        return hidden

    async def close(self, session: PipelineSession) -> None:
        """Drop the session's cache here and on every hop (errors are logged, not raised)."""
        await self.executor.call(self.local.drop, session.id)
        await asyncio.gather(*(self.transport.close_session(h, session.id) for h in session.hops))
