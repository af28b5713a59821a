"""The planner: coverage first, budgets respected, redundancy only once all is covered."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet.tracker.planner import (
    Directive,
    Holding,
    ModelOffer,
    NodeView,
    gaps,
    plan,
    with_directives,
)
from meshnet.types import LayerSpan, ModelId, NodeId

M = ModelId
MB = 1 << 20


def offer(name: str, layers: int, mb_per_layer: int = 10) -> ModelOffer:
    return ModelOffer(M(name), layers, {"fp32": mb_per_layer * MB, "nf4": mb_per_layer * MB // 8})


def node(
    name: str, budget_mb: int, *holdings: Holding, quant: str = "fp32", throughput: float = 1.0
) -> NodeView:
    return NodeView(NodeId(name), budget_mb * MB, quant, throughput, tuple(holdings))


def loads(directives: list[Directive]) -> dict[str, tuple[str, LayerSpan]]:
    return {d.node_id: (d.model, d.span) for d in directives if d.op == "LOAD_SHARD"}


def test_three_nodes_split_a_model_into_three_spans() -> None:
    result = loads(plan([offer("m", 30)], [node("a", 110), node("b", 110), node("c", 110)]))
    assert result == {
        "a": ("m", LayerSpan(0, 11)),
        "b": ("m", LayerSpan(11, 22)),
        "c": ("m", LayerSpan(22, 30)),
    }


def test_a_new_node_gets_exactly_the_gap() -> None:
    nodes = [
        node("a", 110, Holding(M("m"), LayerSpan(0, 11))),
        node("c", 110, Holding(M("m"), LayerSpan(22, 30))),
        node("d", 300),
    ]
    directives = plan([offer("m", 30)], nodes)
    assert loads(directives) == {"d": ("m", LayerSpan(11, 22))}
    assert "closes gap 11:22" in directives[0].reason


def test_best_fit_prefers_the_smallest_node_that_closes_the_gap() -> None:
    result = loads(plan([offer("m", 10)], [node("big", 500), node("fit", 100), node("x", 50)]))
    assert result["fit"] == ("m", LayerSpan(0, 10))
    assert result["big"] == ("m", LayerSpan(0, 10))  # then a replica: the model is covered
    assert "x" not in result  # 50 MB holds no copy of the only span


def test_quantization_changes_how_much_fits() -> None:
    result = loads(plan([offer("m", 30)], [node("a", 40, quant="nf4")]))
    assert result == {"a": ("m", LayerSpan(0, 30))}  # 30 x 1.25 MB fits 40 MB


def test_no_redundancy_while_a_gap_remains() -> None:
    models = [offer("m", 10), offer("n", 100)]  # n needs 1000 MB: cannot be covered
    directives = plan(models, [node("a", 100), node("b", 100), node("c", 100)])
    assert loads(directives)["a"] == ("m", LayerSpan(0, 10))
    assert all(not d.reason.startswith("adds a replica") for d in directives)


def test_redundancy_copies_the_least_served_span() -> None:
    nodes = [
        node("a", 100, Holding(M("m"), LayerSpan(0, 5)), throughput=5.0),
        node("b", 100, Holding(M("m"), LayerSpan(5, 10)), throughput=1.0),
        node("c", 100),
    ]
    directives = plan([offer("m", 10)], nodes)
    assert loads(directives) == {"c": ("m", LayerSpan(5, 10))}
    assert "replica" in directives[0].reason


def test_failed_loads_go_elsewhere() -> None:
    bad = NodeView(
        NodeId("a"), 200 * MB, "fp32", 1.0, failed=frozenset({(M("m"), LayerSpan(0, 10))})
    )
    assert loads(plan([offer("m", 10)], [bad, node("b", 100)])) == {"b": ("m", LayerSpan(0, 10))}


def test_models_no_longer_offered_are_dropped() -> None:
    directives = plan([offer("m", 4)], [node("a", 100, Holding(M("gone"), LayerSpan(0, 2)))])
    assert [(d.op, d.model) for d in directives] == [("DROP_SHARD", "gone"), ("LOAD_SHARD", "m")]


def test_gaps() -> None:
    held = [(LayerSpan(2, 4), 1.0), (LayerSpan(6, 7), 1.0)]
    assert gaps(8, held) == [LayerSpan(0, 2), LayerSpan(4, 6), LayerSpan(7, 8)]
    assert gaps(3, []) == [LayerSpan(0, 3)]


models_st = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20)), min_size=1, max_size=4)
nodes_st = st.lists(
    st.tuples(st.integers(1, 400), st.sampled_from(["fp32", "nf4"]), st.floats(0.5, 4.0)),
    min_size=1,
    max_size=12,
)


def build(
    models: list[tuple[int, int]], nodes: list[tuple[int, str, float]]
) -> tuple[list[ModelOffer], list[NodeView]]:
    offers = [offer(f"m{i}", layers, mb) for i, (layers, mb) in enumerate(models)]
    views = [
        node(f"n{i:02d}", budget, quant=quant, throughput=t)
        for i, (budget, quant, t) in enumerate(nodes)
    ]
    return offers, views


def uncovered(offers: list[ModelOffer], nodes: list[NodeView]) -> list[LayerSpan]:
    return [
        g
        for o in offers
        for g in gaps(
            o.num_layers, [(h.span, 1.0) for n in nodes for h in n.holdings if h.model == o.model]
        )
    ]


def enough(offers: list[ModelOffer], nodes: list[NodeView]) -> bool:
    """A sufficient condition for coverage: every model fits whole into distinct nodes."""
    free = sorted((n.budget_bytes, n.quant) for n in nodes)
    for o in sorted(offers, key=lambda o: -o.num_layers * o.layer_bytes["fp32"]):
        fit = [f for f in free if f[0] >= o.num_layers * o.layer_bytes[f[1]]]
        if not fit:
            return False
        free.remove(fit[0])
    return True


@settings(max_examples=300, deadline=None)
@given(models=models_st, nodes=nodes_st)
def test_plans_respect_budgets_and_cover_when_budget_suffices(
    models: list[tuple[int, int]], nodes: list[tuple[int, str, float]]
) -> None:
    offers, views = build(models, nodes)
    directives = plan(offers, views)
    after = with_directives(views, directives)
    by_model = {o.model: o for o in offers}
    for n in after:  # never over-commit
        used = sum(len(h.span) * by_model[h.model].layer_bytes[n.quant] for h in n.holdings)
        assert used <= n.budget_bytes
    gaps_left = uncovered(offers, after)
    if enough(offers, views):
        assert not gaps_left
    if gaps_left:  # no redundancy while a gap remains
        assert all("replica" not in d.reason for d in directives)
    assert plan(offers, views) == directives  # deterministic


@settings(max_examples=150, deadline=None)
@given(models=models_st, nodes=nodes_st, victim=st.integers(0, 11))
def test_replanning_after_a_node_leaves_restores_coverage(
    models: list[tuple[int, int]], nodes: list[tuple[int, str, float]], victim: int
) -> None:
    offers, views = build(models, nodes)
    after = with_directives(views, plan(offers, views))
    survivors = [n for i, n in enumerate(after) if i != victim % len(after)]
    replanned = with_directives(survivors, plan(offers, survivors))
    by_model = {o.model: o for o in offers}
    room = [
        NodeView(
            n.node_id,
            n.budget_bytes
            - sum(len(h.span) * by_model[h.model].layer_bytes[n.quant] for h in n.holdings),
            n.quant,
            n.throughput,
        )
        for n in survivors
    ]
    # Survivors keep their spans; what the victim held goes onto free room, whenever the free
    # room alone suffices.
    if not uncovered(offers, after) and enough(offers, room):
        assert not uncovered(offers, replanned)


@settings(max_examples=300, deadline=None)
@given(
    layers=st.integers(1, 60),
    spans=st.lists(st.tuples(st.integers(0, 70), st.integers(1, 30)), max_size=12),
)
def test_gaps_match_a_layer_by_layer_count(layers: int, spans: list[tuple[int, int]]) -> None:
    held = [(LayerSpan(start, start + length), 1.0) for start, length in spans]
    covered = {i for span, _ in held for i in span}
    expected = [i for i in range(layers) if i not in covered]
    assert [i for g in gaps(layers, held) for i in g] == expected
    assert all(g.end <= layers for g in gaps(layers, held))


@settings(max_examples=300, deadline=None)
@given(
    layers=st.lists(st.integers(1, 50), min_size=1, max_size=4),
    budgets=st.lists(st.integers(0, 300), min_size=1, max_size=12),
)
def test_total_layer_capacity_that_suffices_always_covers(
    layers: list[int], budgets: list[int]
) -> None:
    """Models with one layer size: whenever the nodes' whole-layer capacity adds up to every
    layer of every model, every layer gets covered (no fragmentation is left unused)."""
    offers = [offer(f"m{i}", n, 10) for i, n in enumerate(layers)]
    views = [node(f"n{i:02d}", b) for i, b in enumerate(budgets)]
    directives = plan(offers, views)
    if sum(b // 10 for b in budgets) >= sum(layers):
        assert not uncovered(offers, with_directives(views, directives))
