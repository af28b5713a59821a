"""`meshnet node`: spans behind `/forward`, joined to a tracker; an entry where it holds layer 0.

The node loads the span given by hand (`--layers`, or every layer when there is no tracker),
registers, and loads or drops spans as the tracker directs. When it may be an entry (the
default), each span from layer 0 comes with the head and tokenizer and its model is answered
on the node's OpenAI-compatible API, with routes for the hops after it from the tracker.

A `--no-entry` node serves spans alone (`SpanRole`) and imports nothing of the entry; when its
spans are computed by ggml it never imports torch either (ADR-0052).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import httpx
from starlette.applications import Starlette
from starlette.types import ASGIApp

from meshnet.assemble.server import run_server
from meshnet.config import (
    AccessConfig,
    ApiLimits,
    EntryConfig,
    NodeConfig,
    TlsConfig,
    WireConfig,
    WireLimits,
)
from meshnet.errors import ModelError
from meshnet.models.device import resolve_device
from meshnet.models.quant import check_device
from meshnet.models.source import resolve
from meshnet.node.agent import Membership, NodeAgent
from meshnet.node.app import NodeService, create_app
from meshnet.node.compute import compute_threads, host_turns, pin_loop_thread
from meshnet.node.directory import tracker_directory
from meshnet.node.startup import (
    SpanRole,
    data_dir,
    node_backend,
    registration,
)
from meshnet.node.threads import ComputeThreads
from meshnet.node.trackers import check_trackers, tracker_client
from meshnet.node.weights import NodeWeights
from meshnet.observe.metrics import Metrics
from meshnet.security.access import Rule
from meshnet.security.signing import Signer
from meshnet.security.swarm import SwarmKey
from meshnet.security.tls import client_context, scheme
from meshnet.tracker import messages as msg
from meshnet.tracker.offers import offer
from meshnet.types import LayerSpan, NodeId
from meshnet.weights.serve import UploadLimit, WeightServer
from meshnet.weights.store import WeightStore
from meshnet.wire.route import Reply

if TYPE_CHECKING:
    from meshnet.assemble.entry import EntryRole
    from meshnet.entry.transport import HttpTransport

log = logging.getLogger(__name__)
ClientFactory = Callable[[], list[httpx.AsyncClient]]  # one client per tracker


def on_device(config: NodeConfig) -> NodeConfig:
    """`config` with its device resolved ("cpu" or "cuda:N"); ConfigError (before anything is
    loaded, bound or written) when it asks for a CUDA device PyTorch cannot use, or for q4
    weights where they cannot run (ADR-0040)."""
    resolved = replace(config, device=resolve_device(config.device))
    if resolved.quant is not None:
        check_device(resolved.quant, resolved.device)  # torch only where a check needs it
    return resolved


def pinned_span(config: NodeConfig) -> LayerSpan | None:
    """The span given by hand (`--layers`), or the whole model when there is no tracker."""
    if config.layers is not None:
        return LayerSpan.parse(config.layers)
    if not config.trackers:
        return LayerSpan(0, resolve(config.model).spec.num_layers)
    return None


def node_registration(
    config: NodeConfig, pinned: LayerSpan | None, tls: TlsConfig
) -> msg.RegisterRequest:
    """An entry span given by hand registers a budget that holds its head too; a node
    serving https registers an https address."""
    if config.entry and pinned is not None and pinned.start == 0:
        from meshnet.assemble.entry import entry_budget

        config = replace(config, budget_bytes=entry_budget(config, pinned))
    return registration(config, scheme(tls))


def node_service(
    config: NodeConfig, node_id: str, access: AccessConfig, metrics: Metrics | None = None
) -> NodeService:
    return NodeService(
        [],
        WireLimits(),
        WireConfig(
            encoding=config.wire_encoding,
            auto_compress_below_mbit_s=config.auto_compress_below_mbit_s,
        ),
        config.max_sessions,
        metrics=metrics,
        turns=host_turns(config.host_turns, config.device),
        max_batch=config.max_batch,
        max_batch_tokens=config.max_batch_tokens,
        batch_wait_s=config.batch_wait_s,
        node_id=node_id,
        swarm_key=SwarmKey.from_text(access.swarm_key) if access.swarm_key else None,
        signer=Signer(access.swarm_key),  # pushed frames go on signed (ADR-0034)
        tls=client_context(access.tls),
        threads=ComputeThreads(compute_threads(), config.threads),
    )


def node_weights(
    config: NodeConfig, access: AccessConfig, service: NodeService
) -> tuple[NodeWeights | None, WeightServer]:
    """Where this node's spans' weights come from (with a tracker), and what serves the parts
    it holds to other members (ADR-0054)."""
    store = WeightStore(data_dir(config) / "weights", config.weights_cache_bytes)
    server = WeightServer(store, UploadLimit(config.weights_upload_bytes_s), service.metrics)
    if not config.trackers:
        return None, server
    weights = NodeWeights(
        store,
        config.trackers[0],  # the tracker serves what no member holds (any would do)
        entry=config.entry,
        signer=Signer(access.swarm_key),
        verify=client_context(access.tls),
        metrics=service.metrics,
    )
    return weights, server


def agent_lifespan(
    role: EntryRole | SpanRole,
    client: ClientFactory,
    request: msg.RegisterRequest,
    on_stop: Callable[[], Awaitable[None]],
    member: Membership | None = None,
    weights: NodeWeights | None = None,
) -> Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]:
    """Keep the node registered while the app runs; leave the tracker when it stops."""
    service = role.service

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            https = [await stack.enter_async_context(c) for c in client()]
            agent = NodeAgent(
                service, https, request, role.load, role.attach, role.detach, member, weights
            )
            task = asyncio.create_task(agent.run())
            service.on_exit = lambda: asyncio.ensure_future(agent.retire(task))
            try:
                yield
            finally:
                task.cancel()
                await agent.leave()  # a no-op when the signal handler already left
                await on_stop()

    return lifespan


def build_app(
    config: NodeConfig,
    access: AccessConfig = AccessConfig(),
    entry: EntryConfig = EntryConfig(),
    limits: ApiLimits = ApiLimits(),
) -> Starlette:
    """The node's app: `/forward` for its spans, and the API when it may be an entry."""
    config = on_device(config)
    pinned = pinned_span(config)
    request = node_registration(config, pinned, access.tls)
    service = node_service(config, request.node_id, access)
    # its token comes with the registration, and stays for the next run
    member = Membership.kept(request.node_id, data_dir(config) / "membership_token")
    service.forwarder.max_budget_ms = int(1000 * entry.hop_timeout_s)
    client = None
    if config.trackers:  # routes, coverage: from whichever tracker answers
        client = tracker_client(config.trackers, access, entry.route_timeout_s)
        service.forwarder.directory = tracker_directory(client)  # whom it may push to
    role: EntryRole | SpanRole = SpanRole(config, service)
    api: ASGIApp | None = None
    rules: list[Rule] = []
    on_stop: Callable[[], Awaitable[None]] = _nothing
    if config.entry:
        entry_role, on_stop = make_entry_role(
            config, entry, access, service, request, client, member
        )
        api, rules = entry_api(entry_role, entry, limits, access)
        role = entry_role
    if pinned is not None:
        load_pinned(role, config, pinned)
    weights, server = node_weights(config, access, service)
    lifespan = None
    if config.trackers:
        urls = config.trackers
        lifespan = agent_lifespan(
            role,
            lambda: [tracker_client(u, access) for u in urls],
            request,
            on_stop,
            member,
            weights,
        )
    app = create_app(
        service=service,
        lifespan=lifespan,
        access=access,
        api=api,
        api_rules=rules,
        weights=server,
    )
    app.state.role = role
    return app


async def _nothing() -> None:
    return None


def make_entry_role(
    config: NodeConfig,
    entry: EntryConfig,
    access: AccessConfig,
    service: NodeService,
    request: msg.RegisterRequest,
    client: httpx.AsyncClient | None,
    member: Membership,
) -> tuple[EntryRole, Callable[[], Awaitable[None]]]:
    """The entry role of a node that may be one, and what closes its hops' connections."""
    from meshnet.assemble.entry import EntryRole
    from meshnet.entry.routes import RouteSource, StaticRoutes, TrackerRoutes

    transport = entry_transport(service, entry, access, request)
    routes: RouteSource = StaticRoutes([])  # without a tracker: every layer here, no hops
    if client is not None:
        routes = TrackerRoutes(client, member, metrics=service.metrics)
    return EntryRole(config, entry, service, routes, transport), transport.aclose


def entry_transport(
    service: NodeService, entry: EntryConfig, access: AccessConfig, request: msg.RegisterRequest
) -> HttpTransport:
    """How an entry on `service` reaches its hops, and is reached by pushed answers."""
    from meshnet.entry.inbox import Inbox
    from meshnet.entry.transport import HttpTransport

    service.inbox = Inbox()  # the node's `/push` hands pushed answers to it
    return HttpTransport(
        service.wire,
        timeout_s=entry.hop_timeout_s,
        signer=Signer(access.swarm_key),
        metrics=service.metrics,
        tls=client_context(access.tls),
        inbox=service.inbox,
        peers=service.peers,
        links=service.links,
        reply=Reply(NodeId(request.node_id), request.address),
    )


def entry_api(
    role: EntryRole, entry: EntryConfig, limits: ApiLimits, access: AccessConfig
) -> tuple[ASGIApp, list[Rule]]:
    """The OpenAI-compatible API app of a node that may be an entry, and its access rules
    (imported here: a `--no-entry` node never loads FastAPI)."""
    from meshnet.api.app import access_rules, create_app

    api = create_app(role.generators, entry.default_max_tokens, limits=limits, guarded=False)
    return api, access_rules(limits, access.swarm_key is not None)


def load_pinned(role: EntryRole | SpanRole, config: NodeConfig, span: LayerSpan) -> None:
    """Load the span given by hand before serving (with the head when it is an entry's)."""
    partial = span.end < resolve(config.model).spec.num_layers
    if not config.trackers and config.entry and span.start == 0 and partial:
        raise ModelError(
            f"without --tracker an entry must serve all layers, not {span} (no route to the "
            "rest); --no-entry serves the span alone"
        )
    load = (offer(config.model).model, config.model, span)
    runner = role.service.scheduler.run_blocking(role.load, *load)  # on the compute thread
    role.service.shards.add(runner)
    role.attach(runner)


def torch_computes(config: NodeConfig) -> bool:
    """Whether this node computes with torch: all but a `--no-entry` node whose model ggml
    computes (an entry's pipeline and sampling are torch's)."""
    return config.entry or node_backend(config, config.model) != "ggml"


def serve(config: NodeConfig, access: AccessConfig, entry: EntryConfig, limits: ApiLimits) -> None:
    """Load, (join,) then serve until SIGTERM or Ctrl-C."""
    config = on_device(config)
    if len(config.trackers) > 1:  # trackers of two meshes: refused before anything loads
        check_trackers(config.trackers, client_context(access.tls))
    if torch_computes(config):
        pin_loop_thread()  # before any torch op: model work belongs to the compute thread
    app = build_app(config, access, entry, limits)
    api = " (API under /v1 where it holds layer 0)" if config.entry else ""
    url = f"{scheme(access.tls)}://{config.host}:{config.port}"
    log.info("node listening on %s%s", url, api)
    run_server(app, app.state.service, config, access.tls)
