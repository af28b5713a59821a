"""Entry nodes: a node serving layers `[0, k)` that also holds the head and serves the API.

Two ways to run one (ADR-0014):
- `meshnet node --entry --layers 0:K --tracker URL`: asks the tracker for routes over HTTP;
- `meshnet tracker --layers 0:K` (tracker-as-node): the tracker's own process holds the span,
  registers it with its own registry in-process, and takes routes straight from the registry.
Either way the entry's own span runs in-process; only the hops after it are HTTP calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

import httpx
import uvicorn
from fastapi import FastAPI
from starlette.applications import Starlette

from meshnet.api.app import access_rules as api_rules
from meshnet.api.app import api_router
from meshnet.api.app import create_app as create_api_app
from meshnet.client.codec import HfCodec
from meshnet.client.generation import Generator
from meshnet.client.pipeline import Pipeline
from meshnet.client.routes import RegistryRoutes, RouteSource, StaticRoutes, TrackerRoutes
from meshnet.client.transport import HttpTransport
from meshnet.config import (
    AccessConfig,
    ApiLimits,
    EntryConfig,
    NodeConfig,
    TrackerConfig,
    WireConfig,
    WireLimits,
)
from meshnet.errors import ModelError
from meshnet.models import sizing
from meshnet.models.loader import load_head, load_tokenizer
from meshnet.models.quantize import default_quant, head_dtype, local_layer_bytes
from meshnet.models.source import resolve
from meshnet.node.agent import NodeAgent
from meshnet.node.app import NodeService, add_metrics_route, add_node_routes
from meshnet.node.app import access_rules as node_rules
from meshnet.node.compute import host_turns, pin_loop_thread
from meshnet.node.serve import load_runner, registration, run_server, tracker_client
from meshnet.node.torch_runner import TorchShardRunner
from meshnet.observe.metrics import Metrics
from meshnet.security.signing import Signer
from meshnet.security.swarm import SwarmKey
from meshnet.tracker.app import create_app as create_tracker_app
from meshnet.tracker.forward import EntryForwarder, ready_models
from meshnet.tracker.messages import RegisterRequest
from meshnet.tracker.probe import HttpProber, OwnNodeTrusted
from meshnet.tracker.serve import build_registry, offer
from meshnet.types import LayerSpan

log = logging.getLogger(__name__)
ClientFactory = Callable[[], httpx.AsyncClient]


@dataclass
class EntryModel:
    """What an entry node holds for one model besides the routes."""

    model_id: str
    runner: TorchShardRunner  # layers [0, k)
    head: object  # models.shard.Head
    codec: HfCodec
    num_layers: int
    max_context: int


def entry_span(config: NodeConfig) -> LayerSpan:
    """`--layers` as given, or as many layers from 0 as the budget holds after the head."""
    spec = resolve(config.model).spec
    if config.layers is not None:
        span = LayerSpan.parse(config.layers)
        if span.start != 0:
            raise ModelError(f"an entry node serves layers from 0; got {span}")
        return span
    if config.budget_bytes is None:
        return LayerSpan(0, spec.num_layers)
    quant = config.quant or default_quant()
    usable = int(config.budget_bytes * (1 - config.kv_reserve_fraction))
    usable -= sizing.head_bytes(spec, 4 if quant == "fp32" else 2)
    count = sizing.layers_that_fit(spec, local_layer_bytes(spec, quant), usable)
    if count < 1:
        raise ModelError(f"a budget of {config.budget_bytes} bytes holds no layer besides the head")
    return LayerSpan(0, count)


def entry_budget(config: NodeConfig, span: LayerSpan) -> int:
    """The budget the entry registers for layers: `--budget` less the head, or just its span."""
    spec = resolve(config.model).spec
    quant = config.quant or default_quant()
    span_bytes = len(span) * local_layer_bytes(spec, quant)
    needed = math.ceil(span_bytes / (1 - config.kv_reserve_fraction)) + 1
    if config.budget_bytes is None:
        return needed
    head = sizing.head_bytes(spec, 4 if quant == "fp32" else 2)
    if config.budget_bytes - head < needed:
        raise ModelError(
            f"a budget of {config.budget_bytes} bytes cannot hold the head ({head} bytes) and "
            f"layers {span} ({needed} bytes with the KV reserve)"
        )
    return config.budget_bytes - head


def load_entry_model(config: NodeConfig, span: LayerSpan) -> EntryModel:
    model_id = offer(config.model).model
    runner = load_runner(config, model_id, config.model, span)
    source = resolve(config.model)
    head = load_head(source, head_dtype(runner.shard.quant))
    codec = HfCodec(load_tokenizer(source))
    log.info("entry for %s: layers %s and the head loaded", model_id, span)
    spec = source.spec
    return EntryModel(model_id, runner, head, codec, spec.num_layers, spec.max_positions)


def make_generator(
    model: EntryModel,
    service: NodeService,
    routes: RouteSource,
    transport: HttpTransport,
    entry: EntryConfig,
    entry_id: str,
) -> Generator:
    pipeline = Pipeline(
        model.runner.model,
        model.num_layers,
        model.head,  # type: ignore[arg-type]
        model.runner,
        service,
        routes,
        transport,
        service.wire,
        entry_id,
        retry=entry.retry,
        metrics=service.metrics,
        step_wait_s=entry.step_wait_s,
    )
    return Generator(
        pipeline,
        model.codec,
        model.max_context,
        random.Random(entry.seed),
        metrics=service.metrics,
        on_end=service.finished.append,  # the agent's next heartbeat tells the tracker
    )


def agent_lifespan(
    service: NodeService,
    client: ClientFactory,
    config: NodeConfig,
    request: RegisterRequest,
    on_stop: Callable[[], Awaitable[None]],
) -> Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]:
    """Keep the node registered while the app runs; leave the tracker when it stops."""

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        async with client() as http:
            agent = NodeAgent(
                service, http, request, lambda m, s, span: load_runner(config, m, s, span)
            )
            task = asyncio.create_task(agent.run())
            service.on_exit = lambda: asyncio.ensure_future(agent.retire(task))
            try:
                yield
            finally:
                task.cancel()
                await agent.leave()
                await on_stop()

    return lifespan


def entry_service(
    config: NodeConfig,
    model: EntryModel,
    request: RegisterRequest,
    access: AccessConfig,
    metrics: Metrics | None = None,
) -> NodeService:
    """The node side of an entry: its own span behind `/forward`, answering probes as itself."""
    service = NodeService(
        [model.runner],
        WireLimits(),
        WireConfig(),
        config.max_sessions,
        metrics=metrics,
        turns=host_turns(config.host_turns),
        max_batch=config.max_batch,
        max_batch_tokens=config.max_batch_tokens,
        batch_wait_s=config.batch_wait_s,
        node_id=request.node_id,
        swarm_key=SwarmKey.from_text(access.swarm_key) if access.swarm_key else None,
    )
    return service


def build_entry_app(
    config: NodeConfig,
    entry: EntryConfig = EntryConfig(),
    access: AccessConfig = AccessConfig(),
    limits: ApiLimits = ApiLimits(),
) -> FastAPI:
    """`meshnet node --entry`: layers [0, k), the head and the API; routes from the tracker.

    Without a tracker the node must hold every layer and serves alone.
    """
    span = entry_span(config)
    model = load_entry_model(config, span)
    request = registration(replace(config, budget_bytes=entry_budget(config, span)))
    request = request.model_copy(update={"entry": True})
    service = entry_service(config, model, request, access)
    transport = HttpTransport(
        service.wire,
        timeout_s=entry.hop_timeout_s,
        signer=Signer(access.swarm_key),
        metrics=service.metrics,
    )
    if config.tracker_url is None:
        if span.end < model.num_layers:
            raise ModelError(f"without --tracker an entry node must serve all layers, not {span}")
        routes: RouteSource = StaticRoutes([])  # it holds every layer: there are no hops
    else:
        routes = TrackerRoutes(tracker_client(config.tracker_url, access, entry.route_timeout_s))
    generator = make_generator(model, service, routes, transport, entry, request.node_id)
    app = create_api_app(
        {model.model_id: generator},
        entry.default_max_tokens,
        limits=limits,
        access=access,
        extra_rules=node_rules(service.limits),
    )
    add_node_routes(app, service)
    add_metrics_route(app, service.metrics)
    app.add_route("/health", service.health, methods=["GET"])
    if config.tracker_url is not None:
        url = config.tracker_url
        app.router.lifespan_context = agent_lifespan(
            service, lambda: tracker_client(url, access), config, request, transport.aclose
        )
    return app


def build_tracker_node_app(
    tracker: TrackerConfig,
    node: NodeConfig,
    entry: EntryConfig = EntryConfig(),
    access: AccessConfig = AccessConfig(),
    limits: ApiLimits = ApiLimits(),
) -> FastAPI:
    """`meshnet tracker --layers 0:K`: the control plane plus an entry node, in one process."""
    registry = build_registry(tracker)
    signer = Signer(access.swarm_key)
    node = replace(node, model=tracker.models[0], host=tracker.host, port=tracker.port)
    span = entry_span(node)
    model = load_entry_model(node, span)
    request = registration(replace(node, budget_bytes=entry_budget(node, span)))
    request = request.model_copy(update={"entry": True})
    service = entry_service(node, model, request, access, registry.metrics)
    rules = [*node_rules(service.limits), *api_rules(limits)]
    prober = OwnNodeTrusted(HttpProber(signer), request.node_id, request.address)
    app = create_tracker_app(registry, tracker, prober=prober, access=access, extra_rules=rules)
    add_node_routes(app, service)  # other entry nodes may route through our span
    transport = HttpTransport(
        service.wire, timeout_s=entry.hop_timeout_s, signer=signer, metrics=service.metrics
    )
    routes = RegistryRoutes(registry, random.Random(tracker.route_seed))
    generator = make_generator(model, service, routes, transport, entry, request.node_id)
    # other models this tracker offers are answered by their entries (ADR-0028)
    outbound = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
    forwarder = EntryForwarder(registry, outbound, exclude=frozenset({request.node_id}))
    app.include_router(
        api_router(
            {model.model_id: generator},
            entry.default_max_tokens,
            limits,
            elsewhere=forwarder.forward,
            more_models=lambda: ready_models(registry),
        )
    )
    own = agent_lifespan(  # registers with this very app, in-process (signed like any node)
        service,
        lambda: httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, client=("127.0.0.1", 0)),
            base_url="http://self",
            auth=signer.auth(),
        ),
        node,
        request,
        transport.aclose,
    )
    tracker_lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def both(application: Starlette) -> AsyncIterator[None]:
        async with tracker_lifespan(application), own(application):
            yield

    app.router.lifespan_context = both
    return app


def serve_entry(
    config: NodeConfig, entry: EntryConfig, access: AccessConfig, limits: ApiLimits
) -> None:
    pin_loop_thread()  # before any torch op: model work belongs to the compute thread
    app = build_entry_app(config, entry, access, limits)
    log.info("entry node listening on http://%s:%d (API under /v1)", config.host, config.port)
    run_server(app, app.state.service, config.host, config.port, config.drain_timeout_s)


def serve_tracker_node(
    tracker: TrackerConfig,
    node: NodeConfig,
    entry: EntryConfig,
    access: AccessConfig,
    limits: ApiLimits,
) -> None:
    pin_loop_thread()
    app = build_tracker_node_app(tracker, node, entry, access, limits)
    log.info("tracker and entry node on http://%s:%d (API under /v1)", tracker.host, tracker.port)
    uvicorn.run(app, host=tracker.host, port=tracker.port, log_level="warning")
