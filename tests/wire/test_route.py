"""Push route headers (ADR-0034): parsed strictly, every problem a `WireError` naming the header."""

from __future__ import annotations

import pytest

from meshnet.errors import WireError
from meshnet.types import Hop, LayerSpan, NodeId
from meshnet.wire.route import (
    BUDGET,
    MAX_HOPS,
    REPLY_TO,
    ROUTE,
    PushRoute,
    Reply,
    budget_ms,
    parse_route,
)

HOPS = (
    Hop(NodeId("n-1"), "http://127.0.0.1:9001", LayerSpan(10, 20)),
    Hop(NodeId("n-2"), "https://[::1]:9002", LayerSpan(20, 30)),
)
ROUTE_ = PushRoute(HOPS, Reply(NodeId("n-0"), "http://10.0.0.1:8000"))


def lower(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def test_a_route_survives_its_headers() -> None:
    headers = lower(ROUTE_.headers("abc", 5000))
    assert parse_route(headers) == ROUTE_
    assert budget_ms(headers) == 5000
    assert headers[ROUTE.lower()] == "n-1 10:20 http://127.0.0.1:9001, n-2 20:30 https://[::1]:9002"


def test_a_frame_without_a_route_is_not_pushed() -> None:
    assert parse_route({}) is None


def test_each_hop_finds_the_next_and_the_last_finds_none() -> None:
    assert ROUTE_.after("n-1", LayerSpan(10, 20)) == HOPS[1]
    assert ROUTE_.after("n-2", LayerSpan(20, 30)) is None


@pytest.mark.parametrize(("node", "span"), [("n-3", LayerSpan(10, 20)), ("n-1", LayerSpan(20, 30))])
def test_a_node_off_the_route_is_refused(node: str, span: LayerSpan) -> None:
    with pytest.raises(WireError, match="not on the route"):
        ROUTE_.after(node, span)


GOOD_REPLY = "n-0 http://10.0.0.1:8000"


@pytest.mark.parametrize(
    ("route", "reply", "field"),
    [
        ("n-1 10:20", GOOD_REPLY, ROUTE),  # no address
        ("n-1 10:20 ftp://h:1", GOOD_REPLY, ROUTE),  # not http
        ("n-1 10:20 http://h:1/forward", GOOD_REPLY, ROUTE),  # a path: only /forward is posted
        ("n-1 10:20 http://user@h:1", GOOD_REPLY, ROUTE),
        ("n/1 10:20 http://h:1", GOOD_REPLY, ROUTE),  # bad node id
        ("n-1 20:10 http://h:1", GOOD_REPLY, ROUTE),  # bad span
        ("n-1 10:20 http://h:1, n-2 21:30 http://h:2", GOOD_REPLY, ROUTE),  # a gap
        (
            ", ".join([f"n-{i} {i}:{i + 1} http://h:1" for i in range(MAX_HOPS + 1)]),
            GOOD_REPLY,
            ROUTE,
        ),
        ("n-1 10:20 http://h:1", "n-0", REPLY_TO),
        ("n-1 10:20 http://h:1", "n-0 http://h:1 x", REPLY_TO),
        ("n-1 10:20 http://h:1", "n-0 javascript:alert(1)", REPLY_TO),
        ("x" * 9000, GOOD_REPLY, ROUTE),
    ],
)
def test_bad_routes_are_refused_naming_the_header(route: str, reply: str, field: str) -> None:
    with pytest.raises(WireError) as caught:
        parse_route({ROUTE.lower(): route, REPLY_TO.lower(): reply})
    assert caught.value.field == field


@pytest.mark.parametrize("value", ["", "0", "-5", "1.5", "99999999", "3600001", "x"])
def test_bad_budgets_are_refused(value: str) -> None:
    with pytest.raises(WireError) as caught:
        budget_ms({BUDGET.lower(): value})
    assert caught.value.field == BUDGET
