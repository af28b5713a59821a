"""Read-only views of the registry: the coverage map and routes."""

from __future__ import annotations

import random

from meshnet.errors import RequestError, RouteError, UnknownModelError
from meshnet.tracker import messages as msg
from meshnet.tracker.planner import ModelOffer, gaps
from meshnet.tracker.registry import Registry
from meshnet.tracker.routing import Server, choose_route, link_rtt_s
from meshnet.types import LayerSpan, ModelId, NodeId


def servers(
    registry: Registry,
    model: ModelId,
    exclude: frozenset[str] = frozenset(),
    origin: str | None = None,
) -> list[Server]:
    """Every loaded span of `model` on nodes not excluded or reported failing, with its
    round trip from `origin` (the entry asking) where the two measured one."""
    now = registry.clock()
    asking = registry.nodes.get(NodeId(origin)) if origin else None
    origin_rtt = asking.rtt_ms if asking is not None else {}
    return [
        Server(
            node_id,
            r.request.address,
            span,
            r.request.throughput,
            r.sessions,
            r.queue_depth,
            r.step_s,
            r.request.quant,
            link_rtt_s(origin, origin_rtt, node_id, r.rtt_ms) if origin else 0.0,
        )
        for node_id, r in sorted(registry.nodes.items())
        if node_id not in exclude and not r.reports.excludes(now, origin)
        for m, span in sorted(r.loaded)
        if m == model
    ]


def route(
    registry: Registry,
    model: str,
    start: int,
    rng: random.Random,
    end: int | None = None,
    exclude: frozenset[str] = frozenset(),
    origin: str | None = None,
) -> msg.RouteResponse:
    offer = registry.offers.get(ModelId(model))
    if offer is None:
        raise UnknownModelError(
            f"model {model!r} is not offered (offered: {sorted(registry.offers)})", field="model"
        )
    end = offer.num_layers if end is None else end
    if not 0 <= start < end <= offer.num_layers:
        raise RequestError(
            f"layers {start}:{end} are not a span within {model}'s {offer.num_layers} layers",
            field="start",
        )
    with registry.lock:
        live = servers(registry, offer.model, exclude, origin)
    hops = choose_route(offer.model, offer.num_layers, live, start, rng, end)
    return msg.RouteResponse(
        model=model,
        hops=[
            msg.RouteHop(node_id=h.node_id, address=h.address, span=h.span, quant=h.quant)
            for h in hops
        ],
    )


def entries(registry: Registry, model: str) -> msg.EntriesResponse:
    """The live entries of `model` (registered as entries, holding a loaded span from layer 0,
    neither suspect nor late), least loaded first; 404 for a model not offered."""
    if ModelId(model) not in registry.offers:
        raise UnknownModelError(
            f"model {model!r} is not offered (offered: {sorted(registry.offers)})", field="model"
        )
    with registry.lock:
        now = registry.clock()
        found = [
            msg.EntryInfo(
                node_id=node_id,
                address=r.request.address,
                span=span,
                sessions=r.sessions,
                queue_depth=r.queue_depth,
            )
            for node_id, r in sorted(registry.nodes.items())
            if r.request.entry and registry.state(r, now) not in ("late", "suspect")
            for m, span in sorted(r.loaded)
            if m == model and span.start == 0
        ]
    found.sort(key=lambda e: (e.sessions + e.queue_depth, e.node_id))
    return msg.EntriesResponse(model=model, entries=found)


def coverage(registry: Registry) -> msg.CoverageResponse:
    """The coverage map, node table, and recent directives and generations.

    Layers count as served only by nodes that are neither suspect nor late (a missed
    heartbeat): the map shows a killed node's gap before its heartbeats expire.
    """
    with registry.lock:
        return _coverage(registry)


def _coverage(registry: Registry) -> msg.CoverageResponse:
    now = registry.clock()
    states = {n: registry.state(r, now) for n, r in registry.nodes.items()}
    models = [
        _model_coverage(registry, offer, states) for _, offer in sorted(registry.offers.items())
    ]
    nodes = [
        msg.NodeSummary(
            node_id=n,
            address=r.request.address,
            budget_bytes=r.request.budget_bytes,
            quant=r.request.quant,
            throughput=r.request.throughput,
            loaded=[msg.ShardRef(model=m, span=s) for m, s in sorted(r.loaded)],
            loading=[msg.ShardRef(model=m, span=s) for m, s in sorted(r.assigned - r.loaded)],
            sessions=r.sessions,
            queue_depth=r.queue_depth,
            step_s=r.step_s,
            threads=r.threads,
            fetching=r.fetching,
            last_heartbeat_age_s=round(now - r.last_seen_s, 3),
            suspect=r.reports.agreed(now),
            state=states[n],
        )
        for n, r in sorted(registry.nodes.items())
    ]
    requests = [
        msg.RecentRequest(**summary.model_dump(), entry=entry, age_s=round(now - at, 3))
        for at, entry, summary in registry.requests
    ]
    return msg.CoverageResponse(
        models=models,
        nodes=nodes,
        recent_directives=issued(registry),
        recent_requests=requests,
        heartbeat_interval_s=registry.interval_s,
        planner=planner(registry, now),
    )


def planner(registry: Registry, now: float) -> str | None:
    """Which of several trackers plans, as this one knows it (None: the only tracker)."""
    lease = registry.lease
    if lease is None:
        return None
    return lease.me if lease.leads(now) else lease.planner(now) or "none (electing)"


def _model_coverage(
    registry: Registry, offer: ModelOffer, states: dict[NodeId, msg.NodeState]
) -> msg.ModelCoverage:
    serving: list[list[str]] = [[] for _ in range(offer.num_layers)]
    loading: list[list[str]] = [[] for _ in range(offer.num_layers)]
    for node_id, r in sorted(registry.nodes.items()):
        if states[node_id] in ("late", "suspect"):
            continue
        for m, span in r.loaded | r.assigned:
            if m == offer.model:
                target = serving if (m, span) in r.loaded else loading
                for layer in span:
                    target[layer].append(node_id)
    served = [(LayerSpan(i, i + 1), 1.0) for i in range(offer.num_layers) if serving[i]]
    return msg.ModelCoverage(
        model=offer.model,
        num_layers=offer.num_layers,
        layers=[
            msg.LayerCoverage(layer=i, serving=serving[i], loading=loading[i])
            for i in range(offer.num_layers)
        ],
        gaps=gaps(offer.num_layers, served),
        routable=_routable(offer.model, offer.num_layers, servers(registry, offer.model)),
        digest=registry.digests.get(offer.model),
    )


def layers_covered(registry: Registry) -> dict[str, int]:
    """Layers of each model served by a live node (the `meshnet_layers_covered` gauge)."""
    report = coverage(registry)
    return {m.model: sum(1 for layer in m.layers if layer.serving) for m in report.models}


def _routable(model: ModelId, num_layers: int, live: list[Server]) -> bool:
    try:
        choose_route(model, num_layers, live, 0, random.Random(0))
    except RouteError:
        return False
    return True


def issued(registry: Registry) -> list[msg.IssuedDirective]:
    """The directives issued lately, oldest first, with their ages."""
    with registry.lock:
        now, recent = registry.clock(), list(registry.recent)
    return [
        msg.IssuedDirective(
            node_id=d.node_id, op=d.op, model=d.model, span=d.span, reason=d.reason,
            age_s=round(now - at, 3),
        )
        for at, d in recent
    ]  # fmt: skip
