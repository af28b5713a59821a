"""Closing gaps: free budget first, then room made by dropping redundant copies.

A gap is a run of layers that a new chain of spans must cover, from a position chains
already reach to one from which they reach the last layer, so whatever closes it lines up.
Pieces start at the gap's start and run as far as the chosen node's room allows.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from meshnet.tracker.layout import Hold, Layout, ModelOffer, NodeView
from meshnet.types import LayerSpan, ModelId, NodeId

Room = Callable[[NodeView], int]  # layers a node could take for this gap


def fill(layout: Layout, offer: ModelOffer, gap: LayerSpan, reason: str) -> int:
    """Close as much of `gap` as free budget allows; returns the layers placed."""
    start = gap.start
    while start < gap.end:
        need = gap.end - start
        pick = best_fit(
            layout, offer, need, start, partial(layout.room, model=offer.model, start=start)
        )
        if pick is None:
            break
        node, layers = pick
        span = LayerSpan(start, start + layers)
        layout.load(node, offer.model, span, f"{reason} (layers {span})")
        start = span.end
    return start - gap.start


def reclaim(layout: Layout, offer: ModelOffer, gap: LayerSpan, reason: str) -> int:
    """Close `gap` on nodes that drop redundant copies to make room; returns layers placed.

    Never drops the last copy of a layer or a copy that some chain needs (`Layout.redundant`).
    """
    start = gap.start
    while start < gap.end:
        need = gap.end - start
        spare = {
            n.node_id: sum(layout.bytes_of(m, h) for m, h in _spare(layout, n))
            for n in layout.order
            if layout.per_layer(n, offer.model)
        }
        room = _room(layout, offer, start, spare)
        pick = best_fit(layout, offer, need, start, room, idle_first=False)
        if pick is None:
            break
        node, layers = pick
        _make_room(layout, offer, node, layers, start, gap)
        layers = min(layers, layout.room(node, offer.model, start))
        if layers <= 0:
            break
        span = LayerSpan(start, start + layers)
        layout.load(node, offer.model, span, f"{reason} (layers {span}, in room made by drops)")
        start = span.end
    return start - gap.start


def best_fit(
    layout: Layout,
    offer: ModelOffer,
    need: int,
    start: int,
    room: Room,
    *,
    idle_first: bool = True,
) -> tuple[NodeView, int] | None:
    """The node for the next piece of a gap and how many layers it takes.

    Idle nodes before busy ones (when `idle_first`), and in each, nodes that already hold
    the model's weights before those that would fetch them (ADR-0054); among them the
    smallest that holds the whole rest of the gap (least waste, one hop), else the largest
    (longest span, fewest hops); ties go to the lowest node id. One pass per pool.
    """
    idle = (True, False) if idle_first else (None,)
    for pool, holds in ((p, h) for p in idle for h in (True, False)):
        fit: tuple[int, str, NodeView] | None = None  # smallest room >= need
        largest: tuple[int, str, NodeView] | None = None  # largest room (then lowest id)
        for n in layout.order:
            if pool is not None and layout.idle(n.node_id) != pool:
                continue
            if (offer.model in n.weights) != holds:
                continue
            cap = room(n)
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


def _room(layout: Layout, offer: ModelOffer, start: int, spare: dict[NodeId, int]) -> Room:
    """Layers from `start` a node could take once its redundant copies (`spare` bytes) go."""

    def room(node: NodeView) -> int:
        extra = spare.get(node.node_id, 0)
        return layout.room(node, offer.model, start, extra) if extra else 0

    return room


def _failed(node: NodeView, offer: ModelOffer, start: int, layers: int) -> bool:
    return (offer.model, LayerSpan(start, start + layers)) in node.failed


def _spare(layout: Layout, node: NodeView) -> list[tuple[ModelId, Hold]]:
    """`node`'s holdings that could go, most-copied first (each checked on its own)."""
    found = [(m, h) for m, h in layout.by_node[node.node_id] if layout.redundant(m, h)]
    return sorted(
        found, key=lambda mh: (-min(layout.copies[mh[0]][i] for i in mh[1].span), mh[0], mh[1].span)
    )


def _make_room(
    layout: Layout, offer: ModelOffer, node: NodeView, layers: int, start: int, gap: LayerSpan
) -> None:
    """Drop `node`'s redundant copies, most-copied first, until `layers` of `offer` from
    layer `start` fit."""
    for model, hold in _spare(layout, node):
        if layout.room(node, offer.model, start) >= layers:
            return
        if layout.redundant(model, hold):  # re-checked: an earlier drop may have changed it
            left = min(layout.copies[model][i] for i in hold.span) - 1
            layout.drop(
                model,
                hold,
                f"makes room for gap {gap} of {offer.model}: a redundant copy "
                f"({left} other cop{'y' if left == 1 else 'ies'} of each layer stay)",
            )
