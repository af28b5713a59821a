"""Per-hop latency as this entry sees it, and which hops are slow enough to route around.

A node's own figures (start-up throughput, the step time its heartbeats report) are its
word; the entry times every decode frame it sends (one token, so frames compare) and keeps
an exponential moving average per node and span. A node is slow when its average is over
`factor` times the median of the other nodes it measured for the same span, with enough
samples on both sides; new sessions are routed without slow nodes, as long as a route
without them exists.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from meshnet.types import Hop, LayerSpan, NodeId

ALPHA = 0.2  # weight of the newest sample in the moving average


@dataclass
class Seen:
    mean_s: float  # moving average of seconds per decode frame
    samples: int


def slow_nodes(
    seen: Mapping[tuple[NodeId, LayerSpan], Seen],
    factor: float = 4.0,
    min_samples: int = 8,
    floor_s: float = 0.02,
) -> frozenset[NodeId]:
    """Nodes whose decode frames take over `factor` x the median of their span's other
    measured nodes (and over `floor_s`: loopback jitter is not slowness). Pure."""
    by_span: dict[LayerSpan, list[tuple[NodeId, Seen]]] = {}
    for (node, span), mine in seen.items():
        by_span.setdefault(span, []).append((node, mine))
    slow = set()
    for nodes in by_span.values():  # grouped first: linear in the nodes measured
        enough = [(n, s) for n, s in nodes if s.samples >= min_samples]
        for node, mine in enough:
            others = [s.mean_s for n, s in enough if n != node]
            if others and mine.mean_s > max(floor_s, factor * statistics.median(others)):
                slow.add(node)
    return frozenset(slow)


@dataclass
class HopLatencies:
    """What this entry measured of each hop's decode frames."""

    factor: float = 4.0
    seen: dict[tuple[NodeId, LayerSpan], Seen] = field(default_factory=dict)

    def record(self, hop: Hop, seconds: float) -> None:
        key = (hop.node_id, hop.span)
        old = self.seen.get(key)
        if old is None:
            self.seen[key] = Seen(seconds, 1)
        else:
            self.seen[key] = Seen(old.mean_s + ALPHA * (seconds - old.mean_s), old.samples + 1)
        if len(self.seen) > 10_000:  # a long-lived entry in a churning mesh: keep the newest
            self.seen = dict(list(self.seen.items())[-5_000:])

    def slow(self) -> frozenset[NodeId]:
        return slow_nodes(self.seen, self.factor)
