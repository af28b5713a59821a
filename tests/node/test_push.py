"""Pushed frames between real servers (ADR-0034): two echo hops and an entry's inbox, each
an app under uvicorn in a thread, joined by `HttpTransport.push` over loopback sockets."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import httpx
import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from meshnet.config import AccessConfig, WireConfig, WireLimits
from meshnet.entry.inbox import Inbox
from meshnet.entry.transport import HttpTransport
from meshnet.errors import HopError
from meshnet.node.app import NodeService, create_app
from meshnet.node.directory import Listing, static_directory
from meshnet.node.runner import EchoRunner
from meshnet.security.signing import Signer
from meshnet.security.swarm import route_proof
from meshnet.types import Hop, LayerSpan, ModelId, NodeId
from meshnet.wire import FrameMeta
from meshnet.wire.route import PushRoute, Reply, passed_back
from tests.conftest import run
from tests.e2e.procs import free_port
from tests.owned import Sessions, encode
from tests.security.test_server import serving

KEY = "push-test-swarm-key-0123456789abcdef"
MODEL = ModelId("m")
SPANS = {"n-1": LayerSpan(10, 20), "n-2": LayerSpan(20, 30)}


def node(node_id: str, spans: list[LayerSpan], key: str | None = KEY) -> tuple[NodeService, object]:
    """A hop whose tracker lists the members of ROUTE and OTHER_ROUTE (the tests' routes)."""
    runners = [EchoRunner(MODEL, span) for span in spans]
    service = NodeService(runners, WireLimits(), WireConfig(), node_id=node_id, signer=Signer(key))
    service.forwarder.directory = static_directory(listing(ROUTE, OTHER_ROUTE))
    return service, create_app(service=service, access=AccessConfig(swarm_key=key))


def listing(*routes: PushRoute) -> Listing:
    """What a tracker would list of the members on `routes`."""
    hops = [hop for route in routes for hop in route.hops]
    addresses = {hop.node_id: hop.address for hop in hops}
    addresses |= {route.reply.node_id: route.reply.address for route in routes}
    return Listing(addresses, {(hop.node_id, MODEL): frozenset({hop.span}) for hop in hops})


@contextlib.contextmanager
def chain(
    dead: str | None = None,
) -> Iterator[tuple[HttpTransport, list[Hop], dict[str, NodeService]]]:
    """Hops n-1 (10:20) and n-2 (20:30), and an entry n-0 whose inbox takes the last output;
    `dead`: that hop's address has nothing listening."""
    services, ports = {}, {}
    with contextlib.ExitStack() as stack:
        for name in ["n-0", *SPANS]:
            service, app = node(name, [SPANS[name]] if name in SPANS else [])
            services[name] = service
            ports[name] = free_port() if name == dead else stack.enter_context(serving(app))  # type: ignore[arg-type]
        hops = [Hop(NodeId(n), f"http://127.0.0.1:{ports[n]}", s) for n, s in SPANS.items()]
        entry = services["n-0"]
        entry.inbox = Inbox()
        reply = Reply(NodeId("n-0"), f"http://127.0.0.1:{ports['n-0']}")
        for service in services.values():
            service.forwarder.directory = static_directory(listing(PushRoute(tuple(hops), reply)))
        transport = HttpTransport(timeout_s=5.0, signer=Signer(KEY), inbox=entry.inbox, reply=reply)
        yield transport, hops, services


SID = Sessions()


def meta(position: int = 0, session: str = "s-1") -> FrameMeta:
    return FrameMeta(SID[session], MODEL, LayerSpan(10, 20), position)


async def push(
    transport: HttpTransport, hops: list[Hop], frames: list[tuple[FrameMeta, torch.Tensor]]
) -> list[torch.Tensor]:
    try:
        return [await transport.push(hops, m, x) for m, x in frames]
    finally:
        await transport.aclose()


def test_a_pushed_step_comes_back_from_the_last_hop_and_every_hop_keeps_its_cache() -> None:
    prompt, step = torch.randn(1, 5, 16).bfloat16(), torch.randn(1, 1, 16).bfloat16()
    with chain() as (transport, hops, services):
        outs = run(push(transport, hops, [(meta(0), prompt), (meta(5), step)]))
        assert torch.equal(outs[0], prompt) and torch.equal(outs[1], step)  # echo hops
        assert services["n-1"].session_count() == services["n-2"].session_count() == 1
        assert services["n-2"].forwarder.routes  # the route each session started with
        # each sender timed its link from the answer's hold time (ADR-0037)
        assert "n-2" in services["n-1"].links.links and "n-0" in services["n-2"].links.links
        assert "n-1" in transport.links.links


@pytest.mark.parametrize("dead", ["n-1", "n-2"])
def test_a_dead_hop_is_named_by_the_hop_before_it(dead: str) -> None:
    with chain(dead=dead) as (transport, hops, _), pytest.raises(HopError) as caught:
        run(push(transport, hops, [(meta(0), torch.randn(1, 3, 16))]))
    assert caught.value.hop is not None and caught.value.hop.node_id == dead


def test_a_step_nobody_waits_for_or_of_another_shape_is_refused_at_the_inbox() -> None:
    inbox = Inbox()
    frame = meta(0)

    async def deliver() -> None:
        with pytest.raises(Exception, match="no pushed step"):
            inbox.deliver(frame, torch.zeros(1, 1, 16))
        inbox.expect(frame.session, 0, LayerSpan(10, 20), (1, 1, 16))
        with pytest.raises(Exception, match="not"):
            inbox.deliver(frame, torch.zeros(1, 2, 16))

    run(deliver())


ROUTE = PushRoute(
    (
        Hop(NodeId("n-1"), "http://127.0.0.1:1", SPANS["n-1"]),
        Hop(NodeId("n-2"), "http://127.0.0.1:2", SPANS["n-2"]),
    ),
    Reply(NodeId("n-0"), "http://127.0.0.1:3"),
)


def pushed_frame(
    frame: FrameMeta, route: PushRoute = ROUTE, proof: str | None = None
) -> tuple[dict[str, str], bytes]:
    encoded = encode(torch.randn(1, 1 if frame.position else 2, 16), frame)
    given = (
        route_proof(Signer(KEY).key, frame.session, frame.model, *route.signed())
        if proof is None
        else proof
    )
    headers = encoded.headers | route.headers(given, 1000)
    body = bytes(encoded.body)
    return headers | Signer(KEY).headers("POST", "/forward", body, to="n-1", headers=headers), body


async def send(
    service: NodeService, app: object, frames: list[tuple[dict[str, str], bytes]]
) -> list[httpx.Response]:
    """Post `frames` in order (no lifespan runs in-process: the push client is closed here)."""
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://n-1") as client:
            return [await client.post("/forward", headers=h, content=b) for h, b in frames]
    finally:
        await service.forwarder.aclose()


OTHER_ROUTE = PushRoute(
    (ROUTE.hops[0], Hop(NodeId("n-9"), "http://127.0.0.1:9", SPANS["n-2"])), ROUTE.reply
)
OFF_ROUTE = PushRoute(
    (Hop(NodeId("n-7"), "http://127.0.0.1:1", SPANS["n-1"]), ROUTE.hops[1]), ROUTE.reply
)


@pytest.mark.parametrize(
    ("frames", "status", "field"),
    [
        (lambda: [pushed_frame(meta(0), proof="0" * 64)], 400, "X-Meshnet-Route-Proof"),
        # the proof binds the session: a hop cannot send a frame on under another one
        (
            lambda: [
                pushed_frame(
                    meta(0, "s-2"),
                    proof=route_proof(
                        Signer(KEY).key, meta(0).session, meta(0).model, *ROUTE.signed()
                    ),
                )
            ],
            400,
            "X-Meshnet-Route-Proof",
        ),
        (
            lambda: [pushed_frame(meta(0), OFF_ROUTE)],
            400,
            "X-Meshnet-Route",
        ),  # sent to the wrong node
        (
            lambda: [pushed_frame(meta(0), OTHER_ROUTE), pushed_frame(meta(2))],
            409,
            "X-Meshnet-Route",
        ),
    ],
)
def test_a_pushed_frame_off_its_signed_route_is_refused_before_compute(
    frames: Callable[[], list[tuple[dict[str, str], bytes]]], status: int, field: str
) -> None:
    """(Frames are signed when the test runs: a proof made at collection would be stale.)"""
    service, app = node("n-1", [SPANS["n-1"]])
    sent = frames()
    answers = run(send(service, app, sent))
    last = answers[-1]
    assert last.status_code == status, last.text
    assert last.json()["error"]["field"] == field
    assert service.session_count() == (1 if len(sent) > 1 else 0)  # the refused frame: nothing


def test_a_node_without_a_swarm_key_pushes_nothing_on() -> None:
    service, app = node("n-1", [SPANS["n-1"]], key=None)
    encoded = encode(torch.randn(1, 2, 16), meta(0))
    headers = encoded.headers | ROUTE.headers("", 1000)
    answer = run(send(service, app, [(headers, bytes(encoded.body))]))[0]
    assert answer.status_code == 400 and "swarm key" in answer.json()["error"]["message"]
    assert service.session_count() == 0


TARPIT = Hop(NodeId("n-9"), "http://127.0.0.1:9", SPANS["n-2"])


def then(hop: Hop) -> PushRoute:
    """ROUTE with `hop` after n-1."""
    return PushRoute((ROUTE.hops[0], hop), ROUTE.reply)


@pytest.mark.parametrize(
    ("route", "says"),
    [
        (
            PushRoute((ROUTE.hops[0], replace(TARPIT, node_id=NodeId("svc"))), ROUTE.reply),
            "no member",
        ),
        (
            PushRoute((ROUTE.hops[0], replace(TARPIT, address="http://10.0.0.1:80")), ROUTE.reply),
            "no member",
        ),
        (
            PushRoute((ROUTE.hops[0], replace(TARPIT, span=LayerSpan(20, 25))), ROUTE.reply),
            "no layers",
        ),
        (PushRoute(ROUTE.hops[:1], Reply(NodeId("n-0"), "http://127.0.0.1:18199")), "no member"),
    ],
    ids=["stranger", "another-address", "other-layers", "reply-elsewhere"],
)
def test_a_hop_pushes_only_to_members_the_tracker_lists(route: PushRoute, says: str) -> None:
    """Review N6: a member signed a route sending B's output to 127.0.0.1:18199 (an internal
    service), and B posted its activations there. Now B refuses before it computes."""
    service, app = node("n-1", [SPANS["n-1"]])
    answer = run(send(service, app, [pushed_frame(meta(0, "n6"), route)]))[0]
    assert answer.status_code == 400 and answer.json()["error"]["field"] == "X-Meshnet-Route"
    assert says in answer.json()["error"]["message"] and service.session_count() == 0


def test_a_refusal_from_the_next_hop_is_passed_back_without_its_words() -> None:
    """Review N6: B's 502 carried 300 characters of the target's answer."""
    body = b'{"error":{"message":"INTERNAL-ADMIN-PANEL: db_password=hunter2","type":"Forbidden"}}'
    error = passed_back("n-2", 403, body)
    assert "hunter2" not in error.message and error.message == "n-2 answered 403 (Forbidden)"
    assert (
        passed_back("n-2", 500, b"<html>db_password=hunter2</html>").message == "n-2 answered 500"
    )
    further = b'{"error":{"message":"n-3 failed","code":"push_failed","failed":"n-3","status":409}}'
    relayed = passed_back("n-2", 502, further)  # a member's push error goes on as it came
    assert (relayed.failed, relayed.status, relayed.message) == ("n-3", 409, "n-3 failed")


def test_a_routes_budget_is_capped_by_the_hops_own_timeout() -> None:
    """Review N6: with Budget-Ms 3,600,000 and a next hop that never answers, B held the call
    until the listener gave up (25 s). Now it gives up at its own hop timeout."""
    with socket.socket() as tarpit:
        tarpit.bind(("127.0.0.1", 0))
        tarpit.listen(8)  # accepts, never answers
        hop = replace(TARPIT, address=f"http://127.0.0.1:{tarpit.getsockname()[1]}")
        route = PushRoute((ROUTE.hops[0], hop), ROUTE.reply)
        service, app = node("n-1", [SPANS["n-1"]])
        service.forwarder.directory = static_directory(listing(route))
        service.forwarder.max_budget_ms = 500
        headers, body = pushed_frame(meta(0, "n6-budget"), route)
        headers = headers | {"X-Meshnet-Budget-Ms": "3600000"}
        headers |= Signer(KEY).headers("POST", "/forward", body, to="n-1", headers=headers)
        started = time.monotonic()
        answer = run(send(service, app, [(headers, body)]))[0]
    assert answer.status_code == 502 and time.monotonic() - started < 5.0


def test_an_unsigned_refusal_naming_another_hop_is_the_first_hops_failure() -> None:
    """Review N9: error answers went unchecked, so a forged 502 `push_failed` naming any
    node (on the path, or from the first hop itself) got that node banned and reported. A
    member's app signs its refusals; words nobody signed count against whoever sent them."""
    forged = b'{"error":{"message":"n-2 failed","code":"push_failed","failed":"n-2","status":502}}'

    async def refuse(request: Request) -> Response:
        await request.body()
        return Response(forged, status_code=502, media_type="application/json")

    liar = Starlette()
    liar.add_route("/forward", refuse, methods=["POST"])
    entry, entry_app = node("n-0", [])
    with serving(entry_app) as entry_port, serving(liar) as liar_port:  # type: ignore[arg-type]
        hops = [
            Hop(NodeId("n-1"), f"http://127.0.0.1:{liar_port}", SPANS["n-1"]),
            Hop(NodeId("n-2"), "http://127.0.0.1:9", SPANS["n-2"]),
        ]
        reply = Reply(NodeId("n-0"), f"http://127.0.0.1:{entry_port}")
        transport = HttpTransport(timeout_s=5.0, signer=Signer(KEY), inbox=entry.inbox, reply=reply)
        with pytest.raises(HopError) as caught:
            run(push(transport, hops, [(meta(0, "n9"), torch.randn(1, 2, 16))]))
    assert caught.value.hop is not None and caught.value.hop.node_id == "n-1"
    assert "unsigned" in caught.value.message
