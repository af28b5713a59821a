"""The planner: coverage first, budgets respected, redundancy only once all is covered."""

from __future__ import annotations

from dataclasses import replace

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
    assert loads(directives)["d"] == ("m", LayerSpan(11, 22))
    assert "closes gap 11:22" in directives[0].reason


def test_best_fit_prefers_the_smallest_node_that_closes_the_gap() -> None:
    result = loads(plan([offer("m", 10)], [node("big", 500), node("fit", 100), node("x", 50)]))
    assert result["fit"] == ("m", LayerSpan(0, 10))
    assert result["big"] == ("m", LayerSpan(0, 10))  # then a second entry: the model is covered
    # two entries hold every layer: routes start after them, a third half copy serves nobody
    assert "x" not in result


def test_quantization_changes_how_much_fits() -> None:
    result = loads(plan([offer("m", 30)], [node("a", 40, quant="nf4")]))
    assert result == {"a": ("m", LayerSpan(0, 30))}  # 30 x 1.25 MB fits 40 MB


def test_no_redundancy_while_a_gap_remains() -> None:
    models = [offer("m", 10), offer("n", 100)]  # n needs 1000 MB: cannot be covered
    directives = plan(models, [node("a", 100), node("b", 100), node("c", 100)])
    assert loads(directives)["a"] == ("m", LayerSpan(0, 10))
    assert all(not d.reason.startswith("adds a replica") for d in directives)


def test_redundancy_copies_the_least_served_layers() -> None:
    held = [
        node("a", 100, Holding(M("m"), LayerSpan(0, 5)), throughput=5.0),
        node("b", 100, Holding(M("m"), LayerSpan(5, 10)), throughput=1.0),
    ]
    plain = replace(node("c", 50), entry=False)
    directives = plan([offer("m", 10)], [*held, plain])
    assert loads(directives)["c"] == ("m", LayerSpan(5, 10))  # b is the slower copy
    assert all("replica" in d.reason for d in directives)
    # an entry node with room for the whole model: a second entry, a second chain in one hop
    directives = plan([offer("m", 10)], [*held, node("c", 100)])
    assert loads(directives)["c"] == ("m", LayerSpan(0, 10))
    assert "makes c an entry" in directives[0].reason


def test_failed_loads_go_elsewhere() -> None:
    bad = NodeView(
        NodeId("a"), 200 * MB, "fp32", 1.0, failed=frozenset({(M("m"), LayerSpan(0, 10))})
    )
    assert loads(plan([offer("m", 10)], [bad, node("b", 100)])) == {"b": ("m", LayerSpan(0, 10))}


def test_a_node_holding_the_models_weights_is_preferred_to_one_that_would_fetch_them() -> None:
    fetching, holding = node("a", 100), replace(node("b", 100), weights=frozenset({M("m")}))
    assert loads(plan([offer("m", 10)], [fetching, holding]))["b"] == ("m", LayerSpan(0, 10))
    # weights held do not outrank a fit: without them, the best fit is still the smaller
    assert loads(plan([offer("m", 10)], [fetching, node("b", 100)]))["a"] == ("m", LayerSpan(0, 10))


def test_a_node_whose_copy_differs_gets_no_span_of_that_model() -> None:
    refused = replace(node("a", 500), refused=frozenset({M("m")}))
    result = loads(plan([offer("m", 10), offer("n", 5)], [refused]))
    assert result == {"a": ("n", LayerSpan(0, 5))}


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


def held(name: str, start: int, end: int, budget_mb: int = 100, **kw: object) -> NodeView:
    return NodeView(
        NodeId(name),
        budget_mb * MB,
        "fp32",
        1.0,
        (Holding(M("m"), LayerSpan(start, end)),),
        **kw,  # type: ignore[arg-type]
    )


def ops(directives: list[Directive]) -> list[tuple[str, str, str]]:
    return [(d.op, d.node_id, str(d.span)) for d in directives]


def test_p1_a_redundant_copy_is_moved_into_the_gap_a_death_left() -> None:
    # a 0:10, b 10:20, d a second 0:10, every node full; c (20:30) died
    nodes = [held("a", 0, 10), held("b", 10, 20), held("d", 0, 10)]
    directives = plan([offer("m", 30)], nodes)
    # one of the two copies of 0:10 goes (ties: the lowest id), its node takes the gap
    assert ops(directives) == [("DROP_SHARD", "a", "0:10"), ("LOAD_SHARD", "a", "20:30")]
    assert "redundant copy" in directives[0].reason and "gap 20:30" in directives[0].reason


def test_p2_free_room_first_then_room_made_by_a_drop() -> None:
    nodes = [held("a", 0, 10), held("b", 10, 20), held("d", 0, 10, budget_mb=150)]
    assert ops(plan([offer("m", 30)], nodes)) == [
        ("LOAD_SHARD", "d", "20:25"),
        ("DROP_SHARD", "a", "0:10"),
        ("LOAD_SHARD", "a", "25:30"),
    ]


def test_p3_idle_nodes_too_small_for_a_copy_build_a_second_chain() -> None:
    nodes = [held("a", 0, 30, budget_mb=300), node("x", 100), node("y", 100), node("z", 100)]
    chain = sorted(d.span for d in plan([offer("m", 30)], nodes))
    assert chain == [LayerSpan(0, 10), LayerSpan(10, 20), LayerSpan(20, 30)]


def test_p4_no_copies_of_the_entry_span_on_plain_nodes() -> None:
    mesh = [held("entry", 0, 10), held("b", 10, 20), held("c", 20, 30)]
    plain = replace(node("d", 100), entry=False)  # `--no-entry`: never a span from layer 0
    assert ops(plan([offer("m", 30)], [*mesh, plain])) == [("LOAD_SHARD", "d", "10:20")]
    # a plain copy of 0:10 from before is dropped, and the node gets useful work
    directives = plan([offer("m", 30)], [*mesh, held("d", 0, 10, entry=False)])
    assert ops(directives) == [("DROP_SHARD", "d", "0:10"), ("LOAD_SHARD", "d", "10:20")]
    assert "routes start after" in directives[0].reason
    # an entry node becomes the second entry (it runs the head itself)
    directives = plan([offer("m", 30)], [*mesh, node("e2", 100)])
    assert ops(directives) == [("LOAD_SHARD", "e2", "0:10")]
    assert "makes e2 an entry of m (1 before)" in directives[0].reason


def test_coverage_before_a_second_entry_but_never_the_last_nor_one_given_by_hand() -> None:
    two = [held("e1", 0, 10), held("e2", 0, 10), held("b", 10, 20)]
    # 20:30 is missing: one of two entries goes to close it (coverage first)
    assert ops(plan([offer("m", 30)], two)) == [
        ("DROP_SHARD", "e1", "0:10"),
        ("LOAD_SHARD", "e1", "20:30"),
    ]
    # entry spans given by hand (`--layers 0:K`, the tracker-as-node) stay: the gap stays
    pinned = [replace(n, keeps_entry=True) for n in two[:2]]
    assert plan([offer("m", 30)], [*pinned, two[2]]) == []
    # the last entry never goes, even when a plain node could take its place
    last = [held("e1", 0, 10), held("p", 0, 10, entry=False), held("b", 10, 20)]
    assert ops(plan([offer("m", 30)], last)) == [
        ("DROP_SHARD", "p", "0:10"),
        ("LOAD_SHARD", "p", "20:30"),
    ]


def test_an_entry_costs_its_head_and_only_entry_nodes_get_layer_0() -> None:
    headed = ModelOffer(M("m"), 10, {"fp32": 10 * MB}, {"fp32": 30 * MB})
    # 100 MB hold the head (30) and 7 layers; a plain node takes the rest
    nodes = [node("e", 100), replace(node("p", 100), entry=False)]
    assert loads(plan([headed], nodes)) == {
        "e": ("m", LayerSpan(0, 7)),
        "p": ("m", LayerSpan(7, 10)),
    }
    # no entry node: nobody is given layer 0, and the gap names it
    plain = [replace(node(n, 200), entry=False) for n in ("p", "q")]
    assert loads(plan([headed], plain)) == {}


def test_p6_a_node_smaller_than_every_span_gets_a_finer_one() -> None:
    mesh = [held("a", 0, 10), held("b", 10, 20), held("c", 20, 30)]
    # 0:9 would not make d an entry (no chain goes on from 9): it copies from where routes
    # start, after the entry's span
    assert ops(plan([offer("m", 30)], [*mesh, node("d", 90)])) == [("LOAD_SHARD", "d", "10:19")]


def test_the_last_copy_and_copies_a_chain_needs_are_never_dropped() -> None:
    # 0:10 and 10:20 once each, 20:30 missing, nothing redundant: the gap stays
    nodes = [held("a", 0, 10), held("b", 10, 20)]
    assert plan([offer("m", 30)], nodes) == []


def test_a_copy_serving_sessions_stays_until_the_other_copy_is_loaded() -> None:
    loading_a = NodeView(
        NodeId("a"), 100 * MB, "fp32", 1.0, (Holding(M("m"), LayerSpan(0, 10), loaded=False),)
    )
    serving_d = [loading_a, held("b", 10, 20), held("d", 0, 10, sessions=2)]
    # d's sessions would have nowhere to go: a drops its own copy, still loading, instead
    assert ops(plan([offer("m", 30)], serving_d))[0] == ("DROP_SHARD", "a", "0:10")
    # a cannot take the gap (its load of it failed): d's copy still stays
    stuck_a = replace(loading_a, failed=frozenset({(M("m"), LayerSpan(20, 30))}))
    assert plan([offer("m", 30)], [stuck_a, *serving_d[1:]]) == []


@settings(max_examples=60, deadline=None)
@given(models=models_st, nodes=nodes_st, victim=st.integers(0, 11))
def test_carried_out_plans_converge_without_flapping(
    models: list[tuple[int, int]], nodes: list[tuple[int, str, float]], victim: int
) -> None:
    """Plans carried out (loads done) and replanned: no DROP once chains exist, no layer
    loses its last copy, and within a few rounds nothing is left to do."""
    offers, views = build(models, nodes)
    smallest = min(b for o in offers for b in o.layer_bytes.values())
    rounds = sum(n.budget_bytes // smallest for n in views) + 2  # each round adds a layer
    for _ in range(rounds):
        directives = plan(offers, views)
        before = uncovered(offers, views)
        after = with_directives(views, directives)
        assert lost_nothing(offers, views, after)
        if not before and all(first_break_free(offers, views)):
            assert all(d.op == "LOAD_SHARD" for d in directives)
        if not directives:
            break
        views = after
    else:
        raise AssertionError("plans did not converge")
    survivors = [n for i, n in enumerate(views) if i != victim % len(views)]
    drops = [d for d in plan(offers, survivors) if d.op == "DROP_SHARD"]
    assert lost_nothing(offers, survivors, with_directives(survivors, drops))  # spares only


def lost_nothing(offers: list[ModelOffer], before: list[NodeView], after: list[NodeView]) -> bool:
    """No layer covered before is uncovered after."""

    def covered(model: ModelId, nodes: list[NodeView]) -> set[int]:
        return {i for n in nodes for h in n.holdings if h.model == model for i in h.span}

    return all(covered(o.model, before) <= covered(o.model, after) for o in offers)


def first_break_free(offers: list[ModelOffer], nodes: list[NodeView]) -> list[bool]:
    from meshnet.tracker.layout import first_break

    return [
        first_break(o.num_layers, [h.span for n in nodes for h in n.holdings if h.model == o.model])
        is None
        for o in offers
    ]


holdings_st = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 39), st.integers(1, 40), st.booleans()),
    max_size=3,
)


@settings(max_examples=400, deadline=None)
@given(models=models_st, nodes=nodes_st, holdings=st.lists(holdings_st, max_size=12))
def test_a_mesh_that_already_holds_spans_never_loses_the_last_copy_of_a_layer(
    models: list[tuple[int, int]],
    nodes: list[tuple[int, str, float]],
    holdings: list[list[tuple[int, int, int, bool]]],
) -> None:
    """Nodes that already hold spans (loaded or still loading, overlapping, within budget or
    not): every layer that had a loaded copy keeps one after the drops, and a plan carried
    out leaves nothing more to do about coverage."""
    offers, views = build(models, nodes)
    views = [
        replace(view, holdings=spans_of(offers, held))
        for view, held in zip(views, [*holdings, *[[]] * len(views)], strict=False)
    ]
    directives = plan(offers, views)
    dropped = {(d.node_id, d.model, d.span) for d in directives if d.op == "DROP_SHARD"}
    for o in offers:

        def loaded(keep: bool, model: ModelId = o.model) -> set[int]:
            return {
                i
                for v in views
                for h in v.holdings
                if h.model == model
                and h.loaded
                and (not keep or (v.node_id, h.model, h.span) not in dropped)
                for i in h.span
            }

        assert loaded(keep=False) <= loaded(keep=True), o.model


def spans_of(
    offers: list[ModelOffer], held: list[tuple[int, int, int, bool]]
) -> tuple[Holding, ...]:
    """Random holdings clipped to the offered models' layers, a span at most once a node
    (loaded or loading, not both)."""
    out: dict[tuple[ModelId, LayerSpan], Holding] = {}
    for index, start, length, done in held:
        o = offers[index % len(offers)]
        first = start % o.num_layers
        span = LayerSpan(first, min(first + length, o.num_layers))
        out.setdefault((o.model, span), Holding(o.model, span, done))
    return tuple(out.values())
