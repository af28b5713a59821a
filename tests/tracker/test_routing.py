"""Route choice: fewest hops, then cost; replicas shared; clear errors."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from meshnet.errors import MissingLayersError, RouteError
from meshnet.tracker.routing import Server, choose_route
from meshnet.types import LayerSpan, ModelId, NodeId


def server(name: str, start: int, end: int, throughput: float = 1.0, sessions: int = 0) -> Server:
    return Server(NodeId(name), f"http://{name}", LayerSpan(start, end), throughput, sessions)


def names(route: list[Server]) -> list[str]:
    return [s.node_id for s in route]


@pytest.mark.parametrize(
    ("servers", "start", "expected"),
    [
        (
            [server("a", 0, 10), server("b", 10, 30), server("c", 0, 30, throughput=0.1)],
            0,
            ["c"],
        ),  # one slow hop beats two fast ones: fewest hops first
        ([server("a", 0, 30, sessions=5), server("b", 0, 30, sessions=0)], 0, ["b"]),
        ([server("a", 0, 30, throughput=1.0), server("b", 0, 30, throughput=3.0)], 0, ["b"]),
        ([server("a", 0, 10), server("b", 10, 20), server("c", 20, 30)], 10, ["b", "c"]),
    ],
)
def test_route_choice(servers: list[Server], start: int, expected: list[str]) -> None:
    assert names(choose_route(ModelId("m"), 30, servers, start, random.Random(0))) == expected


def test_equal_replicas_share_the_sessions() -> None:
    servers = [server("a", 0, 30), server("b", 0, 30)]
    rng = random.Random(0)
    picks = Counter(names(choose_route(ModelId("m"), 30, servers, 0, rng))[0] for _ in range(200))
    assert min(picks.values()) > 60


def test_missing_layers_are_named() -> None:
    with pytest.raises(MissingLayersError, match="10:20") as info:
        choose_route(
            ModelId("m"), 30, [server("a", 0, 10), server("c", 20, 30)], 0, random.Random(0)
        )
    assert info.value.missing == [(10, 20)]


def test_covered_but_misaligned_spans_say_so() -> None:
    with pytest.raises(RouteError, match="no chain"):
        choose_route(
            ModelId("m"), 30, [server("a", 0, 10), server("b", 5, 30)], 0, random.Random(0)
        )
