"""A node id is more than a claim (review finding 2): heartbeats, leaves and reports need
the membership token of the registration; a live id registers again only with it (N5); a
node claims only spans it was given, within its budget."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from meshnet.config import TrackerConfig
from meshnet.tracker.app import create_app
from meshnet.tracker.planner import ModelOffer
from meshnet.tracker.probe import TrustingProber
from meshnet.tracker.registry import Registry
from meshnet.types import ModelId, NodeId

MB = 1 << 20
SPAN = {"start": 0, "end": 10}


def tracker(
    clock: Callable[[], float] = lambda: 0.0,
) -> tuple[TestClient, TrustingProber, Registry]:
    offers = [ModelOffer(ModelId("m"), 30, {"fp32": 10 * MB})]
    registry = Registry(offers, {ModelId("m"): "m"}, dead_after_s=60.0, clock=clock)
    prober = TrustingProber()
    return TestClient(create_app(registry, TrackerConfig(), prober=prober)), prober, registry


def register(client: TestClient, node: str, address: str, **extra: Any) -> Any:
    body = {"node_id": node, "address": address, "budget_bytes": 400 * MB, "quant": "fp32"}
    return client.post("/v1/nodes/register", json=body | {"throughput": 1.0, **extra})


def test_heartbeats_and_leave_need_the_token_of_the_registration() -> None:
    client, _, registry = tracker()
    token = register(client, "a", "http://10.0.0.1:1").json()["token"]
    assert len(token) >= 32
    for path in ("/v1/nodes/heartbeat", "/v1/nodes/leave"):
        for wrong in ("", "x" * 32):
            refused = client.post(path, json={"node_id": "a", "token": wrong})
            assert refused.status_code == 403 and refused.json()["error"]["field"] == "token"
    assert "a" in registry.nodes  # nothing changed
    assert client.post("/v1/nodes/heartbeat", json={"node_id": "a", "token": token}).is_success
    assert client.post("/v1/nodes/leave", json={"node_id": "a", "token": token}).json() == {
        "left": True
    }


def test_reports_need_a_registered_reporter_and_its_token() -> None:
    client, _, registry = tracker()
    register(client, "victim", "http://10.0.0.1:1")
    token = register(client, "entry", "http://10.0.0.2:1").json()["token"]
    for body in ({}, {"reporter": "entry", "token": "forged"}, {"reporter": "nobody"}):
        refused = client.post("/v1/nodes/report", json={"node_id": "victim", "reason": "x"} | body)
        assert refused.status_code == 403
    assert not registry.nodes["victim"].reports.until_s  # nobody's routes changed
    body = {"node_id": "victim", "reason": "reset", "reporter": "entry", "token": token}
    assert client.post("/v1/nodes/report", json=body).json() == {"reported": True}


def test_a_live_id_registers_again_only_with_its_token_at_any_address() -> None:
    """Review N5: B's id registered again at B's own address got a fresh token (and with
    it the id: its leave took B out); nor may it move to another address without it."""
    now = [0.0]
    client, _, registry = tracker(lambda: now[0])
    token = register(client, "victim", "http://10.0.0.1:1").json()["token"]
    for address in ("http://10.6.6.6:1", "http://10.0.0.1:1"):  # elsewhere, and in its place
        for forged in ({}, {"token": "x" * 32}):
            hijack = register(client, "victim", address, quant="nf4", budget_bytes=1, **forged)
            assert hijack.status_code == 409 and "membership token" in hijack.text
    kept = registry.nodes["victim"].request
    assert (kept.address, kept.quant) == ("http://10.0.0.1:1", "fp32")  # unchanged
    again = register(client, "victim", "http://10.0.0.1:1", token=token)  # a restart in place
    assert again.is_success
    moved = register(client, "victim", "http://10.0.0.9:1", token=again.json()["token"])
    assert moved.is_success and registry.nodes["victim"].request.address == "http://10.0.0.9:1"
    now[0] = 61.0  # a node that lost its token: once the old record expired
    assert register(client, "victim", "http://10.0.0.1:1").is_success


def test_a_heartbeat_claims_only_assigned_or_registered_spans() -> None:
    client, _, registry = tracker()
    answer = register(client, "a", "http://10.0.0.1:1", loaded=[{"model": "m", "span": SPAN}])
    token = answer.json()["token"]
    assigned = [d["span"] for d in answer.json()["directives"] if d["op"] == "LOAD_SHARD"]
    held = [{"model": "m", "span": s} for s in [SPAN, *assigned]]
    assert client.post(
        "/v1/nodes/heartbeat", json={"node_id": "a", "token": token, "loaded": held}
    ).is_success
    fake = [{"model": "m", "span": {"start": 3, "end": 7}}]
    refused = client.post(
        "/v1/nodes/heartbeat", json={"node_id": "a", "token": token, "loaded": fake}
    )
    assert refused.status_code == 400 and "m 3:7, which it was never assigned" in refused.text
    assert ("m", (3, 7)) not in {(m, (s.start, s.end)) for m, s in registry.nodes["a"].loaded}


def test_a_registration_claiming_more_than_its_budget_is_refused() -> None:
    client, _, registry = tracker()
    whole = [{"model": "m", "span": {"start": 0, "end": 30}}]  # 300 MB of layers
    body = {"budget_bytes": 100 * MB, "loaded": whole}
    refused = client.post(
        "/v1/nodes/register",
        json={"node_id": "a", "address": "http://10.0.0.1:1", "quant": "fp32", "throughput": 1}
        | body,
    )
    assert refused.status_code == 400 and refused.json()["error"]["field"] == "budget_bytes"
    assert registry.nodes == {}


def test_a_span_told_to_drop_may_still_be_claimed_until_it_is_dropped() -> None:
    """Found in the end-to-end mesh: a DROP in flight while the node beats with the span
    still loaded must not look like a claim of a span never assigned."""
    from meshnet.tracker import messages as msg
    from meshnet.types import LayerSpan

    offers = [ModelOffer(ModelId("m"), 30, {"fp32": 10 * MB})]
    registry = Registry(offers, {ModelId("m"): "m"}, dead_after_s=60.0, clock=lambda: 0.0)

    def ref(start: int, end: int) -> msg.ShardRef:
        return msg.ShardRef(model="m", span=LayerSpan(start, end))

    def node(name: str, budget_mb: int, *spans: msg.ShardRef) -> msg.RegisterRequest:
        return msg.RegisterRequest(
            node_id=name,
            address=f"http://10.0.0.{len(name)}:1",
            budget_bytes=budget_mb * MB,
            quant="fp32",
            throughput=1.0,
            loaded=list(spans),
        )

    registry.register(node("b", 200, ref(0, 10), ref(10, 20)))
    registry.register(node("c", 100, ref(20, 30)))
    given = registry.register(node("a", 100))  # a second entry: assigned, not registered
    assert [(d.op, str(d.span)) for d in given] == [("LOAD_SHARD", "0:10")]
    registry.heartbeat(msg.HeartbeatRequest(node_id="a", loaded=[ref(0, 10)]))
    registry.leave(NodeId("c"))  # 20:30 is a gap: a's copy of 0:10 makes room for it
    ops = [(d.op, str(d.span)) for d in registry.nodes[NodeId("a")].pending]
    assert ops == [("DROP_SHARD", "0:10"), ("LOAD_SHARD", "20:30")]
    beat = msg.HeartbeatRequest(node_id="a", loaded=[ref(0, 10)], loading=[ref(20, 30)])
    registry.heartbeat(beat)  # accepted: 0:10 is still there, on its way out
    assert (ModelId("m"), LayerSpan(0, 10)) not in registry.nodes[NodeId("a")].loaded
