"""Read-only views of the registry: the coverage map and routes."""

from __future__ import annotations

import random

from meshnet.errors import RequestError, RouteError, UnknownModelError
from meshnet.tracker import messages as msg
from meshnet.tracker.planner import gaps
from meshnet.tracker.registry import Registry
from meshnet.tracker.routing import Server, choose_route
from meshnet.types import ModelId


def servers(
    registry: Registry, model: ModelId, exclude: frozenset[str] = frozenset()
) -> list[Server]:
    """Every loaded span of `model` on nodes not excluded or reported failing."""
    return [
        Server(node_id, r.request.address, span, r.request.throughput, r.sessions)
        for node_id, r in sorted(registry.nodes.items())
        if node_id not in exclude and not r.suspect
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
    live = servers(registry, offer.model, exclude)
    hops = choose_route(offer.model, offer.num_layers, live, start, rng, end)
    return msg.RouteResponse(
        model=model,
        hops=[msg.RouteHop(node_id=h.node_id, address=h.address, span=h.span) for h in hops],
    )


def coverage(registry: Registry) -> msg.CoverageResponse:
    now = registry.clock()
    models = []
    for model_id, offer in sorted(registry.offers.items()):
        serving: list[list[str]] = [[] for _ in range(offer.num_layers)]
        loading: list[list[str]] = [[] for _ in range(offer.num_layers)]
        for node_id, r in sorted(registry.nodes.items()):
            for m, span in r.loaded | r.assigned:
                if m == model_id and not r.suspect:
                    target = serving if (m, span) in r.loaded else loading
                    for layer in span:
                        target[layer].append(node_id)
        live = servers(registry, model_id)
        models.append(
            msg.ModelCoverage(
                model=model_id,
                num_layers=offer.num_layers,
                layers=[
                    msg.LayerCoverage(layer=i, serving=serving[i], loading=loading[i])
                    for i in range(offer.num_layers)
                ],
                gaps=gaps(offer.num_layers, [(s.span, 1.0) for s in live]),
                routable=_routable(offer.model, offer.num_layers, live),
            )
        )
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
            last_heartbeat_age_s=round(now - r.last_seen_s, 3),
            suspect=r.suspect,
        )
        for n, r in sorted(registry.nodes.items())
    ]
    return msg.CoverageResponse(
        models=models,
        nodes=nodes,
        recent_directives=[registry.to_message(d) for d in registry.recent],
    )


def _routable(model: ModelId, num_layers: int, live: list[Server]) -> bool:
    try:
        choose_route(model, num_layers, live, 0, random.Random(0))
    except RouteError:
        return False
    return True
