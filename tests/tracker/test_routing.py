"""Route choice: fewest hops, then cost; replicas shared; clear errors."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from meshnet.errors import MissingLayersError, RouteError
from meshnet.tracker.routing import Server, choose_route, link_rtt_s
from meshnet.types import LayerSpan, ModelId, NodeId


def server(
    name: str,
    start: int,
    end: int,
    throughput: float = 1.0,
    sessions: int = 0,
    queue: int = 0,
    step_s: float = 0.0,
) -> Server:
    span = LayerSpan(start, end)
    return Server(NodeId(name), f"http://{name}", span, throughput, sessions, queue, step_s)


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
        # live load from heartbeats: a queue at the compute thread counts like sessions
        ([server("a", 0, 30, queue=4), server("b", 0, 30, sessions=2)], 0, ["b"]),
        # a measured step time replaces the start-up estimate: 2 sessions of 10 ms beat 1 of 40
        (
            [
                server("a", 0, 30, sessions=1, step_s=0.04),
                server("b", 0, 30, sessions=2, step_s=0.01),
            ],
            0,
            ["b"],
        ),
        # the same chain length: the loaded middle hop is avoided
        (
            [server("a", 0, 15, step_s=0.01, sessions=6), server("b", 0, 15, step_s=0.01)]
            + [server("c", 15, 30, step_s=0.01)],
            0,
            ["b", "c"],
        ),
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


def test_sessions_spread_over_replicas_as_their_load_is_reported() -> None:
    """Each route adds a session to the chosen copy (as its next heartbeat would report):
    three copies of one span, one twice as slow per round, end up holding load in
    proportion: the slow copy gets about half the sessions of each fast one."""
    steps = {"fast1": 0.01, "fast2": 0.01, "slow": 0.02}
    held = Counter({name: 0 for name in steps})
    for _ in range(50):
        copies = [server(n, 0, 30, sessions=held[n], step_s=s) for n, s in steps.items()]
        held[names(choose_route(ModelId("m"), 30, copies, 0, random.Random(0)))[0]] += 1
    assert 19 <= held["fast1"] <= 21 and 19 <= held["fast2"] <= 21 and 9 <= held["slow"] <= 11


def far(name: str, rtt_s: float, step_s: float, sessions: int = 0) -> Server:
    span = LayerSpan(0, 30)
    return Server(NodeId(name), f"http://{name}", span, 1.0, sessions, 0, step_s, rtt_s=rtt_s)


@pytest.mark.parametrize(
    ("copies", "expected"),
    [
        # a copy on the entry's LAN (1 ms) beats one twice as fast 50 ms away: 21 ms vs 60 ms
        ([far("near", 0.001, 0.020), far("fast", 0.050, 0.010)], "near"),
        # ...but not one five times slower: 101 ms vs 60 ms
        ([far("near", 0.001, 0.100), far("fast", 0.050, 0.010)], "fast"),
        # load counts against the near one too: 3 sessions of 20 ms each ahead of a new one
        ([far("near", 0.001, 0.020, sessions=3), far("fast", 0.050, 0.010)], "fast"),
        # no measurement (0): step time alone, as before
        ([far("near", 0.0, 0.020), far("fast", 0.0, 0.010)], "fast"),
    ],
)
def test_route_choice_counts_each_hops_round_trip_from_the_entry(
    copies: list[Server], expected: str
) -> None:
    assert names(choose_route(ModelId("m"), 30, copies, 0, random.Random(0))) == [expected]


@pytest.mark.parametrize(
    ("origin", "node", "expected_s"),
    [
        ({"b": 5.0}, {}, 0.005),  # the origin measured the node
        ({}, {"a": 7.0}, 0.007),  # the node measured the origin
        ({"b": 5.0}, {"a": 7.0}, 0.005),  # the origin's own measurement first
        ({"tracker": 2.0}, {"tracker": 30.0}, 0.032),  # no measurement: through the tracker
        ({"tracker": 2.0}, {}, 0.0),  # unknown
        ({}, {}, 0.0),
    ],
)
def test_link_round_trips_from_what_nodes_measured(
    origin: dict[str, float], node: dict[str, float], expected_s: float
) -> None:
    assert link_rtt_s("a", origin, "b", node) == pytest.approx(expected_s)
