"""The registry at scale and under threads: no-op heartbeats plan nothing, plans keep to their
share of the tracker's time, caps on nodes, and one lock for every change."""

from __future__ import annotations

import random
import threading
import time

import pytest

from meshnet.tracker import messages as msg
from meshnet.tracker import views
from meshnet.tracker.membership import RegistrationError, TooManyNodesError
from meshnet.tracker.planner import Directive, ModelOffer
from meshnet.tracker.registry import PLANNING_SHARE, NodeRecord, Registry
from meshnet.types import LayerSpan, ModelId, NodeId

MB = 1 << 20
OFFER = ModelOffer(ModelId("m"), 30, {q: 10 * MB for q in ("fp32", "bf16", "int8", "nf4")})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def registry(clock: Clock | None = None, **kw: object) -> Registry:
    return Registry(
        [OFFER],
        {ModelId("m"): "m"},
        dead_after_s=6.0,
        clock=clock or Clock(),
        **kw,  # type: ignore[arg-type]
    )


def request(name: str, budget_mb: int = 100, host: str = "127.0.0.1") -> msg.RegisterRequest:
    return msg.RegisterRequest(
        node_id=name,
        address=f"http://{host}:{9000 + len(name)}",
        budget_bytes=budget_mb * MB,
        quant="fp32",
        throughput=1.0,
    )


def loaded(reg: Registry, name: str) -> list[msg.ShardRef]:
    """What node `name` would report once it has loaded all it was told to."""
    record = reg.nodes[name]  # type: ignore[index]
    return [msg.ShardRef(model=m, span=s) for m, s in sorted(record.assigned | record.loaded)]


def test_a_heartbeat_that_changes_nothing_plans_nothing() -> None:
    reg = registry()
    for name in ("a", "b", "c"):
        reg.register(request(name))
    for name in ("a", "b", "c"):  # each reports what it was told: that is a change
        reg.heartbeat(msg.HeartbeatRequest(node_id=name, loaded=loaded(reg, name)))
    plans = reg.plans
    for _ in range(5):
        for name in ("a", "b", "c"):
            reg.heartbeat(msg.HeartbeatRequest(node_id=name, loaded=loaded(reg, name), sessions=3))
    assert reg.plans == plans


def test_slow_plans_wait_so_planning_keeps_to_its_share() -> None:
    clock, cost = Clock(), iter(float(i) * 0.5 for i in range(1000))  # every plan takes 0.5 s
    reg = registry(clock, timer=lambda: next(cost))
    reg.register(request("a"))
    assert reg.plans == 1
    reg.register(request("b"))  # a change, but the last plan cost 0.5 s: it waits
    assert reg.plans == 1 and reg.dirty
    wait_s = 0.5 * (1 / PLANNING_SHARE - 1)
    clock.now = wait_s - 0.01
    reg.expire()
    assert reg.plans == 1
    clock.now = wait_s
    reg.expire()  # the tracker's watch loop runs this: the deferred plan happens
    assert reg.plans == 2 and not reg.dirty
    assert any(d.node_id == "b" for d in reg.nodes["b"].pending)


def test_caps_on_nodes_and_on_nodes_per_address_answer_429() -> None:
    reg = registry(max_nodes=3, max_per_address=2)
    reg.register(request("a", host="10.0.0.1"))
    reg.register(request("b", host="10.0.0.1"))
    with pytest.raises(TooManyNodesError, match="limit per address is 2") as caught:
        reg.register(request("c", host="10.0.0.1"))
    assert caught.value.http_status == 429
    reg.register(request("a", host="10.0.0.1"))  # registering again is not a new node
    reg.register(request("c", host="10.0.0.2"))
    with pytest.raises(TooManyNodesError, match="limit of 3 nodes"):
        reg.register(request("d", host="10.0.0.3"))
    assert sorted(reg.nodes) == ["a", "b", "c"]


@pytest.mark.slow
def test_registry_changed_from_many_threads_raises_nothing() -> None:
    """The churn snippet of the issue: 300 nodes, 3 heartbeat threads, 1 register/leave
    thread, 1 coverage and route reader, for 3 s (it raised within a second before)."""
    reg = registry(clock=time.monotonic, max_per_address=1000)  # type: ignore[arg-type]
    names = [f"n{i:03d}" for i in range(300)]
    for name in names:
        reg.register(request(name, budget_mb=random.Random(name).choice([50, 100, 200])))
    errors: list[BaseException] = []
    stop = time.monotonic() + 3.0

    def lost_node(exc: BaseException) -> bool:
        # a heartbeat racing a leave (404), or a registration that cleared its assignments
        return type(exc).__name__ in ("UnknownNodeError", "ClaimError")

    def guarded(work: object) -> None:
        while time.monotonic() < stop:
            try:
                work()  # type: ignore[operator]
            except BaseException as exc:  # noqa: BLE001 - collected and asserted on below
                if not lost_node(exc):
                    errors.append(exc)
                    return

    def beats(part: list[str]) -> object:
        def work() -> None:
            for name in part:
                with reg.lock:
                    refs = loaded(reg, name) if name in reg.nodes else []
                reg.heartbeat(msg.HeartbeatRequest(node_id=name, loaded=refs))

        return work

    def churn() -> None:
        name = random.choice(names)
        reg.leave(name)  # type: ignore[arg-type]
        reg.register(request(name))

    def read() -> None:
        views.coverage(reg)
        try:
            views.route(reg, "m", 0, random.Random(0))
        except Exception as exc:  # noqa: BLE001 - a 503 (no route) is an answer, not a crash
            if type(exc).__name__ not in ("MissingLayersError", "RouteError"):
                raise

    workers = [beats(names[i::3]) for i in range(3)] + [churn, read]
    threads = [threading.Thread(target=guarded, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert views.coverage(reg).models[0].model == "m"
    assert all(s == LayerSpan(s.start, s.end) for r in reg.nodes.values() for _, s in r.loaded)


def test_a_big_mesh_stretches_the_heartbeat_interval_and_the_dead_time_with_it() -> None:
    from meshnet.tracker.beats import BEATS_PER_S, beat_interval_s

    assert beat_interval_s(100, 2.0, 500) == 2.0
    assert beat_interval_s(10_000, 2.0, 500) == 20.0  # 500 beats a second, not 5,000
    reg = registry(heartbeat_interval_s=2.0, max_per_address=10**6)
    for i in range(2 * BEATS_PER_S):  # 1,000 nodes: 2 s holds
        reg.nodes[f"n{i}"] = _record(reg, f"n{i}")  # type: ignore[index]
    assert reg.interval_s == 2.0 and reg.dead_after_s == 6.0
    for i in range(2 * BEATS_PER_S, 5 * BEATS_PER_S):  # 2,500 nodes
        reg.nodes[f"n{i}"] = _record(reg, f"n{i}")  # type: ignore[index]
    assert reg.interval_s == 5.0 and reg.dead_after_s == 15.0


def _record(reg: Registry, name: str) -> NodeRecord:
    return NodeRecord(request(name), reg.clock())


@pytest.mark.parametrize(
    ("suspect_s", "after_s", "suspect"), [(30.0, 29.0, True), (5.0, 4.9, True), (5.0, 5.1, False)]
)
def test_a_reported_node_stays_suspect_for_the_configured_time(
    suspect_s: float, after_s: float, suspect: bool
) -> None:
    """`--suspect-for`: how long a node an entry reported stays out of routes."""
    clock = Clock()
    reg = registry(clock, suspect_s=suspect_s)
    reg.register(request("a"))
    assert reg.report(NodeId("a"), "reset") is True
    clock.now += after_s
    reg.heartbeat(msg.HeartbeatRequest(node_id="a"))
    assert (reg.state(reg.nodes[NodeId("a")], clock.now) == "suspect") is suspect


DIGEST = "ab" * 32


def test_a_load_names_the_models_digest_and_its_holders_least_loaded_first() -> None:
    reg = registry()
    reg.digests = {ModelId("m"): DIGEST}
    for name in ("a", "b"):
        reg.register(request(name, budget_mb=400))
        reg.heartbeat(msg.HeartbeatRequest(node_id=name, loaded=loaded(reg, name)))
    reg.nodes[NodeId("a")].sessions = 5  # busier than b
    reg.register(request("c", budget_mb=400))
    directive = Directive("LOAD_SHARD", NodeId("c"), ModelId("m"), LayerSpan(10, 20), "a copy")
    message = reg.to_message(directive)
    assert message.digest == DIGEST
    assert [h.node_id for h in message.holders] == ["b", "a"]
    claims = [msg.ShardRef(model="m", span=LayerSpan(10, 20))]  # review W1: a claim only
    reg.register(request("liar", budget_mb=400).model_copy(update={"loaded": claims}))
    assert "liar" not in [h.node_id for h in reg.to_message(directive).holders]
    reg.digests = {}
    assert reg.to_message(directive).holders == []  # not known by content: nothing to fetch


def test_a_node_whose_copy_differs_is_given_no_more_of_that_model() -> None:
    reg = registry()
    reg.register(request("a", budget_mb=400))
    told = loaded(reg, "a")
    failure = msg.ShardFailure(shard=told[0], error="its tensor differs", refuses_model=True)
    reg.heartbeat(msg.HeartbeatRequest(node_id="a", failed=[failure]))
    reg.replan()
    record = reg.nodes[NodeId("a")]
    assert not record.assigned and not record.pending and record.refused == {"m"}


def test_holders_cover_the_most_of_a_span_then_carry_the_least_load() -> None:
    from meshnet.tracker.holders import Candidate, holders

    span = LayerSpan(10, 20)
    found = holders(
        span,
        [
            Candidate("far", "http://h:1", frozenset({LayerSpan(0, 5)}), 0),
            Candidate("half", "http://h:2", frozenset({LayerSpan(15, 30)}), 0),
            Candidate("busy", "http://h:3", frozenset({LayerSpan(10, 20)}), 9),
            Candidate("idle", "http://h:4", frozenset({LayerSpan(0, 30)}), 1),
            Candidate("sick", "http://h:5", frozenset({LayerSpan(10, 20)}), 0, suspect=True),
        ],
    )
    assert [h.node_id for h in found] == ["idle", "busy", "half", "sick"]


def test_the_weights_a_node_holds_follow_its_heartbeats() -> None:
    reg = registry()
    reg.digests = {ModelId("m"): DIGEST}
    reg.register(request("a"))
    by_digest = {DIGEST: ModelId("m")}
    assert reg.nodes[NodeId("a")].view(by_digest).weights == frozenset()
    reg.heartbeat(msg.HeartbeatRequest(node_id="a", loaded=loaded(reg, "a"), weights=[DIGEST]))
    assert reg.nodes[NodeId("a")].view(by_digest).weights == {"m"}
    reg.heartbeat(msg.HeartbeatRequest(node_id="a", loaded=loaded(reg, "a")))  # not said
    assert reg.nodes[NodeId("a")].view(by_digest).weights == {"m"}


def test_holders_are_found_among_the_first_that_serve_and_the_start_turns() -> None:
    from meshnet.tracker.holders import SCAN

    reg = registry()
    reg.digests = {ModelId("m"): DIGEST}
    for i in range(SCAN + 10):  # every one holds the span
        name = f"n{i:03d}"
        reg.register(request(name, budget_mb=400))
        reg.nodes[NodeId(name)].earned = {(ModelId("m"), LayerSpan(10, 20))}
    directive = Directive("LOAD_SHARD", NodeId("new"), ModelId("m"), LayerSpan(10, 20), "a copy")
    first = [h.node_id for h in reg.holders(directive)]
    second = [h.node_id for h in reg.holders(directive)]
    assert 0 < len(first) <= 8 and first != second  # another start: uploads spread


def test_a_restarted_tracker_moves_no_span_while_its_nodes_register_again() -> None:
    """Issue 50: four nodes held 10:20 and 20:30 twice each; a tracker that planned at the
    second registration saw a gap at 20:30 and moved a copy of 10:20 there. For
    `rejoin_beats` intervals from its first registration (not from its start: a tracker that
    loads its own span first may take longer than that to listen) it plans nothing; then it
    finds every span held and moves none."""
    clock = Clock()
    reg = registry(clock, heartbeat_interval_s=1.0, rejoin_beats=2.0)
    clock.now = 10.0  # its own start-up: loading a span, converting a vocabulary
    held = {"a": (10, 20), "b": (10, 20), "c": (20, 30), "d": (20, 30), "e": (0, 10)}
    for name, (start, end) in held.items():
        ref = msg.ShardRef(model="m", span=LayerSpan(start, end))
        body = request(name, 105).model_copy(update={"loaded": [ref]})
        assert reg.register(body) == []
        clock.now += 0.3
    assert reg.plans == 0
    clock.now = 12.0
    beat = msg.HeartbeatRequest(
        node_id="a", loaded=[msg.ShardRef(model="m", span=LayerSpan(10, 20))]
    )
    assert reg.heartbeat(beat) == [] and reg.plans == 1
    assert not reg.recent  # every span was held: nothing moved


def test_a_new_tracker_plans_for_the_nodes_that_joined_once_its_window_is_over() -> None:
    clock = Clock()
    reg = registry(clock, heartbeat_interval_s=1.0, rejoin_beats=2.0)
    assert reg.register(request("a", 400)) == []
    clock.now = 1.9
    assert reg.heartbeat(msg.HeartbeatRequest(node_id="a")) == []  # still in its window
    clock.now = 2.0
    directives = reg.heartbeat(msg.HeartbeatRequest(node_id="a"))
    assert [(d.op, str(d.span)) for d in directives] == [("LOAD_SHARD", "0:30")]


def test_a_follower_plans_nothing_takes_what_nodes_hold_and_moves_nothing_once_it_leads() -> None:
    """ADR-0057: one of several trackers, without the lease: it answers with no directives
    and term None, takes the spans nodes report (the planner assigned them) within their
    budgets, and once it holds the lease its first plan keeps every one of them."""
    from meshnet.tracker.lease import Lease

    clock = Clock()
    planner, follower = registry(clock), registry(clock)
    follower.lease = Lease("http://b", ["http://a", "http://b"], 3.0, 0.0)
    for name in ("a", "b", "c"):
        planner.register(request(name))
        assert follower.register(request(name)) == []
    for name in ("a", "b", "c"):
        # a member's huge term raises no tracker's next term (review L1): terms are trackers'
        beat = msg.HeartbeatRequest(node_id=name, loaded=loaded(planner, name), term=1 << 62)
        planner.heartbeat(beat)  # (the registry's `loaded` helper: what it was assigned)
        assert follower.heartbeat(beat) == [] and follower.term() is None
    assert follower.plans == 0
    assert {n: r.pinned for n, r in follower.nodes.items()} == {
        n: r.assigned | r.loaded for n, r in planner.nodes.items()
    }
    greedy = msg.HeartbeatRequest(
        node_id="a", loaded=[msg.ShardRef(model="m", span=LayerSpan(0, 30))]
    )
    with pytest.raises(Exception, match="budget"):  # 300 MB of layers on a 100 MB budget
        follower.heartbeat(greedy)
    planner.register(request("d"))  # told to load a copy; a follower hears it is loading
    loading = msg.HeartbeatRequest(node_id="d", loading=loaded(planner, "d"))
    follower.register(request("d"))
    follower.heartbeat(loading)
    assert loaded(planner, "d") and follower.nodes[NodeId("d")].assigned == {
        (ModelId(r.model), r.span) for r in loaded(planner, "d")
    }
    voter = Lease("http://a", ["http://a", "http://b"], 3.0, 0.0)
    ask = follower.lease.ask(clock.now)
    own = follower.lease.vote(ask, clock.now)
    assert follower.lease.tally(ask, clock.now, own, [voter.vote(ask, clock.now)])
    assert follower.plans_now() and follower.term() == ask.term == 1
    follower.plan_if_due()
    # coverage was whole and d's copy is under way: nothing moves, nothing is sent twice
    assert follower.plans == 1 and not follower.recent


def test_a_gguf_model_is_served_only_by_copies_that_keep_its_files_weights() -> None:
    """N8 (ADR-0060): nf4 re-quantizes a GGUF file's 4-bit weights, and so does q4 where a
    layer matrix is no Q4 block (Gemma's Q4_K_M file keeps some in Q6_K); such copies part
    from the file's by up to 0.18, room a liar could hide in. The offers leave them out."""
    from meshnet.tracker.offers import offer
    from tests.models.fixtures import gemma3_gguf

    assert sorted(offer("default").layer_bytes) == ["bf16", "fp32", "gguf", "int8", "q4"]
    assert sorted(offer(str(gemma3_gguf())).layer_bytes) == ["bf16", "fp32", "gguf", "int8"]


def test_spans_held_in_a_quantization_the_model_is_not_served_in_are_refused() -> None:
    offers = [ModelOffer(ModelId("m"), 30, {"gguf": MB, "bf16": MB})]
    reg = Registry(offers, {ModelId("m"): "m"}, dead_after_s=6.0, clock=Clock())
    shard = msg.ShardRef(model="m", span=LayerSpan(0, 4))
    liar = request("liar").model_copy(update={"quant": "nf4", "loaded": [shard]})
    with pytest.raises(RegistrationError, match="not served as nf4.*'bf16', 'gguf'") as refused:
        reg.register(liar)
    assert refused.value.field == "quant" and not reg.nodes
    reg.register(request("n").model_copy(update={"quant": "nf4"}))  # holding nothing: idle
    beat = msg.HeartbeatRequest(node_id="n", loaded=[shard])
    with pytest.raises(RegistrationError, match="not served as nf4"):
        reg.heartbeat(beat)
    assert not reg.nodes[NodeId("n")].loaded
