"""The tracker app in-process: registration, heartbeats, expiry, coverage, routes, refusals."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from meshnet.config import TrackerConfig
from meshnet.tracker.app import create_app
from meshnet.tracker.planner import ModelOffer
from meshnet.tracker.probe import ProbeError, TrustingProber
from meshnet.tracker.registry import SUSPECT_S, Registry
from meshnet.types import ModelId
from tests.tracker.members import Members

MB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def mesh() -> tuple[TestClient, Clock]:
    clock = Clock()
    offers = [ModelOffer(ModelId("m"), 30, {q: 10 * MB for q in ("fp32", "bf16", "int8", "nf4")})]
    registry = Registry(offers, {ModelId("m"): "m"}, dead_after_s=6.0, clock=clock)
    app = create_app(registry, TrackerConfig(route_seed=0), prober=TrustingProber())
    return Members(TestClient(app)), clock  # type: ignore[return-value]


def register(client: TestClient, node: str, budget_mb: int, **extra: Any) -> dict[str, Any]:
    body = {
        "node_id": node,
        "address": f"http://127.0.0.1:{9000 + len(node)}",
        "budget_bytes": budget_mb * MB,
        "quant": "fp32",
        "throughput": 1.0,
        **extra,
    }
    response = client.post("/v1/nodes/register", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def beat(client: TestClient, node: str, loaded: list[dict[str, Any]]) -> dict[str, Any]:
    response = client.post("/v1/nodes/heartbeat", json={"node_id": node, "loaded": loaded})
    result: dict[str, Any] = response.json()
    return result


def test_directives_then_loaded_spans_make_coverage_and_a_route(
    mesh: tuple[TestClient, Clock],
) -> None:
    client, _ = mesh
    shards = {}
    for node in ("a", "b", "c"):
        directives = register(client, node, 110)["directives"]
        assert [d["op"] for d in directives] == ["LOAD_SHARD"]
        shards[node] = {"model": "m", "span": directives[0]["span"]}
    coverage = client.get("/v1/coverage").json()["models"][0]
    assert coverage["gaps"] == [{"start": 0, "end": 30}] and not coverage["routable"]
    assert coverage["layers"][0]["loading"] == ["a"]
    assert client.get("/v1/route", params={"model": "m"}).status_code == 503
    for node, shard in shards.items():
        beat(client, node, [shard])
    coverage = client.get("/v1/coverage").json()["models"][0]
    assert coverage["gaps"] == [] and coverage["routable"]
    route = client.get("/v1/route", params={"model": "m"}).json()
    assert [h["span"] for h in route["hops"]] == [
        {"start": 0, "end": 11},
        {"start": 11, "end": 22},
        {"start": 22, "end": 30},
    ]
    partial = client.get("/v1/route", params={"model": "m", "start": 11}).json()
    assert [h["node_id"] for h in partial["hops"]] == ["b", "c"]


def test_a_silent_node_dies_and_its_layers_go_to_a_newcomer(mesh: tuple[TestClient, Clock]) -> None:
    client, clock = mesh
    for node in ("a", "b", "c"):  # 10 layers each: no room to spare
        span = register(client, node, 100)["directives"][0]["span"]
        beat(client, node, [{"model": "m", "span": span}])
    clock.now = 5.0
    beat(client, "a", [{"model": "m", "span": {"start": 0, "end": 10}}])
    beat(client, "c", [{"model": "m", "span": {"start": 20, "end": 30}}])
    clock.now = 7.0  # b last seen at 0
    error = client.get("/v1/route", params={"model": "m"})
    assert error.status_code == 503
    assert "10:20" in error.json()["error"]["message"]
    directives = register(client, "d", 300)["directives"]
    assert [(d["op"], d["span"]) for d in directives] == [("LOAD_SHARD", {"start": 10, "end": 20})]
    assert "closes gap 10:20" in directives[0]["reason"]


def test_unknown_node_heartbeat_asks_to_register_again(mesh: tuple[TestClient, Clock]) -> None:
    client, _ = mesh
    response = client.post("/v1/nodes/heartbeat", json={"node_id": "ghost"})
    assert response.status_code == 404
    assert "register again" in response.json()["error"]["message"]


def test_restarted_tracker_takes_loaded_spans_from_registration(
    mesh: tuple[TestClient, Clock],
) -> None:
    client, _ = mesh
    register(client, "a", 400, loaded=[{"model": "m", "span": {"start": 0, "end": 30}}])
    assert client.get("/v1/coverage").json()["models"][0]["routable"]


def test_leaving_replans_at_once(mesh: tuple[TestClient, Clock]) -> None:
    client, _ = mesh
    register(client, "a", 400, loaded=[{"model": "m", "span": {"start": 0, "end": 30}}])
    assert client.post("/v1/nodes/leave", json={"node_id": "a"}).json() == {"left": True}
    assert client.get("/v1/coverage").json()["models"][0]["gaps"] == [{"start": 0, "end": 30}]


@pytest.mark.parametrize(
    "body",
    [
        {
            "node_id": "../x",
            "address": "http://h:1",
            "budget_bytes": 1,
            "quant": "fp32",
            "throughput": 1,
        },
        {"node_id": "a", "address": "ftp://h", "budget_bytes": 1, "quant": "fp32", "throughput": 1},
        {
            "node_id": "a",
            "address": "http://h:1",
            "budget_bytes": 0,
            "quant": "fp32",
            "throughput": 1,
        },
        {
            "node_id": "a",
            "address": "http://h:1",
            "budget_bytes": 1,
            "quant": "fp8",
            "throughput": 1,
        },
        {
            "node_id": "a",
            "address": "http://h:1",
            "budget_bytes": 1,
            "quant": "fp32",
            "throughput": 1,
            "extra": 1,
        },
        {
            "node_id": "a",
            "address": "http://h:1",
            "budget_bytes": 1,
            "quant": "fp32",
            "throughput": 1,
            "loaded": [{"model": "m", "span": {"start": 0, "end": 31}}],
        },
        {
            "node_id": "a",
            "address": "http://h:1",
            "budget_bytes": 1,
            "quant": "fp32",
            "throughput": 1,
            "loaded": [{"model": "m", "span": {"start": 5, "end": 5}}],
        },
        {  # keeps an entry span, but may not be an entry
            "node_id": "a",
            "address": "http://h:1",
            "budget_bytes": 1,
            "quant": "fp32",
            "throughput": 1,
            "entry": False,
            "keeps_entry": True,
        },
    ],
)
def test_bad_registrations_are_refused_and_change_nothing(
    mesh: tuple[TestClient, Clock], body: dict[str, Any]
) -> None:
    client, _ = mesh
    response = client.post("/v1/nodes/register", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"]
    assert client.get("/health").json()["nodes"] == 0


def test_p5_spans_of_a_model_no_longer_offered_are_dropped_not_refused(
    mesh: tuple[TestClient, Clock],
) -> None:
    client, _ = mesh
    old = [{"model": "retired", "span": {"start": 0, "end": 4}}]
    answer = register(client, "a", 400, loaded=old)
    drops = [d for d in answer["directives"] if d["op"] == "DROP_SHARD"]
    assert [(d["model"], d["reason"]) for d in drops] == [
        ("retired", "model retired is no longer offered")
    ]
    # still reported while it drops: no second DROP; then gone from its report
    again = client.post("/v1/nodes/heartbeat", json={"node_id": "a", "loaded": old}).json()
    assert all(d["op"] != "DROP_SHARD" for d in again["directives"])
    client.post("/v1/nodes/heartbeat", json={"node_id": "a"})
    assert client.get("/v1/coverage").json()["nodes"][0]["loaded"] == []


def test_openapi_is_served(mesh: tuple[TestClient, Clock]) -> None:
    client, _ = mesh
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/nodes/register", "/v1/nodes/heartbeat", "/v1/coverage", "/v1/route"} <= set(paths)


def test_replacement_routes_for_one_span_excluding_banned_and_reported_nodes(
    mesh: tuple[TestClient, Clock],
) -> None:
    client, clock = mesh
    spans = {"a": (0, 15), "b": (15, 30), "c": (15, 30), "d": (15, 30)}
    tokens = {}
    for node, (start, end) in spans.items():
        shard = {"model": "m", "span": {"start": start, "end": end}}
        tokens[node] = register(client, node, 200, loaded=[shard])["token"]

    def replacement(**params: Any) -> list[str]:
        query = {"model": "m", "start": 15, "end": 30, **params}
        response = client.get("/v1/route", params=query)
        return [h["node_id"] for h in response.json()["hops"]] if response.is_success else []

    def report(reporter: str) -> object:
        body = {"node_id": "d", "reason": "reset", "reporter": reporter, "token": tokens[reporter]}
        return client.post("/v1/nodes/report", json=body).json()

    assert replacement() in (["b"], ["c"], ["d"])
    assert replacement(exclude="b,c") == ["d"]
    assert report("a") == {"reported": True}
    assert replacement(exclude="b,c", origin="a") == []  # out of its reporter's routes...
    assert replacement(exclude="b,c") == ["d"]  # ...but one member steers nobody else (N5)
    assert report("b") == {"reported": True}
    assert replacement(exclude="b,c") == []  # two members agree: out of every route a while
    missing = client.get(
        "/v1/route", params={"model": "m", "start": 15, "end": 30, "exclude": "b,c"}
    )
    assert missing.status_code == 503 and "15:30" in missing.json()["error"]["message"]
    held = [{"model": "m", "span": {"start": 15, "end": 30}}]
    beat(client, "d", held)  # a node failing frames may well go on beating: still out
    assert replacement(exclude="b,c") == []
    clock.now += SUSPECT_S
    beat(client, "d", held)
    assert replacement(exclude="b,c") == ["d"]
    bad = client.get("/v1/route", params={"model": "m", "start": 20, "end": 10})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "start"
    unknown = client.get("/v1/route", params={"model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


class RefusingProber:
    async def probe(self, node_id: str, address: str) -> None:
        raise ProbeError(f"{address} is not reachable", field="address")


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"models": ["not-offered"]}, "models"),
        ({"loaded": [{"model": "m", "span": {"start": 0, "end": 31}}]}, "span"),
        ({"node_id": "../etc"}, "node_id"),
        ({"throughput": float("inf")}, "throughput"),
        ({"kv_reserve_bytes": 200 * MB}, None),
    ],
)
def test_registrations_naming_what_the_tracker_does_not_offer_are_refused(
    mesh: tuple[TestClient, Clock], extra: dict[str, Any], field: str | None
) -> None:
    client, _ = mesh
    body = {"node_id": "a", "address": "http://127.0.0.1:9", "budget_bytes": 100 * MB}
    body |= {"quant": "fp32", "throughput": 1.0, **extra}
    response = client.post(
        "/v1/nodes/register",
        content=json.dumps(body),  # allows the non-standard Infinity literal through
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["field"] == field
    assert client.get("/v1/coverage").json()["nodes"] == []


def test_a_node_failing_the_probe_is_not_counted() -> None:
    offers = [ModelOffer(ModelId("m"), 30, {q: 10 * MB for q in ("fp32", "bf16", "int8", "nf4")})]
    registry = Registry(offers, {ModelId("m"): "m"}, dead_after_s=6.0, clock=Clock())
    client = TestClient(create_app(registry, TrackerConfig(), prober=RefusingProber()))
    body = {"node_id": "a", "address": "http://10.0.0.1:9", "budget_bytes": 100 * MB}
    response = client.post("/v1/nodes/register", json=body | {"quant": "fp32", "throughput": 1})
    assert response.status_code == 400 and response.json()["error"]["field"] == "address"
    assert registry.nodes == {}


def test_route_exclusions_must_be_node_ids(mesh: tuple[TestClient, Clock]) -> None:
    client, _ = mesh
    response = client.get("/v1/route", params={"model": "m", "exclude": "a,b/../c"})
    assert response.status_code == 400 and response.json()["error"]["field"] == "exclude"


def test_entries_lists_live_entry_nodes_of_a_model_least_loaded_first(
    mesh: tuple[TestClient, Clock],
) -> None:
    client, clock = mesh
    head = [{"model": "m", "span": {"start": 0, "end": 10}}]
    pinned = {"loaded": head, "keeps_entry": True}  # entries started by hand: never re-planned
    register(client, "e1", 100, **pinned)
    register(client, "plain", 100, loaded=head, entry=False)  # `--no-entry`: runs no head
    clock.now = 10.0  # e1 goes late (interval 2 s)
    register(client, "e2", 100, **pinned)
    register(client, "e3", 100, **pinned)
    client.post("/v1/nodes/heartbeat", json={"node_id": "e2", "loaded": head, "sessions": 3})
    client.post("/v1/nodes/heartbeat", json={"node_id": "e3", "loaded": head, "sessions": 1})
    answer = client.get("/v1/entries", params={"model": "m"})
    assert answer.status_code == 200
    listed = [(e["node_id"], e["span"], e["sessions"]) for e in answer.json()["entries"]]
    assert listed == [("e3", {"start": 0, "end": 10}, 1), ("e2", {"start": 0, "end": 10}, 3)]
    unknown = client.get("/v1/entries", params={"model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


def test_routes_for_an_entry_prefer_the_copy_it_measured_nearer(
    mesh: tuple[TestClient, Clock],
) -> None:
    """Two copies of 15:30, equally fast: the entry `a` measured `far` 80 ms away and `near`
    2 ms away (heartbeats' `rtt_ms`); routes asked with `origin=a` take `near` every time,
    routes without an origin still spread over both."""
    client, _ = mesh
    spans = {"a": (0, 15), "near": (15, 30), "far": (15, 30)}
    for node, (start, end) in spans.items():
        register(client, node, 200, loaded=[{"model": "m", "span": {"start": start, "end": end}}])
    held = [{"model": "m", "span": {"start": 0, "end": 15}}]
    body = {"node_id": "a", "loaded": held, "rtt_ms": {"near": 2.0, "far": 80.0, "tracker": 1.0}}
    assert client.post("/v1/nodes/heartbeat", json=body).status_code == 200

    def route(**params: Any) -> str:
        query = {"model": "m", "start": 15, **params}
        return str(client.get("/v1/route", params=query).json()["hops"][0]["node_id"])

    assert {route(origin="a") for _ in range(20)} == {"near"}
    assert {route() for _ in range(40)} == {"near", "far"}
    bad = client.get("/v1/route", params={"model": "m", "start": 15, "origin": "a/../b"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "origin"


@pytest.mark.parametrize(
    "rtt_ms", [{"near": -1.0}, {"near": 1e9}, {"../x": 1.0}, {f"n{i}": 1.0 for i in range(65)}]
)
def test_bad_round_trips_in_a_heartbeat_are_refused(
    mesh: tuple[TestClient, Clock], rtt_ms: dict[str, float]
) -> None:
    client, _ = mesh
    register(client, "a", 200)
    response = client.post("/v1/nodes/heartbeat", json={"node_id": "a", "rtt_ms": rtt_ms})
    assert response.status_code == 400, response.text
