"""Pipelined prefill (ADR-0036): a prompt's chunks overlap across the hops of its route.

Sent one chunk at a time through every hop, a prompt of n chunks over s stages (the entry's
own span and each remote hop) costs n x s chunk times, and every stage but one idles. Here
each stage is a worker with a queue: the entry's span runs the prompt in pieces of
`prefill_piece_tokens` and queues each piece's wire chunks; each remote hop's worker takes chunks in
order, forwards them (relayed by the entry: `Hops.send`), records
what its hop was sent, and queues the output for the next hop. So chunk i+1 is in hop 1 while
chunk i is in hop 2, and a prompt costs about (n + s - 1) chunk times.

Per hop the chunks stay in order, so each hop's cache and the entry's replay inputs end up
exactly as the sequential path leaves them. A failure anywhere stops the remote workers, takes
the session's records back to where this feed began, moves the session to a new route
replayed from that point (`failover.reroute`), and sends the feed again one chunk at a time:
failures are rare, and a first prompt has nothing to replay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

import torch

from meshnet.entry.failover import reroute, through
from meshnet.entry.hops import Hops
from meshnet.entry.session import PipelineSession
from meshnet.errors import HopError
from meshnet.wire import split_prefill
from meshnet.wire.tensors import TensorChunk

log = logging.getLogger(__name__)
Queue = asyncio.Queue[TensorChunk | None]  # None: no more chunks
# the entry's own span: (session, ids, position) -> hidden [1, T, H] (`Pipeline.local_pass`)
LocalPass = Callable[[PipelineSession, list[int], int], Awaitable[torch.Tensor]]


async def pipelined(
    hops: Hops, local: LocalPass, piece_tokens: int, session: PipelineSession, ids: list[int]
) -> torch.Tensor:
    """Prefill `ids` after the session's tokens through the entry's span (`local`, in pieces
    of `piece_tokens`) and every remote hop; the last hop's output for the last chunk,
    [1, tokens, H]."""
    before = [len(pieces) for pieces in session.inputs]  # records as this feed found them
    queues: list[Queue] = [asyncio.Queue() for _ in range(len(session.hops) + 1)]
    chunks: list[TensorChunk] = []  # the entry's outputs, kept for the sequential retry
    size = hops.wire.chunk_tokens
    first = asyncio.ensure_future(
        _local(local, piece_tokens, size, session, ids, queues[0], chunks)
    )
    stages = [
        asyncio.ensure_future(_stage(hops, session, k, queues[k], queues[k + 1]))
        for k in range(len(session.hops))
    ]
    try:
        await asyncio.gather(first, *stages)
    except HopError as exc:
        for task in stages:
            task.cancel()
        await asyncio.gather(*stages, return_exceptions=True)
        await first  # the entry's cache must hold the whole feed: let its span finish
        return await _again(hops, session, chunks, before, exc)
    except BaseException:
        for task in (first, *stages):
            task.cancel()
        raise
    last: TensorChunk | None = None
    while (chunk := queues[-1].get_nowait()) is not None:
        last = chunk
    if last is None:
        raise ValueError("a pipelined prefill of no tokens")
    if hops.push and len(session.hops) > 1:  # a pushed session keeps the first hop's
        session.inputs[1:] = [[] for _ in session.hops[1:]]  # inputs only (ADR-0034)
        session.recount()
    return last.hidden


async def _local(
    local: LocalPass,
    step: int,
    size: int,
    session: PipelineSession,
    ids: list[int],
    out: Queue,
    kept: list[TensorChunk],
) -> None:
    """The entry's span over `ids` in pieces of `step` tokens, each piece's wire chunks (of
    `size` tokens) queued for the first hop as soon as it is done (one compute-thread job a
    piece, so other sessions' decode steps run between pieces)."""
    total = -(-len(ids) // size)  # chunks in the whole feed: the wire numbers them 0..total-1
    try:
        for start in range(0, len(ids), step):
            position = session.position + start
            hidden = await local(session, ids[start : start + step], position)
            for chunk in split_prefill(hidden, position, size):
                chunk = replace(chunk, index=start // size + chunk.index, total=total)
                kept.append(chunk)
                out.put_nowait(chunk)
    finally:
        out.put_nowait(None)


async def _stage(hops: Hops, session: PipelineSession, k: int, inbox: Queue, outbox: Queue) -> None:
    """Remote hop `k`: every chunk from `inbox`, in order, through it into `outbox`."""
    try:
        while (chunk := await inbox.get()) is not None:
            out = await hops.send(session, k, chunk, chunk.hidden)
            outbox.put_nowait(replace(chunk, hidden=out))
    finally:
        outbox.put_nowait(None)


async def _again(
    hops: Hops,
    session: PipelineSession,
    chunks: list[TensorChunk],
    before: list[int],
    error: HopError,
) -> torch.Tensor:
    """After `error` stopped a pipelined feed: records back to `before`, the session on a new
    route replayed up to this feed, then the feed's `chunks` one at a time."""
    log.info("session %s: pipelined prefill stopped (%s); sending it again", session.id, error)
    session.inputs = [pieces[:n] for pieces, n in zip(session.inputs, before, strict=True)]
    session.recount()
    await reroute(hops, session, error)
    hops.metrics.failovers.inc()
    hidden = chunks[0].hidden
    for chunk in chunks:
        hidden = await through(hops, session, chunk)
    return hidden
