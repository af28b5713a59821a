"""Whom a node fetches a span's weights from: the members that serve the most of it, least
loaded first (ADR-0054). The tracker itself is the holder of last resort; the node adds it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from meshnet.tracker import messages as msg
from meshnet.types import LayerSpan

MAX_HOLDERS = 8
SCAN = 4 * MAX_HOLDERS  # candidates ranked at most: the first that serve some of the span


@dataclass(frozen=True)
class Candidate:
    """A live node and what it serves of one model."""

    node_id: str
    address: str
    spans: frozenset[LayerSpan]
    load: int  # sessions + queued jobs at its last heartbeat
    suspect: bool = False  # reported failing: asked last


def overlap(a: LayerSpan, b: LayerSpan) -> int:
    return max(0, min(a.end, b.end) - max(a.start, b.start))


def holders(span: LayerSpan, candidates: Iterable[Candidate]) -> list[msg.WeightHolder]:
    """The nodes serving layers of `span`, of the first `SCAN` that do: healthy first, then
    the most of the span, then least loaded, then by id; at most `MAX_HOLDERS`."""
    ranked = []
    for c in candidates:
        covered = max((overlap(span, s) for s in c.spans), default=0)
        if covered:
            ranked.append(((c.suspect, -covered, c.load, c.node_id), c))
            if len(ranked) == SCAN:  # `candidates` may be lazy: look no further
                break
    ranked.sort(key=lambda pair: pair[0])
    return [msg.WeightHolder(node_id=c.node_id, address=c.address) for _, c in ranked[:MAX_HOLDERS]]
