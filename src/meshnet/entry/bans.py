"""Nodes an entry keeps out of its routes for a while: the ones a spot check caught."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from meshnet.errors import HopError
from meshnet.types import Hop, NodeId


@dataclass
class Bans:
    """Nodes this entry keeps out of its routes, each until its time (monotonic s)."""

    ban_s: float
    clock: Callable[[], float] = time.monotonic
    until: dict[NodeId, float] = field(default_factory=dict)

    def ban(self, node: NodeId) -> None:
        self.until[node] = self.clock() + self.ban_s

    def has(self, node: NodeId) -> bool:
        """`node` is banned now (cheap: asked for every hop of every frame)."""
        return self.until.get(node, -1.0) > self.clock()

    def active(self) -> frozenset[NodeId]:
        now = self.clock()
        self.until = {n: t for n, t in self.until.items() if t > now}
        return frozenset(self.until)


def banned(hop: Hop) -> HopError:
    """Why a session leaves a hop a spot check banned (the check reported it already)."""
    error = HopError(f"hop {hop} failed a spot check", status=None, hop=hop)
    error.reported = True
    return error
