"""The entry node's pipeline: token ids in, next-token logits out, through every hop.

The entry node runs its own span (layers `[0, k)`) in this process, then sends the activations
through the remote hops of the session's route in order. Over the wire a prompt goes as chunks
of at most `chunk_tokens` tokens (ADR-0008): each chunk passes every remote hop before the next
chunk starts, and every hop appends it to the session's cache. The session remembers every
token id it fed, so any hop's cache can be rebuilt by replaying them.

A prompt that starts with tokens a kept (or pending) prefix holds forks from it on every hop
and prefills only the rest (ADR-0058, `entry/prefixes.py`); a request that ends well keeps
its session as such a prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol, TypeVar

import torch

from meshnet.config import EntryConfig, WireConfig
from meshnet.entry import prefill
from meshnet.entry.executor import Executor
from meshnet.entry.failover import through
from meshnet.entry.hops import AnswerCheck, Hops
from meshnet.entry.prefixes import BLOCK_TOKENS, Found, PrefixIndex
from meshnet.entry.routes import RouteSource
from meshnet.entry.session import PipelineSession, cut
from meshnet.entry.transport import Transport
from meshnet.errors import SessionError
from meshnet.node.runner import Frame, ShardRunner
from meshnet.node.scheduler import Failed
from meshnet.observe.metrics import Metrics
from meshnet.security.ownership import PROCESS_KEYS, SessionKeys
from meshnet.types import Hop, ModelId, NodeId
from meshnet.wire import split_prefill
from meshnet.wire.tensors import as_tensor

log = logging.getLogger(__name__)
T = TypeVar("T")
# logits [V] of the last token -> what a request makes of them (a token); a pick fed with
# `rows` > 1 (verifying drafts, ADR-0038) gets the last `rows` tokens' logits [rows, V]
Pick = Callable[[torch.Tensor], T]
# (session, token ids, pick: only when the entry's span is the last one, first id's position,
# rows the pick gets)
LocalStep = tuple["PipelineSession", list[int], "Pick[Any] | None", int, int]


class HeadLike(Protocol):
    def embed_tokens(self, ids: torch.Tensor, position: int) -> torch.Tensor:
        """Token ids [1, T] at `position` -> hidden states [1, T, H]."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [B, T, H] -> float32 logits [B, T, V]."""
        ...


def tail(logits: torch.Tensor, rows: int) -> torch.Tensor:
    """What a pick of `rows` rows gets of logits [rows, V]: one row as [V]."""
    return logits[-1] if rows == 1 else logits


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
        config: EntryConfig = EntryConfig(),
        *,
        metrics: Metrics | None = None,
        spot_checker: AnswerCheck | None = None,
        local_chunk_tokens: int = 2048,
        keys: SessionKeys = PROCESS_KEYS,
    ) -> None:
        """`config`: the entry's settings (retries, step wait, replay bytes, push, pipelined
        prefill); its spot-check rate and bans come as `spot_checker` (seeded by the caller)."""
        if local.span.start != 0:
            raise ValueError(f"an entry node serves layers from 0, not {local.span}")
        self.model = model
        self.keys = keys  # its session ids name keys only this process holds (ADR-0049)
        self.num_layers = num_layers
        self.head = head
        self.local = local
        self.executor = executor
        self.metrics = metrics or Metrics()
        # the remote hops: routes, frames, replays, reports; spot checks see their answers
        self.hops = Hops(
            model, local.span.end, routes, transport, wire, config,
            checker=spot_checker, metrics=self.metrics, keys=keys,
        )  # fmt: skip
        self.wire = wire
        self.local_chunk_tokens = local_chunk_tokens
        # a prompt of several chunks overlaps across the hops (ADR-0036); the entry's span
        # runs it in pieces of this many tokens, each sent on as soon as it is done
        self.pipelined_prefill = config.pipelined_prefill
        self.prefill_piece_tokens = config.prefill_piece_tokens
        self.step_wait_s = config.step_wait_s  # see `EntryConfig.step_wait_s`
        self.entry_hop = Hop(NodeId(entry_id), "local", local.span)  # this node's own span
        self.prefix_sharing = config.prefix_sharing  # who shares kept prefixes (ADR-0058)
        self.prefixes = PrefixIndex(config.prefix_max_sessions, config.prefix_max_bytes)
        self.prefix_wait_s = config.hop_timeout_s  # for a pending prompt's prefill, at most

    async def open(self, prompt: Sequence[int] = (), scope: str | None = None) -> PipelineSession:
        """A new session with a route for the layers after the entry's span; the entry's own
        span counts against its process's session limit like any hop's. With a `scope`, a
        fork of the kept or pending prefix of `prompt` in it, when there is one."""
        found = await self._prefix(prompt, scope)
        if found is not None:
            return self._reuse(*found)
        session = self.keys.new_id()
        self.executor.admit_session(session)
        start = self.local.span.end
        try:
            hops = await self.hops.fresh_route() if start < self.num_layers else []
        except BaseException:
            self.executor.admitted(session)
            raise
        return PipelineSession(session, hops, degraded=self.hops.routes.degraded)

    async def _prefix(self, prompt: Sequence[int], scope: str | None) -> Found | None:
        """The session to fork `prompt`'s prefix from, and its length: a kept one, or a
        pending one sharing more (waited for)."""
        if scope is None or len(prompt) <= BLOCK_TOKENS:
            return None
        found = self.prefixes.match(prompt, scope, self._usable)
        waiting = self.prefixes.waiting(prompt, scope, found[1] if found else 0)
        if waiting is None:
            return found
        pending, tokens = waiting
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(pending.done.wait(), self.prefix_wait_s)
        if pending.ok and self._usable(pending.session.hops):
            return pending.session, min(tokens, pending.session.position)
        return self.prefixes.match(prompt, scope, self._usable)

    def _usable(self, hops: list[Hop]) -> bool:
        """A route to reuse: none of its hops banned or slow (as `Hops.fresh_route` avoids)."""
        avoid = self.hops.bans.active() | self.hops.latencies.slow()
        return not any(hop.node_id in avoid for hop in hops)

    def _reuse(self, source: PipelineSession, tokens: int) -> PipelineSession:
        """A session forking `source`'s first `tokens` tokens on its route (its replay inputs
        shared up to there): its first frames make every cache a copy."""
        child = self.keys.child_id(source.id)
        self.executor.admit_session(child)
        session = PipelineSession(
            child, list(source.hops), list(source.history[:tokens]), tokens,
            cut(source.inputs, tokens), replayable=source.replayable, forking=source.id,
            degraded=source.degraded, reused_from=source.id, reused=tokens,
        )  # fmt: skip
        session.recount()
        return session

    async def prefill(
        self, session: PipelineSession, prompt: Sequence[int], pick: Pick[T], scope: str | None
    ) -> T:
        """`feed` of the prompt past what the session reused; requests in `scope` sharing it
        may wait for it meanwhile. A fork whose prefix is gone somewhere starts again fresh."""
        pending = self.prefixes.announce(session, prompt, scope) if scope is not None else None
        ok = False
        try:
            try:
                picked = await self.feed(session, list(prompt[session.position :]), pick)
            except SessionError as exc:  # the local cache's miss, or a hop's (PrefixMissError)
                if not session.reused or session.forking is None:
                    raise
                log.info("session %s: %s; prefilling the whole prompt", session.id, exc.message)
                await self._restart(session)
                picked = await self.feed(session, list(prompt), pick)
            ok = True
            return picked
        finally:
            if pending is not None:
                self.prefixes.settle(pending, ok)

    async def _restart(self, session: PipelineSession) -> None:
        """`session` (a fork whose prefix is gone on some hop) dropped everywhere and made a
        fresh session in place; the prefix is dropped too."""
        await self.close(session)
        gone = self.prefixes.remove(session.reused_from) if session.reused_from else None
        if gone is not None:
            await self.close(gone)
        session.become(await self.open())

    def fork(self, parent: PipelineSession) -> PipelineSession:
        """A new session continuing `parent`'s tokens (fed, none pending): its first frame
        makes every cache, the entry's own included, a copy of `parent`'s (ADR-0045). Counts
        against the session limit like `open`."""
        child = self.keys.child_id(parent.id)
        self.executor.admit_session(child)
        return parent.fork(child)

    async def feed(
        self, session: PipelineSession, ids: list[int], pick: Pick[T], rows: int = 1
    ) -> T:
        """Run `ids` after the session's tokens; `pick` (a sampler) of the float32 logits [V]
        for the next token (with `rows` > 1: of the last `rows` tokens, [rows, V]), run on
        the compute thread with them.

        The entry's own work is one compute-thread job (embeddings and its span, plus the
        logits and `pick` when there is no remote hop); decode steps of all sessions in flight
        join one batch there, and so do their logits after the last hop. One job a token per
        session keeps the sessions in step, so each round batches them all. A prompt of
        several wire chunks is pipelined over the route instead (`entry/prefill.py`).
        """
        pipelined = bool(session.hops) and self.pipelined_prefill
        pipelined = pipelined and len(ids) > self.wire.chunk_tokens  # a prompt of many chunks
        new = session.position == 0 or session.forking is not None
        out: Any  # hidden [1, T, H], or what `pick` made of the logits
        try:
            if pipelined:  # the entry's span and the hops at once (ADR-0036)
                out = await prefill.pipelined(
                    self.hops, self.local_pass, self.prefill_piece_tokens, session, ids
                )
            else:  # the entry's span, with the logits when it is the last one
                out = await self.local_pass(
                    session, ids, session.position, None if session.hops else pick, rows
                )
        finally:
            if new:  # the first call: its cache holds its place from now
                self.executor.admitted(session.id)
        if not session.hops:
            self._fed(session, ids)
            return out  # type: ignore[no-any-return]
        if not pipelined:
            for chunk in split_prefill(out, session.position, self.wire.chunk_tokens):
                out = await through(self.hops, session, chunk)
        return await self._after(session, ids, out, pick, rows)

    async def local_pass(
        self,
        session: PipelineSession,
        ids: list[int],
        position: int,
        pick: Pick[T] | None = None,
        rows: int = 1,
    ) -> Any:
        """The entry's own span over `ids` at `position`, as one compute-thread job with the
        other sessions' (`_run_local_many`): hidden [1, T, H], or with `pick` what it makes
        of the next token's logits."""
        key = ("local", id(self))  # every session's step and prompt may share a pass
        item = (session, ids, pick, position, rows)
        return await self.executor.submit(
            key, self._run_local_many, item, len(ids), session.id, self.step_wait_s
        )

    async def _after(
        self, session: PipelineSession, ids: list[int], out: torch.Tensor, pick: Pick[T], rows: int
    ) -> T:
        """`pick` of the logits of the last hop's output `out` [1, T, H]; the feed is done."""
        picked = await self.executor.submit(
            ("logits", id(self)), self._logits_many, (out, pick, rows), 1, session.id, 0.01
        )
        self._fed(session, ids)
        return picked  # type: ignore[no-any-return]

    def _fed(self, session: PipelineSession, ids: list[int]) -> None:
        session.position += len(ids)
        session.history.extend(ids)
        session.fresh.clear()  # replacements take part in the next chunk sequence from its start
        session.rewinding = False  # every cache dropped the rejected drafts with these frames
        session.forking = None  # and every cache is a fork now

    def _run_local_many(self, items: list[LocalStep]) -> list[Any]:
        """Compute thread: `_run_local` for each item, many sessions in one pass: the
        entry's span over all their tokens (decode steps and prompts), one head product
        for their logits. A prompt longer than `local_chunk_tokens` runs on its own."""
        outs: list[Any] = [None] * len(items)
        packed = [i for i, item in enumerate(items) if len(item[1]) <= self.local_chunk_tokens]
        if len(packed) < 2:
            packed = []
        for i, (session, ids, pick, position, rows) in enumerate(items):
            if i not in packed:
                try:
                    outs[i] = self._run_local(session, torch.tensor([ids]), pick, position, rows)
                except Exception as exc:  # that session's request fails, not the others'
                    outs[i] = Failed(exc)
        frames = [self._frame(items[i][0], items[i][1], items[i][3]) for i in packed]
        for i, out in zip(packed, self.local.forward_many(frames), strict=True):
            outs[i] = out
        wanted = [i for i in packed if items[i][2] is not None and not isinstance(outs[i], Failed)]
        if wanted:
            picked = self._logits_many([(outs[i], items[i][2], items[i][4]) for i in wanted])  # type: ignore[misc]
            for i, result in zip(wanted, picked, strict=True):
                outs[i] = result
        return outs

    def _frame(self, session: PipelineSession, ids: list[int], position: int) -> Frame:
        """The entry's own frame for `ids` at `position`: [1, T, H] embedded."""
        meta = self.hops.meta_for(session, self.local.span, position)
        return meta, self.head.embed_tokens(torch.tensor([ids]), position)

    def _run_local(
        self,
        session: PipelineSession,
        tokens: torch.Tensor,
        pick: Pick[Any] | None,
        at: int,
        rows: int = 1,
    ) -> Any:
        """Compute thread: embeddings and the entry's own span -> hidden [1, T, H], or, with
        `pick`, what it makes of the last token's logits [V]. The span runs in pieces of
        `local_chunk_tokens`: no wire, so no 128-token limit; chunks of 128 cost ~1.3x one
        pass on a CPU (masked attention, small GEMMs), and the bound keeps a long prompt's
        attention memory in check.
        """
        hidden = self.head.embed_tokens(tokens, at)
        outputs = []
        for piece in split_prefill(hidden, at, self.local_chunk_tokens):
            rewind = session.rewinding and piece.position == at  # the first piece drops drafts
            meta = replace(
                self.hops.meta_for(
                    session, self.local.span, piece.position, piece.index, piece.total
                ),
                rewind=rewind,
            )
            outputs.append(as_tensor(self.local.forward(meta, piece.hidden)))
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        return out if pick is None else pick(tail(self.head.logits(out[:, -rows:])[0], rows))

    def _logits_many(self, items: list[tuple[torch.Tensor, Pick[Any], int]]) -> list[Any]:
        """Compute thread: for each (hidden [1, T, H], pick, rows), `pick` of the float32
        logits of its last `rows` tokens ([V] for one); one head product for all of them,
        each pick failing alone."""
        last = torch.cat([hidden[0, -rows:] for hidden, _, rows in items])  # [sum rows, H]
        logits = self.head.logits(last[None])[0]  # [sum rows, V]
        results: list[Any] = []
        parts = torch.split(logits, [rows for *_, rows in items])
        for part, (_, pick, rows) in zip(parts, items, strict=True):
            try:
                results.append(pick(tail(part, rows)))
            except Exception as exc:  # one request's sampler: its failure is that request's
                results.append(Failed(exc))
        return results

    async def close(self, session: PipelineSession, keep: str | None = None) -> None:
        """Drop the session's cache here and on every hop (errors are logged, not raised);
        with a `keep` scope, keep it as a prefix of that scope instead (ADR-0058)."""
        scope = keep if session.position >= BLOCK_TOKENS else None  # a block, or not worth it
        kept = scope is not None
        self.executor.forget(session.id)
        self.executor.admitted(session.id)  # a session closed before its first call
        await self.executor.call(self.local.drop, session.id, kept)
        await asyncio.gather(*(self.hops.close(h, session.id, kept) for h in session.hops))
        if scope is None:
            return
        dropped = self.prefixes.add(session, scope)
        source = self.prefixes.kept.get(session.reused_from) if session.reused_from else None
        if source is not None and session.reused >= source[0].position:  # all in this one now
            dropped.append(source[0])
            self.prefixes.remove(source[0].id)
        for gone in dropped:
            await self.close(gone)
