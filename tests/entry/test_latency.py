"""Per-hop latency: which hops count as slow, and new sessions routed around them."""

from __future__ import annotations

import asyncio

import pytest

from meshnet.entry.latency import HopLatencies, Seen, slow_nodes
from meshnet.types import Hop, LayerSpan, NodeId
from tests.conftest import run
from tests.entry.fakes import fake_mesh
from tests.entry.test_failover import PARAMS, PROMPT
from tests.entry.test_generation import collect

A, B = LayerSpan(2, 4), LayerSpan(4, 6)


def seen(**nodes: tuple[LayerSpan, float, int]) -> dict[tuple[NodeId, LayerSpan], Seen]:
    return {(NodeId(n), span): Seen(s, k) for n, (span, s, k) in nodes.items()}


@pytest.mark.parametrize(
    ("measured", "slow"),
    [
        (seen(a=(A, 0.2, 10), a2=(A, 0.01, 10)), {"a"}),  # 20x its peer
        (seen(a=(A, 0.03, 10), a2=(A, 0.01, 10)), set()),  # 3x: within the factor
        (seen(a=(A, 0.2, 5), a2=(A, 0.01, 10)), set()),  # too few samples of it
        (seen(a=(A, 0.2, 10), a2=(A, 0.01, 3)), set()),  # ...or of its peer
        (seen(a=(A, 0.2, 10), b=(B, 0.01, 10)), set()),  # other spans do not compare
        (seen(a=(A, 0.015, 10), a2=(A, 0.001, 10)), set()),  # under the floor: jitter
        (seen(a=(A, 0.2, 10), a2=(A, 0.01, 10), a3=(A, 0.012, 10)), {"a"}),
    ],
)
def test_a_node_is_slow_against_its_spans_other_nodes(
    measured: dict[tuple[NodeId, LayerSpan], Seen], slow: set[str]
) -> None:
    assert slow_nodes(measured) == slow


def test_the_moving_average_follows_the_samples() -> None:
    latencies = HopLatencies()
    hop = Hop(NodeId("a"), "a", A)
    for _ in range(30):
        latencies.record(hop, 0.1)
    assert latencies.seen[("a", A)].mean_s == pytest.approx(0.1)
    latencies.record(hop, 1.1)
    assert latencies.seen[("a", A)].mean_s == pytest.approx(0.3)


def slowed(transport: object, address: str, delay_s: float) -> None:
    """Make every frame to `address` take `delay_s` longer."""
    forward = transport.forward  # type: ignore[attr-defined]

    async def late(hop, meta, hidden):  # type: ignore[no-untyped-def]
        if hop.address == address:
            await asyncio.sleep(delay_s)
        return await forward(hop, meta, hidden)

    transport.forward = late  # type: ignore[attr-defined]


def test_new_sessions_avoid_a_hop_slower_than_its_copies() -> None:
    generator, transport, _ = fake_mesh(chunk_tokens=16, replicas=True)
    slowed(transport, "a", 0.05)
    _, first = run(collect(generator, PROMPT, PARAMS))
    assert [h.node_id for h in first.route][1:] == ["node-a", "node-b"]
    latencies = generator.pipeline.hops.latencies
    assert latencies.seen[("node-a", A)].mean_s >= 0.05
    for _ in range(10):  # what earlier sessions through the other copy measured
        latencies.record(Hop(NodeId("node-a2"), "a2", A), 0.001)
    _, second = run(collect(generator, PROMPT, PARAMS))
    assert [h.node_id for h in second.route][1:] == ["node-a2", "node-b"]


def test_a_slow_hop_with_no_other_copy_still_serves() -> None:
    generator, transport, _ = fake_mesh(chunk_tokens=16, replicas=False)
    latencies = generator.pipeline.hops.latencies
    for _ in range(10):
        latencies.record(Hop(NodeId("node-a"), "a", A), 1.0)
        latencies.record(Hop(NodeId("node-x"), "x", A), 0.001)  # a copy gone since
    text, end = run(collect(generator, PROMPT, PARAMS))
    assert [h.node_id for h in end.route][1:] == ["node-a", "node-b"]
    assert text == ":;<=>?@ABCDEFGHIJKLM"  # the counting model after "...9"
