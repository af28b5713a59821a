"""Redundancy once every model is covered: nodes with room copy the weakest layers.

Each node with room (idle ones first, then the largest free budget) takes one span of the
model whose weakest layer has the fewest copies, then the least serving strength (summed
throughput, lowered by the sessions each copy holds). The span starts where chains already
arrive (the end of a holding, or layer 0 for an entry node) and covers that weakest layer.
It ends where a chain goes on (the start of a holding, or the last layer) when that uses at
least half the node's room, else as far as the room goes: the next small node then starts
there, so small nodes build a second chain in finer spans instead of staying idle. A node
copies only models it does not hold yet: when it dies, a second copy on it dies too.

Entries come first: while a model has fewer than `MIN_ENTRIES` entries, an entry node with
room for the head and the layers up to where a chain goes on takes that span and becomes
one; an entry node with nothing else to copy starts a second chain from layer 0. Other
copies start after the entries' span: routes start there, so a copy of the layers an entry
runs with its head would serve nobody.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from meshnet.tracker.layout import Layout, NodeView
from meshnet.types import LayerSpan, ModelId

MIN_ENTRIES = 2  # per model, where budgets allow: clients keep a door when one dies


def level(layout: Layout) -> None:
    """Give every node with room one more span (idle nodes first), where it adds the most
    redundancy. One span per node a plan: a node that still has room after it has loaded
    gets the next at the next plan, so nodes fill up step by step."""
    smallest: dict[str, int] = {}  # quant -> the smallest layer any model has at it
    for offer in layout.offers.values():
        for quant, size in offer.layer_bytes.items():
            smallest[quant] = (
                min(size, smallest.get(quant, size)) if size else smallest.get(quant, 0)
            )
    ready = [
        n
        for n in layout.order
        if n.node_id not in layout.taken and 0 < smallest.get(n.quant, 0) <= layout.free[n.node_id]
    ]
    for node in sorted(
        ready, key=lambda n: (bool(layout.by_node[n.node_id]), -layout.free[n.node_id], n.node_id)
    ):
        if node.entry and _add_entry(layout, node, joins=True):
            continue
        choice = _weakest_model(layout, node)
        if choice is None:
            if node.entry:  # nothing else to copy: start a second chain with an entry
                _add_entry(layout, node, joins=False)
            continue
        model, low = choice
        span = _span(layout, node, model, low)
        if (model, span) in node.failed:
            continue
        copies = layout.copies[model][span.start : span.end]
        layout.load(
            node,
            model,
            span,
            f"adds a replica of {model} layers {span}, the least served "
            f"({min(copies)} copies before)",
        )


def _add_entry(layout: Layout, node: NodeView, *, joins: bool) -> bool:
    """Make `node` an entry of a model short of entries, fewest first; True when it did.
    With `joins`, only with a span that ends where a chain goes on (an entry at once)."""
    held = {m for m, _ in layout.by_node[node.node_id]}
    short = sorted((layout.entries(m), m) for m in layout.offers if m not in held)
    for count, model in short:
        if count >= MIN_ENTRIES:
            break
        span = _entry_span(layout, node, model, joins)
        if span is None or (model, span) in node.failed:
            continue
        layout.load(node, model, span, f"makes {node.node_id} an entry of {model} ({count} before)")
        return True
    return False


def _entry_span(layout: Layout, node: NodeView, model: ModelId, joins: bool) -> LayerSpan | None:
    """From layer 0 to where a chain goes on, else (unless `joins`) as far as `node`'s room
    goes: the next nodes build the rest of a second chain from there. None when its room
    holds no layer beside the head."""
    room = min(layout.room(node, model, 0), layout.offers[model].num_layers)
    if room < 1:
        return None
    onward = max([p for p in layout.continues(model) if 0 < p <= room], default=0)
    if onward:
        return LayerSpan(0, onward)
    return None if joins else LayerSpan(0, room)


def floor(layout: Layout, model: ModelId) -> int:
    """The first layer worth copying: after the entries' span (their own: see `_add_entry`)."""
    return layout.entry_end(model) or 1


def _weakest_model(layout: Layout, node: NodeView) -> tuple[ModelId, int] | None:
    """(model, first copyable layer) whose weakest copyable layer has the fewest copies; among
    those the smallest model (its redundancy is the cheapest), then the least strength."""
    best: tuple[tuple[int, int, float, str], ModelId, int] | None = None
    held = {m for m, _ in layout.by_node[node.node_id]}  # a second copy there adds nothing
    for model, offer in layout.offers.items():
        if model in held:
            continue
        low = floor(layout, model)
        if low >= offer.num_layers or layout.capacity(node, model) < 1:
            continue
        copies, strength, _ = layout.weakest(model, low)
        size = offer.num_layers * layout.per_layer(node, model)  # cheap redundancy first
        rank = (copies, size, strength, str(model))
        if best is None or rank < best[0]:
            best = (rank, model, low)
    return None if best is None else (best[1], best[2])


def _span(layout: Layout, node: NodeView, model: ModelId, low: int) -> LayerSpan:
    """The span `node` copies: from an arrival point, over the weakest layer (see module)."""
    layers = layout.offers[model].num_layers
    fewest, _, weakest = layout.weakest(model, low)
    cap = layout.capacity(node, model)
    ends, starts = layout.boundaries(model)
    arrivals = ends[bisect_left(ends, max(low, weakest - cap + 1)) : bisect_right(ends, weakest)]
    if low <= weakest and low > weakest - cap:
        arrivals.append(low)
    if not arrivals:  # too small to reach it from any arrival: build towards it
        arrivals = [max([a for a in ends if low <= a <= weakest] + [low])]
    weak = [0]  # weak[i]: layers below i with only `fewest` copies
    for c in layout.copies[model]:
        weak.append(weak[-1] + (c == fewest))
    start = max(arrivals, key=lambda a: (weak[min(a + cap, layers)] - weak[a], -a))
    most = min(start + cap, layers)
    below = bisect_right(starts, most) - 1  # the last holding start within reach
    joins = most if most == layers or below < 0 or starts[below] <= start else starts[below]
    end = joins if 2 * (joins - start) >= most - start else most
    return LayerSpan(start, end)
