"""The node agent against the real tracker app in-process: directives, loads, failures."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest

from meshnet.config import TrackerConfig, WireConfig, WireLimits
from meshnet.entry.outbox import Outbox
from meshnet.models.source import source_kind
from meshnet.node.agent import Membership, NodeAgent, RefusedError, node_id
from meshnet.node.app import NodeService
from meshnet.node.runner import EchoRunner, ShardRunner
from meshnet.tracker import messages as msg
from meshnet.tracker import views
from meshnet.tracker.app import create_app
from meshnet.tracker.planner import ModelOffer
from meshnet.tracker.probe import TrustingProber
from meshnet.tracker.registry import Registry
from meshnet.types import LayerSpan, ModelId
from tests.conftest import run

MB = 1 << 20


def tracker() -> tuple[Registry, httpx.AsyncClient]:
    offers = [ModelOffer(ModelId("m"), 8, {"fp32": 10 * MB})]
    registry = Registry(offers, {ModelId("m"): "m-source"}, dead_after_s=60, clock=lambda: 0.0)
    app = create_app(registry, TrackerConfig(), prober=TrustingProber())
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    return registry, client


def agent(
    client: httpx.AsyncClient,
    name: str,
    budget_mb: int,
    fail: bool = False,
    membership: Membership | None = None,
) -> NodeAgent:
    def loader(model: str, source: str, span: LayerSpan) -> ShardRunner:
        assert source == "m-source"
        if fail:
            raise RuntimeError("disk full")
        return EchoRunner(ModelId(model), span)

    request = msg.RegisterRequest(
        node_id=name,
        address=f"http://{name}:1",
        budget_bytes=budget_mb * MB,
        quant="fp32",
        throughput=1.0,
    )
    service = NodeService([], WireLimits(), WireConfig())
    return NodeAgent(service, client, request, loader, membership=membership)


async def settle(*agents: NodeAgent, beats: int = 3) -> None:
    for _ in range(beats):
        for a in agents:
            await a._beat()
            await asyncio.gather(*a.loading.values())


def test_agent_loads_what_it_is_told_and_reports_it() -> None:
    async def scenario() -> None:
        registry, client = tracker()
        node = agent(client, "a", 100)
        await settle(node)
        assert sorted(node.service.shards) == [("m", LayerSpan(0, 8))]
        assert registry.nodes["a"].loaded == {(ModelId("m"), LayerSpan(0, 8))}
        registry.nodes.clear()  # the tracker restarts and forgets everyone
        await settle(node, beats=1)
        assert registry.nodes["a"].loaded == {(ModelId("m"), LayerSpan(0, 8))}
        await client.aclose()

    run(scenario())


def test_failed_load_is_reported_and_replanned_elsewhere() -> None:
    async def scenario() -> None:
        registry, client = tracker()
        broken = agent(client, "a", 100, fail=True)
        await settle(broken)
        assert registry.nodes["a"].failed == {(ModelId("m"), LayerSpan(0, 8))}
        healthy = agent(client, "b", 100)
        await settle(healthy, broken)
        assert sorted(healthy.service.shards) == [("m", LayerSpan(0, 8))]
        assert not broken.service.shards
        await client.aclose()

    run(scenario())


def test_node_id_survives_a_restart(tmp_path: object) -> None:
    from pathlib import Path

    folder = Path(str(tmp_path)) / "data"
    first = node_id(folder)
    assert first == node_id(folder) and first.startswith("node-")


def test_heartbeats_carry_the_finished_requests_once() -> None:
    summary = msg.RequestSummary(
        session="s-1",
        model="m",
        outcome="length",
        prompt_tokens=3,
        completion_tokens=5,
        duration_s=0.1,
        time_to_first_token_s=0.01,
        decode_tokens_per_s=50.0,
    )

    async def scenario() -> None:
        registry, client = tracker()
        node = agent(client, "a", 100)
        await settle(node, beats=1)  # registered
        finished = Outbox()  # the entry role's
        node.service.take_finished = finished.take
        finished.append(summary)
        await settle(node, beats=2)  # the second beat has nothing new to tell
        assert [(entry, r) for _, entry, r in registry.requests] == [("a", summary)]
        assert not finished
        await client.aclose()

    run(scenario())


def test_heartbeats_carry_live_load_into_route_choice() -> None:
    """Two copies of the same span: the one whose heartbeat reports a long queue and slow
    decode rounds loses the route to the idle one."""

    async def scenario() -> None:
        registry, client = tracker()
        busy, idle = agent(client, "a", 100), agent(client, "b", 100)
        await settle(busy, idle)
        busy.service.scheduler._rounds_s = [0.05, 0.04, 0.06]  # as measured by its rounds
        busy.service.scheduler._queue = [object()] * 3  # type: ignore[list-item]
        idle.service.scheduler._rounds_s = [0.05]
        await settle(busy, idle, beats=1)
        record = registry.nodes["a"]
        assert (record.queue_depth, record.step_s) == (3, 0.05)
        servers = {s.node_id: s for s in views.servers(registry, ModelId("m"))}
        assert servers["a"].queue_depth == 3 and servers["b"].step_s == 0.05
        for seed in range(5):
            hops = views.route(registry, "m", 0, random.Random(seed))
            assert [h.node_id for h in hops.hops] == ["b"]
        await client.aclose()

    run(scenario())


def test_loaded_and_dropped_spans_reach_the_hooks_on_the_loop() -> None:
    """The entry role hangs on these: a span that serves is handed to `on_load`, a DROP is
    handed to `on_drop` (here: the tracker stops offering the model)."""

    async def scenario() -> None:
        registry, client = tracker()
        node = agent(client, "a", 100)
        seen: list[tuple[str, str, LayerSpan]] = []
        node.on_load = lambda runner: seen.append(("load", runner.model, runner.span))
        node.on_drop = lambda model, span: seen.append(("drop", model, span))
        await settle(node)
        assert seen == [("load", "m", LayerSpan(0, 8))]
        registry.offers.clear()  # no longer offered: its holders are told to drop it
        registry.dirty = True
        await settle(node, beats=2)
        assert seen[1:] == [("drop", "m", LayerSpan(0, 8))] and not node.service.shards
        await client.aclose()

    run(scenario())


def test_a_source_of_another_kind_here_is_refused_before_any_download() -> None:
    """Review finding 14: the tracker offers a folder `org/name`; a node without that folder
    would have resolved it as a hub id and downloaded whatever that namespace holds."""

    async def scenario() -> None:
        offers = [ModelOffer(ModelId("m"), 8, {"fp32": 10 * MB})]
        registry = Registry(offers, {ModelId("m"): "org/name"}, dead_after_s=60, clock=lambda: 0.0)
        registry.source_kinds = {ModelId("m"): "folder"}
        app = create_app(registry, TrackerConfig(), prober=TrustingProber())
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        calls: list[str] = []

        def loader(model: str, source: str, span: LayerSpan) -> ShardRunner:
            calls.append(source)  # the hub download would start in here
            return EchoRunner(ModelId(model), span)

        request = msg.RegisterRequest(
            node_id="a", address="http://a:1", budget_bytes=100 * MB, quant="fp32", throughput=1.0
        )
        node = NodeAgent(NodeService([], WireLimits(), WireConfig()), client, request, loader)
        await settle(node)
        assert not calls and not node.service.shards
        assert registry.nodes["a"].failed == {(ModelId("m"), LayerSpan(0, 8))}
        await client.aclose()

    run(scenario())


@pytest.mark.parametrize(
    ("name", "kind"),
    [("default", "default"), ("org/name", "hub"), ("./no/such/thing", None), ("x.gguf", None)],
)
def test_source_kinds_are_told_without_reading(name: str, kind: str | None) -> None:
    assert source_kind(name) == kind


def test_heartbeats_carry_round_trips_to_the_tracker_and_to_pinged_peers() -> None:
    """After a beat, the node knows its round trip to the tracker; a peer it sent frames to
    is pinged (here a real server on loopback) and the next beat reports both."""
    from meshnet.node.app import create_app as node_app
    from tests.security.test_server import serving

    async def scenario(peer_address: str) -> None:
        registry, client = tracker()
        node = agent(client, "a", 100)
        node.service.peers.seen("n-peer", peer_address)
        node.service.peers.seen("n-gone", "http://127.0.0.1:9")  # nothing listens: no sample
        await settle(node, beats=2)  # registers, then beats
        assert node._pinging is not None
        await node._pinging
        await settle(node, beats=1)
        reported = registry.nodes["a"].rtt_ms
        assert set(reported) == {"tracker", "n-peer"}
        assert 0 < reported["n-peer"] < 2000 and 0 < reported["tracker"] < 2000
        await node.service.forwarder.aclose()
        await client.aclose()

    with serving(node_app(EchoRunner(ModelId("m"), LayerSpan(0, 8)))) as port:  # type: ignore[arg-type]
        run(scenario(f"http://127.0.0.1:{port}"))


def test_a_restarted_node_proves_itself_with_the_token_it_kept(tmp_path: Path) -> None:
    """Review N5: a live id registers again only with its membership token; the node keeps
    it beside its id (mode 0600), so a restart in place is taken at once, not after expiry."""

    async def scenario() -> None:
        registry, client = tracker()
        kept = tmp_path / "membership_token"
        first = agent(client, "a", 100, membership=Membership.kept("a", kept))
        await first._beat()
        assert kept.read_text().strip() == first.membership.token
        assert kept.stat().st_mode & 0o777 == 0o600
        stranger = agent(client, "a", 100)  # the same id, no token: refused while a is live
        with pytest.raises(RefusedError, match="membership token"):
            await stranger._beat()
        again = agent(client, "a", 100, membership=Membership.kept("a", kept))
        await again._beat()
        assert again.registered and registry.nodes["a"].token is not None
        # the node's own token, the same with every tracker (ADR-0057)
        assert kept.read_text().strip() == again.membership.token == first.membership.token
        await client.aclose()

    run(scenario())


def test_a_lower_term_directs_the_node_only_once_its_planner_is_silent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Trackers restarted from nothing start terms over (they take none from nodes: review
    L1); the node waits `FENCE_BEATS` intervals without its term's planner, then follows."""
    from meshnet.node import agent as agent_module

    now = [100.0]
    monkeypatch.setattr(agent_module.time, "monotonic", lambda: now[0])
    load = msg.DirectiveMessage(
        op="LOAD_SHARD", model="m", source="m-source", span=LayerSpan(0, 8), reason="test"
    )

    async def scenario() -> None:
        _, client = tracker()
        node = agent(client, "a", 100)
        node._apply([], 7)  # a planner of term 7 answers
        node._apply([load], 1)
        assert node.term == 7 and not node.loading
        now[0] += agent_module.FENCE_BEATS * node.interval_s + 0.1
        node._apply([load], 1)
        assert node.term == 1 and ("m", LayerSpan(0, 8)) in node.loading
        await asyncio.gather(*node.loading.values())
        await client.aclose()

    run(scenario())
