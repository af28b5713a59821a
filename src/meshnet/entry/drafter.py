"""Drafters: where an entry's draft tokens come from (ADR-0038).

`LookupDrafter` copies from the text so far (`text/drafts.py: lookup`): no model, no
state. `ModelDrafter` runs a small model that shares the target's tokenizer whole in this
process, greedily, one KV cache per session: each round it rewinds its cache to what the
text still shares with it, feeds the new tokens, and decodes k drafts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from meshnet.models.cache import new_cache, truncate
from meshnet.models.shard import Head, Shard
from meshnet.text.drafts import lookup
from meshnet.types import SessionId


class Drafter(Protocol):
    """Proposes draft tokens to follow a session's text."""

    runs_model: bool  # True: `propose` computes, and runs on the compute thread

    def propose(self, session: SessionId, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens likely to follow `tokens` (all of the session's text so far)."""
        ...

    def forget(self, session: SessionId) -> None:
        """The session has ended."""
        ...


class LookupDrafter:
    """Prompt lookup: what followed the latest earlier occurrence of the text's suffix."""

    runs_model = False

    def propose(self, session: SessionId, tokens: list[int], k: int) -> list[int]:
        return lookup(tokens, k)

    def forget(self, session: SessionId) -> None:
        pass


@dataclass
class _Seen:
    cache: Any = field(default_factory=new_cache)
    tokens: list[int] = field(default_factory=list)  # what the cache holds, in order


class ModelDrafter:
    """A whole small model (its `head` and a `shard` of all its layers), greedy."""

    runs_model = True

    def __init__(self, head: Head, shard: Shard, max_sessions: int = 64) -> None:
        self.head = head
        self.shard = shard
        self.max_sessions = max_sessions  # the oldest session's cache goes past this many
        self.sessions: dict[SessionId, _Seen] = {}
        self.lock = threading.Lock()  # `forget` comes from the event loop

    @torch.inference_mode()
    def propose(self, session: SessionId, tokens: list[int], k: int) -> list[int]:
        with self.lock:
            seen = self.sessions.pop(session, None) or _Seen()
            self.sessions[session] = seen
            while len(self.sessions) > self.max_sessions:
                del self.sessions[next(iter(self.sessions))]
        shared = _common_prefix(seen.tokens, tokens[:-1])  # the last token is fed anyway
        truncate(seen.cache, shared)
        seen.tokens = seen.tokens[:shared]
        drafts: list[int] = []
        fresh = tokens[shared:]
        for _ in range(k):
            token = self._next(seen, fresh)
            drafts.append(token)
            fresh = [token]
        return drafts  # the cache holds `tokens` and every draft but the last

    def _next(self, seen: _Seen, fresh: list[int]) -> int:
        """Feed `fresh` [T] after what `seen` holds; the argmax of the next token."""
        position = len(seen.tokens)
        hidden = self.head.embed_tokens(torch.tensor([fresh]), position)
        out = self.shard.forward(hidden, seen.cache, position)
        seen.tokens.extend(fresh)
        return int(self.head.logits(out[:, -1:])[0, -1].argmax())

    def forget(self, session: SessionId) -> None:
        with self.lock:
            self.sessions.pop(session, None)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
