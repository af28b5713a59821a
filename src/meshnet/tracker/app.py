"""The tracker's HTTP app: registration, heartbeats, coverage, routes, health (JSON).

Member calls need a swarm-key proof; coverage may also be read with a client API key;
`/health` and the OpenAPI document are open (the access guard, ADR-0017).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import random
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from fastapi import FastAPI, Query, Request
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

from meshnet import __version__
from meshnet.config import AccessConfig, TrackerConfig
from meshnet.errors import RequestError
from meshnet.http_errors import WireVersionHeader, install_error_handlers
from meshnet.security.access import Credentials, Guard, KiB, Rule, rule
from meshnet.security.swarm import TRACKER
from meshnet.tracker import messages as msg
from meshnet.tracker import views
from meshnet.tracker.forward import EntryForwarder, listed_models
from meshnet.tracker.membership import NodeConflictError, new_token, token_digest
from meshnet.tracker.peering import HELLO_PATH, LEASE_PATH, Peering
from meshnet.tracker.probe import Prober
from meshnet.tracker.registry import Registry
from meshnet.types import NodeId, is_valid_id
from meshnet.weights.serve import WeightServer, add_weight_routes, weight_rules

log = logging.getLogger(__name__)
DASHBOARD = Path(__file__).parent / "dashboard"  # static files: no build step
CLIENT_BODY_BYTES = 4 << 20  # a forwarded client request; the entry applies its own limit


def access_rules() -> list[Rule]:
    return [
        rule("/v1/nodes", "swarm", max_body_bytes=256 * KiB),
        rule("/v1/route", "swarm"),
        rule("/v1/trackers", "swarm", max_body_bytes=16 * KiB),
        *weight_rules(),
        rule("/v1/entries", "swarm", "client"),
        rule("/v1/coverage", "swarm", "client"),
        rule("/metrics", "swarm", "client"),
        rule("/"),  # the dashboard page and its files hold no data: they read /v1/coverage
        rule("/dashboard"),
    ]


def create_app(
    registry: Registry,
    config: TrackerConfig,
    *,
    prober: Prober,
    access: AccessConfig = AccessConfig(),
    extra_rules: Sequence[Rule] = (),
    forwarder: EntryForwarder | None = None,
    node_id: str | None = None,
    weights: WeightServer | None = None,
    peering: Peering | None = None,
) -> FastAPI:
    """The tracker's ASGI app over `registry`; `prober` checks registering nodes.

    `extra_rules`: access rules of routes added later (tracker-as-node adds node and API routes).
    `forwarder`: a tracker that runs no model answers clients by forwarding to entries.
    `node_id`: the id of the node this process also is (tracker-as-node): members' proofs
    may be addressed to it as well as to `tracker`.
    `weights`: serves the parts of the GGUF models it offers to members (ADR-0054).
    `peering`: one of several trackers, it plans only while it holds their lease (ADR-0057).
    """
    rng = random.Random(config.route_seed)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(watch(registry, prober, config.heartbeat_interval_s / 10))]
        if peering is not None:
            tasks.append(asyncio.create_task(peering.run()))
        yield
        for task in tasks:
            task.cancel()

    app = FastAPI(title="meshnet tracker", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.state.metrics = registry.metrics
    app.state.forwarder = forwarder
    registry.metrics.on_scrape(lambda: _sample(registry))
    app.add_route("/metrics", registry.metrics.endpoint, methods=["GET"], include_in_schema=False)
    app.mount("/dashboard", StaticFiles(directory=DASHBOARD), name="dashboard")
    if weights is not None:
        add_weight_routes(app, weights)
    rules = [*access_rules(), *(client_rules() if forwarder else []), *extra_rules]
    names = frozenset({TRACKER, *([node_id] if node_id else [])})
    app.add_middleware(WireVersionHeader)
    # outermost (added last): nothing runs before it, and nothing changes an answer it signed
    app.add_middleware(Guard, rules=rules, credentials=Credentials(access, names))

    add_member_routes(app, registry, prober)
    if forwarder is not None:
        add_client_routes(app, registry, forwarder)
    add_view_routes(app, registry, rng, peering)
    if peering is not None:
        add_peer_routes(app, peering)
    return app


def add_member_routes(app: FastAPI, registry: Registry, prober: Prober) -> None:
    """What members call: registration (probed first), heartbeats, leaving, reports."""

    @app.post("/v1/nodes/register")
    async def register(request: msg.RegisterRequest, http: Request) -> msg.RegisterResponse:
        registry.validate(request)  # refuse what we would not count before probing
        await prober.probe(request.node_id, request.address)
        refuse_takeover(registry, request)
        peer = http.client.host if http.client else None
        token = request.token or new_token()  # a node's own: the same with every tracker
        directives = registry.register(request, peer, token)
        return msg.RegisterResponse(
            node_id=request.node_id,
            heartbeat_interval_s=registry.interval_s,
            directives=[registry.to_message(d) for d in directives],
            token=token,
            term=registry.term(),
            tracker_key=registry.identity.public,
        )

    @app.post("/v1/nodes/heartbeat")
    def heartbeat(beat: msg.HeartbeatRequest) -> msg.HeartbeatResponse:
        directives = registry.heartbeat(beat)
        return msg.HeartbeatResponse(
            directives=[registry.to_message(d) for d in directives],
            heartbeat_interval_s=registry.interval_s,
            term=registry.term(),
        )

    @app.post("/v1/nodes/leave")
    def leave(request: msg.LeaveRequest) -> dict[str, bool]:
        return {"left": registry.leave(NodeId(request.node_id), request.token)}

    @app.post("/v1/nodes/report")
    def report(request: msg.ReportRequest) -> dict[str, bool]:
        registry.check_member(request.reporter, request.token)  # a member, as itself
        reported = registry.report(NodeId(request.node_id), request.reason, request.reporter)
        return {"reported": reported}

    @app.get("/v1/coverage")
    def coverage() -> msg.CoverageResponse:
        registry.expire()
        return views.coverage(registry)


def add_view_routes(
    app: FastAPI, registry: Registry, rng: random.Random, peering: Peering | None
) -> None:
    """What anyone reads: coverage, entries, routes, the dashboard and health."""

    @app.get("/v1/entries")
    def entries(model: str = Query(max_length=200)) -> msg.EntriesResponse:
        """Where to send a client request for `model`: its live entry nodes."""
        registry.expire()
        return views.entries(registry, model)

    @app.get("/v1/route")
    def route(
        model: str = Query(max_length=200),
        start: int = Query(0, ge=0),
        end: int | None = Query(None, ge=1),
        exclude: str = Query("", max_length=8000, description="node ids, comma-separated"),
        origin: str = Query(
            "",
            max_length=128,
            description="the asking entry's node id: routes count its round trips",
        ),
    ) -> msg.RouteResponse:
        registry.expire()
        banned = frozenset(n for n in exclude.split(",") if n)
        bad = sorted(n for n in banned if not is_valid_id(n))
        if bad:
            raise RequestError(f"exclude holds invalid node ids: {bad[:3]}", field="exclude")
        if origin and not is_valid_id(origin):
            raise RequestError("origin must be a node id", field="origin")
        return views.route(registry, model, start, rng, end, banned, origin or None)

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        """The live dashboard: coverage picture, nodes, requests and directives."""
        return FileResponse(DASHBOARD / "index.html")

    @app.get("/health")
    def health() -> dict[str, object]:
        return {
            "status": "ok",
            "version": __version__,
            "nodes": len(registry.nodes),
            "models": sorted(registry.offers),
            **(peering.status() if peering is not None else {}),
        }


def add_peer_routes(app: FastAPI, peering: Peering) -> None:
    """What a tracker's peers call: the hello at their start, and the lease (async: the
    votes and the lease rounds take turns on the event loop)."""

    @app.post(HELLO_PATH)
    async def hello(body: msg.TrackerHello) -> msg.TrackerHello:
        peering.check(body)
        return peering.hello

    @app.post(LEASE_PATH)
    async def lease(body: msg.LeaseAsk) -> msg.LeaseAnswer:
        return await peering.answer(body)


def client_rules() -> list[Rule]:
    """The OpenAI routes a forwarding tracker answers (the entry checks the API key too)."""
    return [
        rule("/v1/chat/completions", "client", max_body_bytes=CLIENT_BODY_BYTES),
        rule("/v1/completions", "client", max_body_bytes=CLIENT_BODY_BYTES),
        rule("/v1/models", "client"),
    ]


def add_client_routes(app: FastAPI, registry: Registry, forwarder: EntryForwarder) -> None:
    async def forward(request: Request) -> Response:
        return await forwarder.forward(request)

    for path in ("/v1/chat/completions", "/v1/completions"):
        app.add_api_route(path, forward, methods=["POST"], include_in_schema=False)

    @app.get("/v1/models")
    def models() -> dict[str, object]:
        return listed_models(registry)


async def watch(registry: Registry, prober: Prober, every_s: float) -> None:
    """Expire silent nodes; check at once that a node overdue for a heartbeat still listens.

    A killed process refuses connections: it is dropped (and its spans re-planned) about one
    heartbeat interval after its last beat instead of after `dead_after_s`.
    """
    while True:
        await asyncio.sleep(every_s)
        registry.expire()
        for node_id in registry.to_check():
            record = registry.nodes.get(node_id)
            if record is not None:
                registry.gone(node_id, await prober.reachable(record.request.address))


def _sample(registry: Registry) -> None:
    for model, layers in views.layers_covered(registry).items():
        registry.metrics.layers_covered.labels(model).set(layers)


def refuse_takeover(registry: Registry, request: msg.RegisterRequest) -> None:
    """Refuse (409) registering an id the tracker holds live without that node's membership
    token, at any address (review N5: at the node's own address anyone got a fresh token,
    and with it the id). A node that lost its token waits until the old record expires."""
    registry.expire()
    with registry.lock:
        known = registry.nodes.get(NodeId(request.node_id))
        kept = known.token if known is not None else None
    if kept is None:
        return  # new, expired, or registered in-process
    if request.token and hmac.compare_digest(kept, token_digest(request.token)):
        return  # the same node registering again (moved, restarted, or re-declaring spans)
    raise NodeConflictError(
        f"node {request.node_id} is registered and live; registering it again needs its "
        f"membership token (without it, wait until its heartbeats have stopped for "
        f"{registry.dead_after_s:.0f} s)",
        field="token",
    )
