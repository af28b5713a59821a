"""The prompt prefixes an entry can reuse (ADR-0058): which sessions hold which tokens on
which hops.

A finished session the entry ended with `keep` is a **kept prefix**: every hop of its route
(and the entry's own span) keeps its KV cache, and this index keeps its token ids, route and
replay inputs. A new request whose prompt starts with some of those tokens forks from it on
every hop and prefills only the rest. A prompt being prefilled right now is **pending**: a
request sharing a longer prefix with it waits for that prefill, then forks from the live
session, so eight users with one system prompt prefill it once.

Lookups go by a hash chain over blocks of `BLOCK_TOKENS` tokens (block i's hash covers every
token before its end), so a prompt finds the kept prefixes sharing its longest block prefix in
one walk; the match then extends token by token inside the next block, and every token is
compared before anything is reused (a hash never decides). Prefixes are shared within one
`scope` only: the client's (default), everyone's, or nobody's (`scope_of`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from meshnet.entry.session import PipelineSession
from meshnet.types import Hop, SessionId

log = logging.getLogger(__name__)
BLOCK_TOKENS = 64  # a prefix shorter than one block is not worth a fork
SHARING = ("client", "all", "off")  # who shares kept prefixes (`EntryConfig.prefix_sharing`)


def scope_of(sharing: str, client: str | None) -> str | None:
    """The scope a request's prefixes live in: its client's (an API key's name, or an
    address without keys), everyone's (""), or none (no reuse)."""
    if sharing == "off" or client is None:
        return None
    return "" if sharing == "all" else client


def chain(tokens: Sequence[int], block: int = BLOCK_TOKENS) -> list[int]:
    """One hash per full block of `tokens`, each covering every token before its end."""
    hashes, last = [], 0
    for start in range(0, len(tokens) - block + 1, block):
        last = hash((last, *tokens[start : start + block]))
        hashes.append(last)
    return hashes


def common_length(a: Sequence[int], b: Sequence[int], known: int = 0) -> int:
    """How many first items (tokens, chain hashes) `a` and `b` share (they are known to
    share `known`: checked)."""
    if list(a[:known]) != list(b[:known]):
        return 0
    n = known
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass
class Pending:
    """A prompt being prefilled: `done` is set once its session holds it (or failed to)."""

    session: PipelineSession
    prompt: tuple[int, ...]
    scope: str
    chain: list[int]
    done: asyncio.Event = field(default_factory=asyncio.Event)
    ok: bool = False


Usable = Callable[[list[Hop]], bool]  # whether a route is one to send a request along now
Found = tuple[PipelineSession, int]  # a session to fork from, and how many tokens to take


class PrefixIndex:
    """One entry's kept prefixes of one model (least recently used first) and its pending
    prompts."""

    def __init__(self, max_prefixes: int = 64, max_bytes: int = 256 << 20) -> None:
        """At most `max_prefixes` kept, holding `max_bytes` of replay inputs together."""
        self.max_prefixes = max_prefixes
        self.max_bytes = max_bytes
        self.kept: OrderedDict[SessionId, tuple[PipelineSession, str, list[int]]] = OrderedDict()
        self._by_block: dict[int, set[SessionId]] = {}
        self.pending: list[Pending] = []

    def match(self, prompt: Sequence[int], scope: str, usable: Usable) -> Found | None:
        """The kept prefix sharing the most of `prompt` (at least a block, at most all but
        its last token) on a usable route, with that length."""
        best: Found | None = None
        hashes = chain(prompt)
        for depth in range(len(hashes), 0, -1):  # the deepest shared block first
            for sid in self._by_block.get(hashes[depth - 1], ()):
                session, where, _ = self.kept[sid]
                if where != scope or not usable(session.hops):
                    continue
                n = common_length(session.history, prompt, depth * BLOCK_TOKENS)
                n = min(n, len(prompt) - 1)
                if n >= BLOCK_TOKENS and (best is None or n > best[1]):
                    best = session, n
            if best is not None:
                break
        if best is not None:
            self.kept.move_to_end(best[0].id)
        return best

    def waiting(
        self, prompt: Sequence[int], scope: str, longer_than: int
    ) -> tuple[Pending, int] | None:
        """The pending prompt sharing the most (more than `longer_than` tokens and at least
        a block) with `prompt`, with how many."""
        hashes = chain(prompt)
        best: tuple[Pending, int] | None = None
        for pending in self.pending:
            depth = common_length(pending.chain, hashes)
            if pending.scope != scope or depth == 0:
                continue
            n = min(common_length(pending.prompt, prompt, depth * BLOCK_TOKENS), len(prompt) - 1)
            if n > max(longer_than, BLOCK_TOKENS - 1) and (best is None or n > best[1]):
                best = pending, n
        return best

    def announce(self, session: PipelineSession, prompt: Sequence[int], scope: str) -> Pending:
        """`session` is prefilling `prompt`: requests sharing it may wait for it."""
        pending = Pending(session, tuple(prompt), scope, chain(prompt))
        self.pending.append(pending)
        return pending

    def settle(self, pending: Pending, ok: bool) -> None:
        """The pending prompt's prefill ended (`ok`: its session holds it)."""
        pending.ok = ok
        pending.done.set()
        self.pending.remove(pending)

    def add(self, session: PipelineSession, scope: str) -> list[PipelineSession]:
        """Keep `session` (ended with keep on every hop); the kept prefixes that no longer
        fit, to drop on their hops."""
        hashes = chain(session.history)
        self.kept[session.id] = (session, scope, hashes)
        for block in hashes:
            self._by_block.setdefault(block, set()).add(session.id)
        evicted = []
        while len(self.kept) > self.max_prefixes or (
            len(self.kept) > 1 and self.held_bytes() > self.max_bytes
        ):
            evicted.append(self.remove(next(iter(self.kept))))
        return [s for s in evicted if s is not None]

    def remove(self, sid: SessionId) -> PipelineSession | None:
        """Forget a kept prefix (gone on some hop, or evicted); it, if it was kept."""
        found = self.kept.pop(sid, None)
        if found is None:
            return None
        for block in found[2]:
            holders = self._by_block.get(block, set())
            holders.discard(sid)
            if not holders:
                self._by_block.pop(block, None)
        return found[0]

    def held_bytes(self) -> int:
        """Replay inputs the kept prefixes hold."""
        return sum(session.replay_bytes for session, _, _ in self.kept.values())
