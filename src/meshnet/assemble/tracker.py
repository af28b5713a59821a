"""`meshnet tracker`: the control plane alone, or with an entry node in the same process.

Alone, it forwards client calls to the entries of each model (ADR-0028). With `--layers 0:K`
or `--budget` (tracker-as-node, ADR-0014) it also holds layers `[0, K)` and the head of its
first model, registers that span with its own registry in-process, takes routes straight
from the registry, and forwards calls for its other models to their entries.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import httpx
import uvicorn
from fastapi import FastAPI
from starlette.applications import Starlette

from meshnet.api.app import access_rules as api_rules
from meshnet.api.app import api_router
from meshnet.assemble.entry import EntryRole, entry_span, load_entry_model
from meshnet.assemble.http import ServerLimits, server_config
from meshnet.assemble.node import (
    agent_lifespan,
    entry_transport,
    node_registration,
    node_service,
    on_device,
)
from meshnet.config import (
    AccessConfig,
    ApiLimits,
    EntryConfig,
    NodeConfig,
    TlsConfig,
    TrackerConfig,
)
from meshnet.entry.routes import hops_of
from meshnet.errors import ConfigError
from meshnet.node.app import access_rules as node_rules
from meshnet.node.app import add_node_routes
from meshnet.node.compute import pin_loop_thread
from meshnet.node.directory import Directory
from meshnet.security.signing import Signer
from meshnet.security.swarm import TRACKER
from meshnet.security.tls import client_context, scheme, server_options
from meshnet.tracker import messages as msg
from meshnet.tracker import views
from meshnet.tracker.app import create_app as create_tracker_app
from meshnet.tracker.forward import EntryForwarder, ready_models
from meshnet.tracker.offers import build_registry, offer, tracker_store
from meshnet.tracker.peering import Peering, check_peers, own_url
from meshnet.tracker.probe import HttpProber, OwnNodeTrusted
from meshnet.tracker.registry import Registry
from meshnet.types import Hop, ModelId, NodeId
from meshnet.weights.serve import UploadLimit, WeightServer
from meshnet.weights.store import WeightStore

log = logging.getLogger(__name__)


def forwarding_client(tls: TlsConfig) -> httpx.AsyncClient:
    """For calls forwarded to entries: a generation streams for minutes (no read timeout),
    but connecting must be quick."""
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), verify=client_context(tls))


def build_tracker_app(config: TrackerConfig, access: AccessConfig = AccessConfig()) -> FastAPI:
    """A tracker that runs no model: the control plane, and clients forwarded to entries."""
    store = tracker_store(config)
    registry = build_registry(config, store)
    signer = Signer(access.swarm_key)  # its forwarded calls are member calls (N4)
    forwarder = EntryForwarder(registry, forwarding_client(access.tls), signer=signer)
    prober = HttpProber(Signer(access.swarm_key), verify=client_context(access.tls))
    weights = weight_server(config, store, registry)
    peering = tracker_peering(config, access, registry)
    return create_tracker_app(
        registry,
        config,
        prober=prober,
        access=access,
        forwarder=forwarder,
        weights=weights,
        peering=peering,
    )


def tracker_hello(
    config: TrackerConfig, access: AccessConfig, models: Sequence[str], key: str | None = None
) -> msg.TrackerHello:
    """What this tracker tells its peers of itself; `key`: its public key (ADR-0059)."""
    url = own_url(config.host, config.port, scheme(access.tls), config.public_url)
    trackers = sorted({url, *(p.rstrip("/") for p in config.peers)})
    return msg.TrackerHello(url=url, trackers=trackers, models=sorted(models), key=key)


def tracker_peering(
    config: TrackerConfig, access: AccessConfig, registry: Registry
) -> Peering | None:
    """One of several trackers (`--peers`): the lease rounds among them (ADR-0057)."""
    if not config.peers:
        return None
    hello = tracker_hello(config, access, list(registry.offers), registry.identity.public)
    client = httpx.AsyncClient(
        auth=Signer(access.swarm_key).auth(TRACKER), verify=client_context(access.tls)
    )
    return Peering(hello, registry, client)


def weight_server(config: TrackerConfig, store: WeightStore, registry: Registry) -> WeightServer:
    """What serves the tracker's GGUF models to members, within its upload limit."""
    return WeightServer(store, UploadLimit(config.weights_upload_bytes_s), registry.metrics)


class RegistryRoutes:
    """Routes from the registry of the tracker this entry node runs inside."""

    def __init__(self, registry: Registry, rng: random.Random, origin: str | None = None) -> None:
        self.registry = registry
        self.rng = rng
        self.origin = origin  # this entry's node id: routes count round trips from it
        self.degraded = False  # the registry is in this process: never out of reach

    async def route(
        self,
        model: ModelId,
        start: int,
        end: int | None = None,
        exclude: frozenset[NodeId] = frozenset(),
    ) -> list[Hop]:
        self.registry.expire()
        route = views.route(self.registry, model, start, self.rng, end, exclude, self.origin)
        return hops_of(route)

    async def report(self, node: NodeId, reason: str) -> None:
        self.registry.report(node, reason)


def registry_directory(registry: Registry) -> Directory:
    """The members this very tracker lists (a push from its own span goes only to them)."""

    async def fetch() -> msg.CoverageResponse:
        return views.coverage(registry)

    return Directory(fetch)


def build_tracker_node_app(
    tracker: TrackerConfig,
    node: NodeConfig,
    entry: EntryConfig = EntryConfig(),
    access: AccessConfig = AccessConfig(),
    limits: ApiLimits = ApiLimits(),
) -> FastAPI:
    """`meshnet tracker --layers 0:K`: the control plane plus an entry node, in one process."""
    if tracker.peers:
        raise ConfigError(
            "--peers needs trackers without a span of their own (no --layers, no --budget): "
            "their nodes join every tracker with --tracker URL1,URL2,..."
        )
    store = tracker_store(tracker)
    registry = build_registry(tracker, store)
    signer = Signer(access.swarm_key)
    node = replace(node, model=tracker.models[0], host=tracker.host, port=tracker.port, entry=True)
    node = on_device(node)
    span = entry_span(node)
    request = node_registration(replace(node, layers=str(span)), span, access.tls)
    service = node_service(node, request.node_id, access, registry.metrics)
    rules = [*node_rules(service.limits), *api_rules(limits, access.swarm_key is not None)]
    prober = OwnNodeTrusted(
        HttpProber(signer, verify=client_context(access.tls)), request.node_id, request.address
    )
    app = create_tracker_app(
        registry,
        tracker,
        prober=prober,
        access=access,
        extra_rules=rules,
        node_id=request.node_id,
        weights=weight_server(tracker, store, registry),
    )
    add_node_routes(app, service)  # other entry nodes may route through our span
    service.forwarder.directory = registry_directory(registry)  # whom it may push to
    service.forwarder.max_budget_ms = int(1000 * entry.hop_timeout_s)
    transport = entry_transport(service, entry, access, request)
    routes = RegistryRoutes(registry, random.Random(tracker.route_seed), request.node_id)
    role = EntryRole(node, entry, service, routes, transport)
    load = (node, offer(node.model).model, node.model, span)
    model = service.scheduler.run_blocking(load_entry_model, *load)  # see run_blocking
    service.shards.add(model.runner)
    role.add(model)
    # other models this tracker offers are answered by their entries (ADR-0028)
    forwarder = EntryForwarder(
        registry,
        forwarding_client(access.tls),
        exclude=frozenset({request.node_id}),
        signer=signer,
    )
    app.include_router(
        api_router(
            role.generators,
            entry.default_max_tokens,
            limits,
            elsewhere=forwarder.forward,
            more_models=lambda: ready_models(registry),
        )
    )
    own = agent_lifespan(  # registers with this very app, in-process (signed like any node)
        role,
        lambda: [
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app, client=("127.0.0.1", 0)),
                base_url="http://self",
                auth=signer.auth(TRACKER),
            )
        ],
        request,
        transport.aclose,
    )
    tracker_lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def both(application: Starlette) -> AsyncIterator[None]:
        async with tracker_lifespan(application), own(application):
            try:
                yield
            finally:
                await service.forwarder.aclose()

    app.router.lifespan_context = both
    return app


def serve_tracker(config: TrackerConfig, access: AccessConfig) -> None:
    app = build_tracker_app(config, access)
    if config.peers:  # refuse peers of another mesh before serving (ConfigError)
        models = [offer(name).model for name in config.models]
        signer, verify = Signer(access.swarm_key), client_context(access.tls)
        check_peers(tracker_hello(config, access, models), signer, verify)
    log.info("tracker on %s://%s:%d", scheme(access.tls), config.host, config.port)
    options = server_options(access.tls)
    uvicorn.Server(server_config(app, config.host, config.port, ServerLimits(), **options)).run()


def serve_tracker_node(
    tracker: TrackerConfig,
    node: NodeConfig,
    entry: EntryConfig,
    access: AccessConfig,
    limits: ApiLimits,
) -> None:
    node = on_device(node)
    pin_loop_thread()  # before any torch op: model work belongs to the compute thread
    app = build_tracker_node_app(tracker, node, entry, access, limits)
    url = f"{scheme(access.tls)}://{tracker.host}:{tracker.port}"
    log.info("tracker and entry node on %s (API under /v1)", url)
    options = server_options(access.tls)
    config = server_config(app, tracker.host, tracker.port, ServerLimits(), **options)
    uvicorn.Server(config).run()
