"""Failover with fake hops: a hop dying mid-generation costs a pause and nothing else."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from meshnet.entry.routes import KnownRoutes, StaticRoutes, TrackerRoutes
from meshnet.entry.transport import hop_error
from meshnet.errors import HopError, MissingLayersError, RouteError
from meshnet.node.runner import EchoRunner, Frame, one_by_one
from meshnet.node.scheduler import Failed
from meshnet.node.sessions import PrefixStats
from meshnet.text.events import Delta, Event, Finished
from meshnet.text.params import GenerationParams, SamplingParams
from meshnet.tracker import messages as msg
from meshnet.types import Hop, LayerSpan, ModelId, NodeId
from meshnet.wire import FrameMeta
from meshnet.wire.tensors import as_tensor
from tests.conftest import run
from tests.entry.fakes import fake_mesh, scored
from tests.entry.test_generation import collect

PARAMS = GenerationParams(20, (), SamplingParams(temperature=0.0))
PROMPT = "0123456789" * 5  # 50 tokens: chunks of 16 with chunk_tokens=16


def kill_at(transport: object, address: str, position: int) -> None:
    """Kill `address` when a frame for `position` or later first reaches it."""

    def before(to: str, meta: FrameMeta) -> None:
        if to == address and meta.position >= position:
            transport.dead.add(address)  # type: ignore[attr-defined]

    transport.before_frame = before  # type: ignore[attr-defined]


def failure_free() -> str:
    generator, _, _ = fake_mesh(chunk_tokens=16, replicas=True)
    return run(collect(generator, PROMPT, PARAMS))[0]


def failure_free_scores(
    prompt: str = PROMPT, params: GenerationParams = PARAMS, **mesh: object
) -> list[float]:
    """Each token's logprob over context runners, nothing failing."""
    generator, _, _ = fake_mesh(chunk_tokens=16, replicas=True, context=True, **mesh)  # type: ignore[arg-type]
    return run(scored(generator, prompt, params))[2]


@pytest.mark.parametrize(
    ("address", "position"),
    [("a", 55), ("b", 50), ("b", 68), ("a", 16), ("b", 32)],  # decode steps; prefill chunks
)
def test_output_equals_the_failure_free_run(address: str, position: int) -> None:
    """Context runners: the replayed replacement's cache holds what the dead hop's did (the
    logprobs would show a token too many or too few)."""
    generator, transport, runners = fake_mesh(chunk_tokens=16, replicas=True, context=True)
    kill_at(transport, address, position)
    text, end, scores = run(scored(generator, PROMPT, PARAMS))
    assert text == failure_free() and scores == failure_free_scores()
    assert len(end.failover_pauses_s) == 1
    assert [h.node_id for h in end.route][1:] == (
        ["node-a2", "node-b"] if address == "a" else ["node-a", "node-b2"]
    )
    routes = generator.pipeline.hops.routes
    assert isinstance(routes, StaticRoutes) and routes.reported == [f"node-{address}"]
    assert all(r.session_count() == 0 for name, r in runners.items() if name != address)


def test_replacement_failing_too_is_banned_and_the_next_one_used() -> None:
    generator, transport, runners = fake_mesh(chunk_tokens=16, replicas=True)
    routes = generator.pipeline.hops.routes
    assert isinstance(routes, StaticRoutes)
    routes.hops.append(routes.hops[3].__class__("node-b3", "b3", routes.hops[3].span))  # type: ignore[arg-type]
    runners["b3"] = runners["b"].__class__(runners["b"].model, runners["b"].span)
    transport.dead.add("b2")
    kill_at(transport, "b", 60)
    text, end = run(collect(generator, PROMPT, PARAMS))
    assert text == failure_free() and end.route[-1].node_id == "node-b3"
    assert routes.reported == ["node-b", "node-b2"]


def test_no_replacement_ends_the_request_quickly_naming_the_layers() -> None:
    generator, transport, runners = fake_mesh(chunk_tokens=16)  # no replicas
    kill_at(transport, "b", 60)
    started = time.perf_counter()
    with pytest.raises(MissingLayersError, match="4:6"):
        run(collect(generator, PROMPT, PARAMS))
    assert time.perf_counter() - started < 2.0
    assert all(r.session_count() == 0 for name, r in runners.items() if name != "b")


@pytest.mark.parametrize("status", [400, 401, 404, 413])
def test_a_hop_refusing_a_frame_we_built_is_that_hops_failure(status: int) -> None:
    """Review finding 3: a 4xx (a node restarted under its old id "serves nothing yet", a
    wrong key...) used to end the request; it now fails over like a dead hop."""
    generator, transport, _ = fake_mesh(chunk_tokens=16, replicas=True)

    def refuse(to: str, meta: FrameMeta) -> None:
        if to == "a" and meta.position > 52:
            raise HopError(f"hop a answered {status}: this node serves nothing yet", status=status)

    transport.before_frame = refuse
    text, end = run(collect(generator, PROMPT, PARAMS))
    assert text == failure_free() and len(end.failover_pauses_s) == 1
    routes = generator.pipeline.hops.routes
    assert isinstance(routes, StaticRoutes) and routes.reported == ["node-a"]


def tracker_of(hops: list[Hop], down: dict[str, bool]) -> httpx.AsyncClient:
    """A tracker over HTTP (mocked) that routes along `hops` and shows them in its coverage,
    unreachable while `down["now"]`."""

    def answer(request: httpx.Request) -> httpx.Response:
        if down["now"]:
            raise httpx.ConnectError("connection refused", request=request)
        rows = [{"node_id": h.node_id, "address": h.address, "span": span_of(h)} for h in hops]
        if request.url.path == "/v1/coverage":
            return httpx.Response(200, json=coverage_of(hops))
        return httpx.Response(200, json={"model": "fake", "hops": rows})

    return httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://tracker")


def span_of(hop: Hop) -> dict[str, int]:
    return {"start": hop.span.start, "end": hop.span.end}


def coverage_of(hops: list[Hop]) -> dict[str, object]:
    nodes = [
        {
            "node_id": h.node_id, "address": h.address, "budget_bytes": 1, "quant": "fp32",
            "throughput": 1.0, "loaded": [{"model": "fake", "span": span_of(h)}],
            "loading": [], "sessions": 0, "last_heartbeat_age_s": 0.0,
        }
        for h in hops
    ]  # fmt: skip
    return {"models": [], "nodes": nodes, "recent_directives": []}


def test_tracker_outage_keeps_sessions_going_and_new_ones_routed_among_known_members() -> None:
    """Issue 50: open sessions hold their routes; new ones, while the tracker is down, are
    routed among the members last seen (degraded, said so); its routes again when it is back."""
    generator, _, _ = fake_mesh()
    static = generator.pipeline.hops.routes
    assert isinstance(static, StaticRoutes)
    down = {"now": False}
    routes = TrackerRoutes(tracker_of(static.hops, down), metrics=generator.pipeline.metrics)
    generator.pipeline.hops.routes = routes

    async def go() -> tuple[str, list[Event], list[Event]]:
        stream = generator.stream([97], PARAMS)
        first = await anext(stream)  # the route is taken; now the tracker goes away
        down["now"] = True
        rest = [e async for e in stream]
        during = [e async for e in generator.stream([97], PARAMS)]
        down["now"] = False
        again = [e async for e in generator.stream([97], PARAMS)]
        return "".join(e.text for e in [first, *rest] if isinstance(e, Delta)), during, again

    before, during, again = run(go())
    texts = ["".join(e.text for e in events if isinstance(e, Delta)) for events in (during, again)]
    assert before == texts[0] == texts[1] == "bcdefghijklmnopqrstu"
    ends = [e for events in (during, again) for e in events if isinstance(e, Finished)]
    assert [e.degraded for e in ends] == [True, False]
    assert generator.pipeline.metrics.degraded_routes._value.get() >= 1


def test_a_tracker_down_before_any_route_is_a_503_naming_it() -> None:
    generator, _, _ = fake_mesh()
    routes = TrackerRoutes(tracker_of([], {"now": True}))
    generator.pipeline.hops.routes = routes
    with pytest.raises(RouteError, match="unreachable.*members last seen hold no route"):
        run(anext(generator.stream([97], PARAMS)))


class Poisoned:
    """A faulty node: runs like its echo runner, but from `position` on it answers NaN/Inf."""

    def __init__(self, runner: object, position: int, value: float) -> None:
        self.runner = runner
        self.position = position
        self.value = value
        self.model, self.span = runner.model, runner.span  # type: ignore[attr-defined]

    def forward(self, meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        out = as_tensor(self.runner.forward(meta, hidden))  # type: ignore[attr-defined]
        return out if meta.position < self.position else out.clone().fill_(self.value)

    def forward_many(self, frames: list[Frame]) -> list[torch.Tensor | Failed]:
        return one_by_one(self.forward, frames)

    def drop(self, session: str, keep: bool = False) -> bool:
        return bool(self.runner.drop(session, keep))  # type: ignore[attr-defined]

    def session_count(self) -> int:
        return int(self.runner.session_count())  # type: ignore[attr-defined]

    def prefix_stats(self) -> PrefixStats:
        return self.runner.prefix_stats()  # type: ignore[attr-defined, no-any-return]


@pytest.mark.parametrize(("position", "value"), [(55, float("nan")), (16, float("inf"))])
def test_non_finite_activations_are_that_hops_failure(position: int, value: float) -> None:
    generator, transport, runners = fake_mesh(chunk_tokens=16, replicas=True)
    transport.runners = {**runners, "a": Poisoned(runners["a"], position, value)}  # type: ignore[dict-item]
    text, end = run(collect(generator, PROMPT, PARAMS))
    assert text == failure_free()  # nothing of the garbage reached the user
    assert len(end.failover_pauses_s) == 1
    assert [h.node_id for h in end.route][1:] == ["node-a2", "node-b"]
    routes = generator.pipeline.hops.routes
    assert isinstance(routes, StaticRoutes) and routes.reported == ["node-a"]


class FullRunner(EchoRunner):
    """A copy at its session limit: every new session gets 429, as `NodeService` answers."""

    def forward(self, meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        from meshnet.errors import LimitError

        if meta.position == 0:
            raise LimitError("this node holds 64 sessions, its limit", retry_after_s=1.0)
        return super().forward(meta, hidden)


def test_a_hop_at_its_limit_is_skipped_for_another_copy_without_reporting_it() -> None:
    generator, transport, runners = fake_mesh(chunk_tokens=16, replicas=True)
    runners["a"] = transport.runners["a"] = FullRunner(runners["a"].model, runners["a"].span)  # type: ignore[index]
    text, end = run(collect(generator, PROMPT, PARAMS))
    assert text == failure_free()
    assert [h.node_id for h in end.route][1:] == ["node-a2", "node-b"]
    routes = generator.pipeline.hops.routes
    assert isinstance(routes, StaticRoutes) and routes.reported == []  # busy is not failing


def test_every_copy_at_its_limit_gives_the_client_429_at_once() -> None:
    generator, transport, runners = fake_mesh(chunk_tokens=16, replicas=True)
    for name in ("a", "a2"):
        runners[name] = transport.runners[name] = FullRunner(
            runners[name].model, runners[name].span
        )  # type: ignore[index]
    started = time.perf_counter()
    with pytest.raises(HopError) as refused:
        run(collect(generator, PROMPT, PARAMS))
    assert refused.value.http_status == 429 and "limit" in refused.value.message
    assert time.perf_counter() - started < 0.5  # no backoff rounds for a full mesh
    assert all(r.session_count() == 0 for r in runners.values())


def test_a_session_past_its_replay_budget_fails_clearly_instead_of_failing_over() -> None:
    """Review finding 9: what each hop was sent was kept without bound (400 MB a session
    at 8,192 tokens and H 8,192). Past the budget the session gives its inputs up; a hop
    failure then ends it with a message saying why, and within it the output is unchanged."""
    generator, transport, runners = fake_mesh(chunk_tokens=16, replicas=True)
    generator.pipeline.hops.max_replay_bytes = 1024  # ~ 40 tokens of H 8 at bf16, per hop
    kill_at(transport, "a", 55)
    with pytest.raises(HopError, match="replay budget of 1024 bytes"):
        run(collect(generator, PROMPT, PARAMS))
    assert all(r.session_count() == 0 for name, r in runners.items() if name != "a")
    generous, transport, _ = fake_mesh(chunk_tokens=16, replicas=True)
    generous.pipeline.hops.max_replay_bytes = 1 << 20
    kill_at(transport, "a", 55)
    assert run(collect(generous, PROMPT, PARAMS))[0] == failure_free()


def test_a_hop_that_no_longer_serves_the_layers_is_skipped_but_not_reported() -> None:
    """Found in the end-to-end mesh: a node that dropped 10:20 to load 20:30 answers 400
    for 10:20; reported, it left routes for 20:30 too. A stale route is not its fault."""
    generator, transport, _ = fake_mesh(chunk_tokens=16, replicas=True)
    body = b'{"error": {"message": "this node serves fake 8:10", "field": "X-Meshnet-Layers"}}'

    def moved(to: str, meta: FrameMeta) -> None:
        if to == "a" and meta.position > 52:
            raise hop_error(Hop(NodeId("node-a"), "a", meta.span), 400, body)

    transport.before_frame = moved
    text, end = run(collect(generator, PROMPT, PARAMS))
    assert text == failure_free() and len(end.failover_pauses_s) == 1
    routes = generator.pipeline.hops.routes
    assert isinstance(routes, StaticRoutes) and routes.reported == []  # still routable


def test_a_hop_that_lost_the_session_answers_409_and_a_copy_takes_over() -> None:
    """Idle expiry or eviction drops a session on one hop mid-answer: its next step gets
    409 (unknown session) and the entry replays the session into the other copy. (The
    end-to-end mesh can no longer drop another entry's session from outside: ADR-0049.)"""
    generator, transport, runners = fake_mesh(chunk_tokens=16, replicas=True, context=True)

    def evict(to: str, meta: FrameMeta) -> None:
        if to == "b" and meta.position == 55:
            assert runners["b"].drop(meta.session)

    transport.before_frame = evict  # type: ignore[attr-defined]
    text, end, scores = run(scored(generator, PROMPT, PARAMS))
    assert text == failure_free() and scores == failure_free_scores()
    assert len(end.failover_pauses_s) == 1
    assert [h.node_id for h in end.route][1:] == ["node-a", "node-b2"]


def test_known_routes_skip_suspects_and_excluded_members_and_know_the_layer_count() -> None:
    span_a, span_b = LayerSpan(4, 6), LayerSpan(6, 8)
    hops = [
        Hop(NodeId(n), f"http://{n}", s) for n, s in (("a", span_a), ("a2", span_a), ("b", span_b))
    ]
    coverage = coverage_of(hops)
    coverage["models"] = [
        {"model": "fake", "num_layers": 8, "layers": [], "gaps": [], "routable": True}
    ]
    coverage["nodes"][0]["suspect"] = True  # type: ignore[index]
    known = KnownRoutes()
    known.learn_coverage(msg.CoverageResponse.model_validate(coverage))
    route = run(known.route(ModelId("fake"), 4, None, frozenset()))
    assert [h.node_id for h in route] == ["a2", "b"]  # a is suspect; the end is layer 8
    with pytest.raises(MissingLayersError):
        run(known.route(ModelId("fake"), 4, None, frozenset({NodeId("a2")})))
    with pytest.raises(RouteError, match="no layer count"):
        run(known.route(ModelId("other"), 0, None, frozenset()))
