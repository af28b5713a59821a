"""`PipelineSession`: one generation's state at the entry node, what failover replays from."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from meshnet.types import Hop, NodeId, SessionId

log = logging.getLogger(__name__)


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
    replay_bytes: int = 0  # bytes held in `inputs`
    replayable: bool = True  # False once `inputs` outgrew the budget: no failover then
    rewinding: bool = False  # the caches hold rejected drafts: the next frames drop them
    # a fork not yet fed: its first frames tell every cache to start as a copy of this
    # session's (ADR-0045)
    forking: SessionId | None = None
    degraded: bool = False  # a route of it came from the members last seen (no tracker)
    # a fork of a kept or pending prompt prefix (ADR-0058): its id, and the tokens taken
    reused_from: SessionId | None = None
    reused: int = 0

    def __post_init__(self) -> None:
        self.inputs = self.inputs or [[] for _ in self.hops]

    def fork(self, child: SessionId) -> PipelineSession:
        """A session `child` that continues this one's tokens so far on the same route (its
        replay inputs shared: failover rebuilds it without the parent)."""
        return PipelineSession(
            child,
            list(self.hops),
            list(self.history),
            self.position,
            [list(pieces) for pieces in self.inputs],
            set(self.banned),
            replay_bytes=self.replay_bytes,
            replayable=self.replayable,
            forking=self.id,
        )

    def become(self, other: PipelineSession) -> None:
        """Take `other`'s place (a fork of a prefix that was gone somewhere starts again as a
        fresh session: the request keeps its object)."""
        vars(self).update(vars(other))

    def record(self, k: int, hidden: torch.Tensor, max_bytes: int) -> None:
        """Keep what hop `k` was sent, for replay, while the session stays within
        `max_bytes` of such inputs; past it, give them all up (review finding 9)."""
        if not self.replayable:
            return
        size = hidden.numel() * hidden.element_size()
        if self.replay_bytes + size > max_bytes:
            log.warning(
                "session %s: replay inputs pass %d bytes; no failover for it", self.id, max_bytes
            )
            self.replayable, self.replay_bytes = False, 0
            self.inputs = [[] for _ in self.hops]
            return
        self.inputs[k].append(hidden)
        self.replay_bytes += size

    def rewind(self, dropped: int) -> None:
        """Forget the last `dropped` tokens fed (rejected drafts, ADR-0038): the next frames
        tell every cache to drop them too."""
        if dropped <= 0:
            return
        self.position -= dropped
        del self.history[-dropped:]
        self.inputs = cut(self.inputs, self.position)  # what hop k was sent ends with them
        self.recount()
        self.rewinding = True

    def recount(self) -> None:
        """`replay_bytes` again from `inputs` (after a failover replaced some)."""
        self.replay_bytes = sum(t.numel() * t.element_size() for ts in self.inputs for t in ts)


def cut(inputs: list[list[torch.Tensor]], tokens: int) -> list[list[torch.Tensor]]:
    """Each hop's replay inputs ([1, T, H] pieces) up to their first `tokens` tokens."""
    kept = []
    for pieces in inputs:
        left, mine = tokens, []
        for piece in pieces:
            if left <= 0:
                break
            mine.append(piece if piece.shape[1] <= left else piece[:, :left])
            left -= piece.shape[1]
        kept.append(mine)
    return kept
