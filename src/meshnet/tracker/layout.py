"""What the planner knows of the mesh, and the layout it changes while it plans.

`NodeView`s and `ModelOffer`s are its input. `Layout` is one plan's working state: every
holding (loaded or loading) per model, free bytes per node, copies and serving strength per
layer, and the directives issued so far. Every LOAD or DROP goes through it, so the state
and the directives never disagree. Nothing here reads a clock or a random generator.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from meshnet.types import LayerSpan, ModelId, NodeId


@dataclass(frozen=True)
class ModelOffer:
    """A model the tracker offers: its depth, bytes per layer and of the head per quant."""

    model: ModelId
    num_layers: int
    layer_bytes: Mapping[str, int]  # quant -> bytes of one layer's weights
    # quant -> bytes of embeddings, final norm and LM head, which an entry holds beside 0:k
    head_bytes: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Holding:
    """A span a node serves (`loaded`) or was told to load."""

    model: ModelId
    span: LayerSpan
    loaded: bool = True


@dataclass(frozen=True)
class NodeView:
    """What the planner knows of a node."""

    node_id: NodeId
    budget_bytes: int  # for weights, after the node's KV-cache reserve
    quant: str
    throughput: float  # relative speed; higher is faster
    holdings: tuple[Holding, ...] = ()
    models: frozenset[ModelId] | None = None  # None: any offered model
    failed: frozenset[tuple[ModelId, LayerSpan]] = field(default_factory=frozenset)
    # may serve clients: its holdings from layer 0 run with the head, and only such nodes
    # get spans from layer 0 (entry spans)
    entry: bool = True
    keeps_entry: bool = False  # its entry span was given by hand (`--layers 0:K`): it stays
    sessions: int = 0  # sessions it holds now
    refused: frozenset[ModelId] = frozenset()  # its copy differs from the offered one: none
    weights: frozenset[ModelId] = frozenset()  # models whose weights it holds (no fetch)


@dataclass(frozen=True)
class Directive:
    """`LOAD_SHARD` or `DROP_SHARD` for one node, with the reason shown to operators."""

    op: str
    node_id: NodeId
    model: ModelId
    span: LayerSpan
    reason: str


@dataclass(frozen=True)
class Hold:
    """One holding inside a `Layout`: whose, which layers, loaded or still loading."""

    node_id: NodeId
    span: LayerSpan
    loaded: bool


class Layout:
    """One plan's view of the mesh, changed only by `load` and `drop`."""

    def __init__(self, offers: Mapping[ModelId, ModelOffer], nodes: Sequence[NodeView]) -> None:
        self.offers = offers
        self.order = sorted(nodes, key=lambda n: n.node_id)
        self.nodes = {n.node_id: n for n in self.order}
        self.holds: dict[ModelId, list[Hold]] = {m: [] for m in offers}
        self.by_node: dict[NodeId, list[tuple[ModelId, Hold]]] = {n.node_id: [] for n in self.order}
        self.free = {n.node_id: n.budget_bytes for n in self.order}
        self.copies = {m: [0] * o.num_layers for m, o in offers.items()}  # per layer
        self.strength = {m: [0.0] * o.num_layers for m, o in offers.items()}  # summed speed
        self.same: dict[ModelId, Counter[tuple[LayerSpan, bool]]] = {m: Counter() for m in offers}
        self.live = {m: [0] * o.num_layers for m, o in offers.items()}  # loaded copies
        self._reach: dict[tuple[ModelId, bool], set[int]] = {}  # until holdings change
        self._weakest: dict[tuple[ModelId, int], tuple[int, float, int]] = {}  # ditto
        self._entry_end: dict[ModelId, int | None] = {}  # ditto
        self._bounds: dict[ModelId, tuple[list[int], list[int]]] = {}  # ditto
        self.directives: list[Directive] = []
        self.taken: set[NodeId] = set()  # nodes this plan gave a LOAD
        self._start(nodes)

    def _start(self, nodes: Sequence[NodeView]) -> None:
        """Take in the nodes' holdings at once (difference arrays: O(holdings + layers))."""
        steps = {  # per model: +1/-1 at span edges for copies, loaded copies, speed
            m: ([0] * (o.num_layers + 1), [0] * (o.num_layers + 1), [0.0] * (o.num_layers + 1))
            for m, o in self.offers.items()
        }
        for n in self.order:
            speed = n.throughput / (1 + n.sessions)
            for h in n.holdings:
                if h.model not in self.offers:
                    continue
                hold = Hold(n.node_id, h.span, h.loaded)
                self.holds[h.model].append(hold)
                self.by_node[n.node_id].append((h.model, hold))
                self.same[h.model][(h.span, h.loaded)] += 1
                self.free[n.node_id] -= self.bytes_of(h.model, hold)
                count, live, speeds = steps[h.model]
                end = min(h.span.end, len(count) - 1)
                for edge, sign in ((h.span.start, 1), (end, -1)):
                    count[edge] += sign
                    live[edge] += sign if h.loaded else 0
                    speeds[edge] += sign * speed
        for m, (count, live, speeds) in steps.items():
            running, loaded, total = 0, 0, 0.0
            for i in range(len(self.copies[m])):
                running, loaded, total = running + count[i], loaded + live[i], total + speeds[i]
                self.copies[m][i], self.live[m][i], self.strength[m][i] = running, loaded, total

    def spans(self, model: ModelId) -> list[LayerSpan]:
        return [h.span for h in self.holds[model]]

    def idle(self, node_id: NodeId) -> bool:
        return node_id not in self.taken and not self.by_node[node_id]

    def entries(self, model: ModelId) -> int:
        """Entry nodes holding (or loading) a span of `model` from layer 0."""
        return len({h.node_id for h in self.holds[model] if self._entry_hold(h)})

    def _entry_hold(self, hold: Hold) -> bool:
        return hold.span.start == 0 and self.nodes[hold.node_id].entry

    def _other_entry(self, model: ModelId, hold: Hold) -> bool:
        """Whether another (loaded, when `hold` is) entry span of `model` stays without it;
        never for an entry span given by hand."""
        if self.nodes[hold.node_id].keeps_entry:
            return False
        return any(
            h.node_id != hold.node_id and self._entry_hold(h) and (h.loaded or not hold.loaded)
            for h in self.holds[model]
        )

    def entry_end(self, model: ModelId) -> int | None:
        """Where routes from this model's entries start (the shortest entry span), or None."""
        if model not in self._entry_end:
            ends = [h.span.end for h in self.holds[model] if self._entry_hold(h)]
            self._entry_end[model] = min(ends) if ends else None
        return self._entry_end[model]

    def boundaries(self, model: ModelId) -> tuple[list[int], list[int]]:
        """(sorted distinct ends, sorted distinct starts) of `model`'s holdings."""
        if model not in self._bounds:
            holds = self.holds[model]
            self._bounds[model] = (
                sorted({h.span.end for h in holds}),
                sorted({h.span.start for h in holds}),
            )
        return self._bounds[model]

    def weakest(self, model: ModelId, low: int) -> tuple[int, float, int]:
        """(copies, strength, layer) of the weakest layer of `model` from `low` on."""
        key = (model, low)
        if key not in self._weakest:
            copies, strength = self.copies[model], self.strength[model]
            self._weakest[key] = min((copies[i], strength[i], i) for i in range(low, len(copies)))
        return self._weakest[key]

    def per_layer(self, node: NodeView, model: ModelId) -> int:
        """Bytes of one layer of `model` on `node`, 0 when it may not serve the model."""
        if (node.models is not None and model not in node.models) or model in node.refused:
            return 0
        return self.offers[model].layer_bytes.get(node.quant, 0)

    def capacity(self, node: NodeView, model: ModelId, extra_bytes: int = 0) -> int:
        """Layers of `model` that fit `node`'s free budget (plus `extra_bytes`)."""
        per_layer = self.per_layer(node, model)
        return max(0, self.free[node.node_id] + extra_bytes) // per_layer if per_layer else 0

    def room(self, node: NodeView, model: ModelId, start: int, extra_bytes: int = 0) -> int:
        """Layers of `model` from layer `start` that fit `node`: a span from layer 0 is an
        entry span, only for entry nodes, and its head takes room first."""
        if start > 0:
            return self.capacity(node, model, extra_bytes)
        if not node.entry:
            return 0
        head = self.offers[model].head_bytes.get(node.quant, 0)
        return self.capacity(node, model, extra_bytes - head)

    def continues(self, model: ModelId) -> set[int]:
        """Positions from which a chain of `model`'s holdings reaches its last layer."""
        return reach_back(self.offers[model].num_layers, self.spans(model))

    def load(self, node: NodeView, model: ModelId, span: LayerSpan, reason: str) -> None:
        self._add(model, Hold(node.node_id, span, False))
        self.taken.add(node.node_id)
        self.directives.append(Directive("LOAD_SHARD", node.node_id, model, span, reason))

    def drop(self, model: ModelId, hold: Hold, reason: str) -> None:
        self.holds[model].remove(hold)
        self.by_node[hold.node_id].remove((model, hold))
        self.same[model][(hold.span, hold.loaded)] -= 1
        self._changed(model)
        self.free[hold.node_id] += self.bytes_of(model, hold)
        self._count(model, hold, -1)
        self.directives.append(Directive("DROP_SHARD", hold.node_id, model, hold.span, reason))

    def redundant(self, model: ModelId, hold: Hold) -> bool:
        """Whether `hold` can go: every layer keeps a copy and the chains stay as they are.

        A loaded copy is judged against the other loaded copies only (a copy still loading
        serves nobody yet), so sessions on it always have a loaded copy to fail over to.
        """
        if self._entry_hold(hold) and not self._other_entry(model, hold):
            return False  # the last door to the model
        copies = self.live[model] if hold.loaded else self.copies[model]
        if any(copies[i] < 2 for i in hold.span):
            return False  # the last (loaded) copy of some layer
        same = self.same[model]
        twins = same[(hold.span, True)] + (0 if hold.loaded else same[(hold.span, False)]) - 1
        if twins > 0:
            return True  # an identical copy stays: coverage and chains do not change
        others = [h for h in self.holds[model] if h is not hold and (h.loaded or not hold.loaded)]
        layers = self.offers[model].num_layers
        key = (model, hold.loaded)
        if key not in self._reach:
            pool = [h.span for h in self.holds[model] if h.loaded or not hold.loaded]
            self._reach[key] = reach(layers, pool)
        return reach(layers, [o.span for o in others]) >= self._reach[key]

    def _changed(self, model: ModelId) -> None:
        self._reach.pop((model, True), None)
        self._reach.pop((model, False), None)
        self._entry_end.pop(model, None)
        self._bounds.pop(model, None)
        for key in [k for k in self._weakest if k[0] == model]:
            del self._weakest[key]

    def _add(self, model: ModelId, hold: Hold) -> None:
        self.holds[model].append(hold)
        self.by_node[hold.node_id].append((model, hold))
        self.same[model][(hold.span, hold.loaded)] += 1
        self._changed(model)
        self.free[hold.node_id] -= self.bytes_of(model, hold)
        self._count(model, hold, 1)

    def bytes_of(self, model: ModelId, hold: Hold) -> int:
        """Bytes `hold` takes of its node's budget: its layers, and the head for an entry span."""
        quant = self.nodes[hold.node_id].quant
        offer = self.offers[model]
        head = offer.head_bytes.get(quant, 0) if self._entry_hold(hold) else 0
        return len(hold.span) * offer.layer_bytes.get(quant, 0) + head

    def _count(self, model: ModelId, hold: Hold, sign: int) -> None:
        node = self.nodes[hold.node_id]
        speed = node.throughput / (1 + node.sessions)  # load per copy lowers its strength
        copies, strength, live = self.copies[model], self.strength[model], self.live[model]
        for i in hold.span:
            if i < len(copies):
                copies[i] += sign
                strength[i] += sign * speed
                live[i] += sign if hold.loaded else 0


def reach(num_layers: int, spans: Iterable[LayerSpan]) -> set[int]:
    """Positions a chain of `spans` can reach from layer 0 (0 itself included)."""
    by_start: dict[int, list[int]] = {}
    for s in spans:
        by_start.setdefault(s.start, []).append(min(s.end, num_layers))
    reached, frontier = {0}, [0]
    while frontier:
        position = frontier.pop()
        for end in by_start.get(position, ()):
            if end not in reached:
                reached.add(end)
                frontier.append(end)
    return reached


def reach_back(num_layers: int, spans: Iterable[LayerSpan]) -> set[int]:
    """Positions from which a chain of `spans` reaches the last layer (it included)."""
    mirrored = [LayerSpan(num_layers - min(s.end, num_layers), num_layers - s.start) for s in spans]
    return {num_layers - p for p in reach(num_layers, mirrored)}


def first_break(num_layers: int, spans: Sequence[LayerSpan]) -> LayerSpan | None:
    """The layers a new span must cover for a chain to exist, or None when one exists.

    From the furthest position a chain reaches from 0 to the nearest position from which a
    chain reaches the last layer: filling exactly that joins the two.
    """
    forward = reach(num_layers, spans)
    if num_layers in forward:
        return None
    backward = reach_back(num_layers, spans)
    start = max(forward)
    return LayerSpan(start, min(p for p in backward if p > start))
