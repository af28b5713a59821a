"""The planner before issue #18 (ADR-0013), kept as the churn benchmark's baseline.

Coverage first from free budget only; redundancy only as exact copies of existing spans on
idle nodes; DROP only for models no longer offered. Not used by the tracker.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from meshnet.tracker.layout import Directive, ModelOffer, NodeView
from meshnet.tracker.planner import gaps
from meshnet.types import LayerSpan, ModelId, NodeId


def baseline_plan(models: Sequence[ModelOffer], nodes: Sequence[NodeView]) -> list[Directive]:
    """The directives that move `nodes` towards full coverage, then redundancy."""
    offers = {m.model: m for m in models}
    nodes = sorted(nodes, key=lambda n: n.node_id)
    free = {n.node_id: n.budget_bytes - _used(n, offers) for n in nodes}
    holders = _holders(nodes, offers)
    directives = _drops(nodes, offers, holders)
    for offer in sorted(models, key=lambda m: m.model):
        for gap in gaps(offer.num_layers, holders.get(offer.model, [])):
            directives += _fill(offer, gap, nodes, free, holders)
    if not any(gaps(m.num_layers, holders.get(m.model, [])) for m in models):
        taken = {d.node_id for d in directives}
        idle = [n for n in nodes if not n.holdings and n.node_id not in taken]
        directives += _replicate(offers, idle, free, holders)
    return directives


def _used(node: NodeView, offers: Mapping[ModelId, ModelOffer]) -> int:
    return sum(
        len(h.span) * offers[h.model].layer_bytes[node.quant]
        for h in node.holdings
        if h.model in offers
    )


def _holders(
    nodes: Iterable[NodeView], offers: Mapping[ModelId, ModelOffer]
) -> dict[ModelId, list[tuple[LayerSpan, float]]]:
    """model -> (span, throughput) of every holding, loaded or loading."""
    found: dict[ModelId, list[tuple[LayerSpan, float]]] = {}
    for node in nodes:
        for h in node.holdings:
            if h.model in offers:
                found.setdefault(h.model, []).append((h.span, node.throughput))
    return found


def _capacity(node: NodeView, offer: ModelOffer, free: Mapping[NodeId, int]) -> int:
    """Layers of `offer` that still fit `node`'s free budget (0 if it may not serve it)."""
    if node.models is not None and offer.model not in node.models:
        return 0
    per_layer = offer.layer_bytes.get(node.quant)
    if not per_layer:
        return 0
    return max(0, free[node.node_id]) // per_layer


def _fill(
    offer: ModelOffer,
    gap: LayerSpan,
    nodes: Sequence[NodeView],
    free: dict[NodeId, int],
    holders: dict[ModelId, list[tuple[LayerSpan, float]]],
) -> list[Directive]:
    """Close `gap` with as few spans as possible; idle nodes first, best fit first."""
    out: list[Directive] = []
    start = gap.start
    busy = {n.node_id for n in nodes if n.holdings}
    while start < gap.end:
        need = gap.end - start
        pick = _best_fit(offer, need, start, nodes, free, busy)
        if pick is None:
            break  # no node has room: the gap stays, and no redundancy is added anywhere
        node, layers = pick
        span = LayerSpan(start, start + layers)
        free[node.node_id] -= layers * offer.layer_bytes[node.quant]
        busy.add(node.node_id)
        holders.setdefault(offer.model, []).append((span, node.throughput))
        out.append(
            Directive(
                "LOAD_SHARD",
                node.node_id,
                offer.model,
                span,
                f"closes gap {gap} of {offer.model} (layers {span})",
            )
        )
        start = span.end
    return out


def _best_fit(
    offer: ModelOffer,
    need: int,
    start: int,
    nodes: Sequence[NodeView],
    free: Mapping[NodeId, int],
    busy: set[NodeId],
) -> tuple[NodeView, int] | None:
    """The node for the next piece of a gap and how many layers it takes.

    Idle nodes before busy ones; among them the smallest that holds the whole rest of the
    gap (least waste, one hop), else the largest (longest span, fewest hops); ties go to the
    lowest node id. One pass over the nodes, no sorting: this runs once per piece of a gap.
    """
    for pool in (False, True):
        fit: tuple[int, str, NodeView] | None = None  # smallest cap >= need
        largest: tuple[int, str, NodeView] | None = None  # largest cap (then lowest id)
        for n in nodes:
            if (n.node_id in busy) != pool:
                continue
            cap = _capacity(n, offer, free)
            if cap <= 0 or (n.failed and _failed(n, offer, start, min(need, cap))):
                continue
            if cap >= need and (fit is None or (cap, n.node_id) < fit[:2]):
                fit = (cap, n.node_id, n)
            if largest is None or (-cap, n.node_id) < (-largest[0], largest[1]):
                largest = (cap, n.node_id, n)
        choice = fit or largest
        if choice is not None:
            return choice[2], min(choice[0], need)
    return None


def _failed(node: NodeView, offer: ModelOffer, start: int, layers: int) -> bool:
    return (offer.model, LayerSpan(start, start + layers)) in node.failed


def _replicate(
    offers: Mapping[ModelId, ModelOffer],
    idle: Sequence[NodeView],
    free: dict[NodeId, int],
    holders: dict[ModelId, list[tuple[LayerSpan, float]]],
) -> list[Directive]:
    """Give each idle node a copy of the existing span with the fewest copies that fits it.

    Ties go to the least summed throughput. Copies come first because redundancy is what a
    replica is for: one fast copy does not survive its node's death; start-up throughput
    figures are also noisy enough to pile every replica on one span.
    """
    out: list[Directive] = []
    spans = sorted({(m, s) for m, held in holders.items() for s, _ in held})
    capacity = {(m, s): sum(t for s2, t in holders[m] if s2 == s) for m, s in spans}
    copies = {(m, s): sum(1 for s2, _ in holders[m] if s2 == s) for m, s in spans}
    cost = {(m, s): {q: len(s) * b for q, b in offers[m].layer_bytes.items()} for m, s in spans}
    cheapest: dict[str, int] = {}  # quant -> smallest span cost: most idle nodes fail this test
    for by_quant in cost.values():
        for quant, size in by_quant.items():
            cheapest[quant] = min(size, cheapest.get(quant, size))
    for node in sorted(idle, key=lambda n: (-n.budget_bytes, n.node_id)):
        if free[node.node_id] < cheapest.get(node.quant, free[node.node_id] + 1):
            continue
        room = free[node.node_id]
        fits = [
            (copies[key], capacity[key], key)
            for key in spans
            if cost[key].get(node.quant, room + 1) <= room
            and (node.models is None or key[0] in node.models)
            and key not in node.failed
        ]
        if not fits:
            continue
        fewest, weakest, (model, span) = min(fits)
        free[node.node_id] -= cost[(model, span)][node.quant]
        capacity[(model, span)] += node.throughput
        copies[(model, span)] += 1
        out.append(
            Directive(
                "LOAD_SHARD",
                node.node_id,
                model,
                span,
                f"adds a replica of {model} layers {span}, the least served "
                f"({fewest} copies, capacity {weakest:g})",
            )
        )
    return out


def _drops(
    nodes: Sequence[NodeView],
    offers: Mapping[ModelId, ModelOffer],
    holders: dict[ModelId, list[tuple[LayerSpan, float]]],
) -> list[Directive]:
    """Drop holdings of models no longer offered (nothing else depends on them)."""
    return [
        Directive("DROP_SHARD", n.node_id, h.model, h.span, f"model {h.model} is no longer offered")
        for n in nodes
        for h in n.holdings
        if h.model not in offers
    ]
