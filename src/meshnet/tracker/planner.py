"""Shard assignment: a pure function from (models, nodes) to rebalance directives (ADR-0009).

1. Holdings of models no longer offered are dropped, and so are non-entry copies of an entry's
   head span (no route starts there), when other copies keep every layer.
2. Coverage first: every gap of every model is closed from free budget, idle nodes first.
3. Repair: while a model has no chain from layer 0 to its last layer, the break is closed
   from free budget, else on nodes that drop redundant copies to make room; never the last
   copy of a layer, never a copy some chain needs.
4. Only when every model has a chain, idle nodes add redundancy where it is weakest
   (`replicas.level`), in spans that line up with the chains, finer for small nodes.

Budgets are never over-committed; same input, same plan. A mesh whose plan was carried out
plans nothing new but work for nodes that are still idle: no move without a reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from meshnet.tracker import repair, replicas
from meshnet.tracker.layout import (
    Directive,
    Holding,
    Layout,
    ModelOffer,
    NodeView,
    first_break,
)
from meshnet.types import LayerSpan, ModelId, NodeId

__all__ = ["Directive", "Holding", "ModelOffer", "NodeView", "gaps", "plan", "with_directives"]


def plan(models: Sequence[ModelOffer], nodes: Sequence[NodeView]) -> list[Directive]:
    """The directives that move `nodes` towards chains for every model, then redundancy."""
    offers = {m.model: m for m in sorted(models, key=lambda m: m.model)}
    layout = Layout(offers, nodes)
    _drop_unoffered(layout)
    for offer in offers.values():
        for gap in gaps(offer.num_layers, [(s, 1.0) for s in layout.spans(offer.model)]):
            repair.fill(layout, offer, gap, f"closes gap {gap} of {offer.model}")
    broken = [o for o in offers.values() if not _repair(layout, o)]
    if not broken:
        _drop_head_copies(layout)
        replicas.level(layout)
    return layout.directives


def _repair(layout: Layout, offer: ModelOffer) -> bool:
    """Close the breaks in `offer`'s chains; True when a chain runs through all its layers."""
    for _ in range(offer.num_layers):  # each round places at least one layer, or stops
        hole = first_break(offer.num_layers, layout.spans(offer.model))
        if hole is None:
            return True
        reason = f"closes gap {hole} of {offer.model}"
        if not repair.fill(layout, offer, hole, reason) and not repair.reclaim(
            layout, offer, hole, reason
        ):
            return False
    return first_break(offer.num_layers, layout.spans(offer.model)) is None


def _drop_unoffered(layout: Layout) -> None:
    for node in layout.order:
        for h in node.holdings:
            if h.model not in layout.offers:
                layout.directives.append(
                    Directive(
                        "DROP_SHARD",
                        node.node_id,
                        h.model,
                        h.span,
                        f"model {h.model} is no longer offered",
                    )
                )


def _drop_head_copies(layout: Layout) -> None:
    """Drop non-entry copies of layers only entries can use (routes start after them)."""
    for model in layout.offers:
        entry_end = layout.entry_end(model)
        if entry_end is None:
            continue
        for hold in list(layout.holds[model]):
            node = layout.nodes[hold.node_id]
            if hold.span.start < entry_end and not node.entry and layout.redundant(model, hold):
                layout.drop(
                    model,
                    hold,
                    f"no route can use it: routes start after the entries' span 0:{entry_end}",
                )


def with_directives(nodes: Sequence[NodeView], directives: Iterable[Directive]) -> list[NodeView]:
    """`nodes` as they will be once every DROP is done and every LOAD is loading."""
    extra: dict[NodeId, list[Holding]] = {}
    gone: set[tuple[NodeId, ModelId, LayerSpan]] = set()
    for d in directives:
        if d.op == "LOAD_SHARD":
            extra.setdefault(d.node_id, []).append(Holding(d.model, d.span, loaded=False))
        else:
            gone.add((d.node_id, d.model, d.span))
    return [
        replace(
            n,
            holdings=tuple(h for h in n.holdings if (n.node_id, h.model, h.span) not in gone)
            + tuple(extra.get(n.node_id, ())),
        )
        for n in nodes
    ]


def gaps(num_layers: int, held: Iterable[tuple[LayerSpan, float]]) -> list[LayerSpan]:
    """Maximal runs of layers that no holding covers (a sweep over the distinct spans)."""
    runs, reached = [], 0  # every layer below `reached` is covered
    for start, end in sorted({(span.start, span.end) for span, _ in held}):
        if start > reached:
            runs.append(LayerSpan(reached, min(start, num_layers)))
        reached = max(reached, end)
        if reached >= num_layers:
            break
    if reached < num_layers:
        runs.append(LayerSpan(reached, num_layers))
    return [r for r in runs if r.start < num_layers]
