"""Replacing a failed hop mid-generation, so the user sees a pause and nothing else.

`through` sends a chunk along a session's route (`Hops`), relayed or pushed. When a hop
fails (unreachable, timed out, 5xx, or its cache is gone), the entry node bans it
for the session, reports it to the tracker, asks for a chain covering exactly the failed span
without banned nodes, replays into that chain everything the failed hop had been sent (its
inputs, kept by the session), and puts the chain in its place. The caller then re-sends the
frame that failed. Attempts are bounded, with capped exponential backoff between them; when
no replacement exists the last error ends the request (503 naming the missing layers).

A hop at one of its limits (429: sessions, KV cache) is healthy: another copy takes the
session the same way, but the tracker is not told, and when no copy is left the client gets
the 429 (with its Retry-After) at once rather than a 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import torch

from meshnet.entry.hops import Hops
from meshnet.entry.session import PipelineSession
from meshnet.errors import HopError, MeshError, RouteError
from meshnet.types import Hop, NodeId
from meshnet.wire.tensors import TensorChunk

log = logging.getLogger(__name__)


async def through(hops: Hops, session: PipelineSession, chunk: TensorChunk) -> torch.Tensor:
    """One chunk through every remote hop of the session's route in order, relayed or
    pushed; the last hop's output. A hop that fails is replaced and the chunk goes again."""
    if hops.push and len(session.hops) > 1:
        return await _pushed(hops, session, chunk)
    hidden, k = chunk.hidden, 0
    while k < len(session.hops):
        try:
            out = await hops.send(session, k, chunk, hidden)
        except HopError as exc:  # whatever it was, another copy of the span may take it
            await failover(hops, session, k, exc)
            hops.metrics.failovers.inc()
            continue
        hidden, k = out, k + 1
    return hidden


async def _pushed(hops: Hops, session: PipelineSession, chunk: TensorChunk) -> torch.Tensor:
    """`chunk` pushed through the whole route (ADR-0034); a failed step moves the session to
    a new route, replayed from what the first hop was sent, and the chunk goes again."""
    while True:
        try:
            return await hops.push_through(session, chunk)
        except HopError as exc:
            await reroute(hops, session, exc)
            hops.metrics.failovers.inc()


async def failover(hops: Hops, session: PipelineSession, k: int, error: HopError) -> None:
    """Replace `session.hops[k]`, which just failed with `error`; raises when nothing can."""
    started, failed = time.perf_counter(), session.hops[k]
    if not session.replayable:  # nothing to rebuild a replacement's cache from
        raise unreplayable(hops, error, "another copy") from error

    async def replacement(exclude: frozenset[NodeId]) -> Replayed:
        span = failed.span
        chain = await hops.route(span.start, span.end, exclude)
        return chain, await _replay(hops, session, k, chain)

    chain, inputs = await _new_chain(hops, session, failed, error, replacement)
    session.hops[k : k + 1] = chain
    session.inputs[k : k + 1] = inputs
    session.recount()
    session.fresh.update(chain)
    pause = time.perf_counter() - started
    session.failover_pauses_s.append(pause)
    log.info("session %s: %s replaced by %s in %.3f s", session.id, failed, chain, pause)


Replayed = tuple[list[Hop], list[list[torch.Tensor]]]  # a chain, and what each hop was sent


async def _new_chain(
    hops: Hops,
    session: PipelineSession,
    failed: Hop,
    error: HopError,
    find: Callable[[frozenset[NodeId]], Awaitable[Replayed]],
) -> Replayed:
    """Ban `failed`, then `find` a chain without the banned nodes and replay into it, as
    often as the retry policy allows; a replacement that fails too is banned as well. When
    no copy is left because every copy is full, the busy error (429) goes to the client."""
    last: MeshError = error
    await _ban(hops, session, failed, error)
    for attempt in range(hops.retry.max_attempts):
        try:
            found = await find(frozenset(session.banned) | hops.bans.active())
            session.degraded |= hops.routes.degraded
            return found
        except HopError as exc:  # a replacement failed too: ban it as well, try again
            last = exc
            if exc.hop is not None:
                await _ban(hops, session, exc.hop, exc)
        except RouteError as exc:
            if isinstance(last, HopError) and last.busy:  # every copy is full: say so now
                raise last from exc
            last = exc
        if attempt + 1 < hops.retry.max_attempts:
            await asyncio.sleep(hops.retry.backoff_s(attempt))
    log.warning("session %s: no replacement for %s: %s", session.id, failed, last.message)
    raise last


def unreplayable(hops: Hops, error: HopError, where: str) -> HopError:
    """The error ending a session that kept no replay inputs: it cannot move to `where`."""
    return HopError(
        f"{error.message}; this session's inputs passed the entry's replay budget of "
        f"{hops.max_replay_bytes} bytes, so it cannot move to {where}",
        status=error.status,
        hop=error.hop,
    )


async def _ban(hops: Hops, session: PipelineSession, hop: Hop, error: HopError) -> None:
    """Leave `hop` out of this session; tell the tracker unless it was only busy (429) or
    no longer serves those layers (a stale route: it is healthy, and may serve others)."""
    session.banned.add(hop.node_id)
    if not error.busy and not error.stale and not error.reported:
        await hops.report(hop.node_id, str(error))
    # in case it is alive after all; in the background, so that a hung hop (which may take the
    # close call's whole timeout) does not lengthen the pause
    _close_later(hops, hop, session)


def _close_later(hops: Hops, hop: Hop, session: PipelineSession) -> None:
    closing = asyncio.ensure_future(hops.close(hop, session.id))
    _closing.add(closing)
    closing.add_done_callback(_closing.discard)


_closing: set[asyncio.Future[None]] = set()  # close calls in flight (a task needs a reference)


async def _replay(
    hops: Hops, session: PipelineSession, k: int, chain: list[Hop]
) -> list[list[torch.Tensor]]:
    """Send the failed hop's past inputs through `chain`; the inputs each new hop was sent."""
    pieces = session.inputs[k]
    hidden = torch.cat(pieces, dim=1) if pieces else None
    recorded: list[list[torch.Tensor]] = []
    for hop in chain:
        await hops.close(hop, session.id)  # start from an empty cache
        recorded.append([] if hidden is None else [hidden])
        if hidden is None:
            continue
        hidden = await hops.replay(hop, session.id, hidden)
    return recorded


async def reroute(hops: Hops, session: PipelineSession, error: HopError) -> None:
    """Move a session to a new route after `error` (a pushed step, ADR-0034, or a pipelined
    prefill, ADR-0036): ban the hop it names, ask for a route from the entry's span on, and
    replay into it what the first hop was sent (the entry's own outputs: all a pushed session
    keeps). Raises when nothing can."""
    started, failed = time.perf_counter(), error.hop or session.hops[0]
    if not session.replayable:
        raise unreplayable(hops, error, "another route") from error

    async def route(exclude: frozenset[NodeId]) -> Replayed:
        chain = await hops.route(hops.start, exclude=exclude)
        return chain, await _replay_route(hops, session, chain)

    chain, inputs = await _new_chain(hops, session, failed, error, route)
    for hop in set(session.hops) - set(chain):  # left behind: its cache goes too
        _close_later(hops, hop, session)
    session.hops, session.fresh = chain, set(chain)
    session.inputs = inputs
    session.recount()
    session.failover_pauses_s.append(time.perf_counter() - started)
    log.info("session %s: %s left; now on %s", session.id, failed, chain)


async def _replay_route(
    hops: Hops, session: PipelineSession, chain: list[Hop]
) -> list[list[torch.Tensor]]:
    """Empty `chain`'s caches of the session, then send them what its first hop was sent,
    pushed or (an entry that relays) relayed; the inputs each hop keeps for replay."""
    if not hops.push or len(chain) == 1:
        return await _replay(hops, session, 0, chain)
    await asyncio.gather(*(hops.close(h, session.id) for h in chain))
    if session.inputs[0]:
        await hops.replay_pushed(chain, session.id, torch.cat(session.inputs[0], dim=1))
    return [session.inputs[0], *([] for _ in chain[1:])]
