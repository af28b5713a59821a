"""A tracker that runs no model forwards client calls to a live entry: least loaded first,
the next entry when one cannot be reached, streams relayed as they come, and clear errors.

The entries are a fake transport here (no model); tests/e2e/test_tracker_mesh.py forwards
through real processes."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from meshnet.config import AccessConfig, TrackerConfig
from meshnet.security.access import key_tag
from meshnet.tracker import messages as msg
from meshnet.tracker.app import create_app
from meshnet.tracker.forward import EntryForwarder
from meshnet.tracker.planner import ModelOffer
from meshnet.tracker.probe import TrustingProber
from meshnet.tracker.registry import Registry
from meshnet.types import LayerSpan, ModelId, NodeId

MB = 1 << 20
OFFERS = [
    ModelOffer(ModelId("m"), 30, {q: 10 * MB for q in ("fp32", "bf16", "int8", "nf4")}),
    ModelOffer(ModelId("other"), 4, {q: 10 * MB for q in ("fp32", "bf16", "int8", "nf4")}),
]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
Handler = Callable[[httpx.Request], httpx.Response]
KEY = "client-key-0001"  # the tracker checks it, and passes it on to the entry


def node(name: str, start: int, end: int, *, entry: bool = False) -> msg.RegisterRequest:
    return msg.RegisterRequest(
        node_id=name,
        address=f"http://{name}:1",
        budget_bytes=(end - start) * 10 * MB,
        quant="fp32",
        throughput=1.0,
        loaded=[msg.ShardRef(model="m", span={"start": start, "end": end})],  # type: ignore[arg-type]
        entry=entry,
        keeps_entry=entry,  # started by hand (`--entry --layers 0:10`)
    )


class InOrder(random.Random):
    """Ties broken in the order entries are listed (the tests' entries: a, then b)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.drawn = 0.0

    def random(self) -> float:
        self.drawn += 1.0
        return self.drawn


def tracker(
    handler: Handler, busy_a: int = 0, rng: random.Random | None = None
) -> tuple[TestClient, Registry, list[str]]:
    """A tracker with entries `a` (`busy_a` sessions, as it reports them) and `b` for model
    m, whose calls go to `handler`; also returns the list of hosts called, in order."""
    registry = Registry(OFFERS, {}, dead_after_s=6.0, clock=lambda: 0.0)
    for request in (node("a", 0, 10, entry=True), node("b", 0, 10, entry=True), node("c", 10, 30)):
        registry.register(request)
    registry.heartbeat(
        msg.HeartbeatRequest(
            node_id="a",
            loaded=[msg.ShardRef(model="m", span={"start": 0, "end": 10})],  # type: ignore[arg-type]
            sessions=busy_a,
        )
    )
    called: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        called.append(request.url.host)
        return handler(request)

    client = httpx.AsyncClient(transport=httpx.MockTransport(record))
    app = create_app(
        registry,
        TrackerConfig(),
        prober=TrustingProber(),
        access=AccessConfig(api_keys=(KEY,)),
        forwarder=EntryForwarder(registry, client, rng=rng or InOrder()),
    )
    return TestClient(app, headers={"Authorization": f"Bearer {KEY}"}), registry, called


def answer(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    reply = {"host": request.url.host, "path": request.url.path, "model": body["model"]}
    reply["auth"] = request.headers.get("authorization", "")
    reply["client"] = request.headers.get("x-meshnet-client", "")
    return httpx.Response(200, json=reply)


def test_a_request_goes_to_an_entry_with_its_body_naming_the_client_never_its_key() -> None:
    """Review N4: the tracker checked the key and passed it on, so an entry (any member that
    registered as one) collected clients' keys. Now the entry learns who, not the key."""
    client, _, called = tracker(answer)
    got = client.post("/v1/chat/completions", json=CHAT)
    assert got.status_code == 200
    assert got.json() == {
        "host": "a",
        "path": "/v1/chat/completions",
        "model": "m",
        "auth": "",
        "client": f"key:{key_tag(KEY)}",
    }
    completion = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert completion.json()["path"] == "/v1/completions" and called == ["a", "a"]


def test_entries_are_chosen_by_the_trackers_count_not_the_load_they_report() -> None:
    """Review N4: a member reporting 0 sessions was listed first and got 3 calls of 3. Calls
    in flight are what the tracker itself counts; ties go either way."""
    client, _, called = tracker(answer, busy_a=50, rng=random.Random(7))
    hosts = [client.post("/v1/chat/completions", json=CHAT).json()["host"] for _ in range(40)]
    assert 5 < hosts.count("a") < 35  # a's 50 sessions, as it says, count for nothing
    forwarder = client.app.state.forwarder  # type: ignore[attr-defined]
    forwarder.in_flight["a"] = 3  # three calls to a still streaming
    assert all(
        client.post("/v1/chat/completions", json=CHAT).json()["host"] == "b" for _ in range(5)
    )
    assert forwarder.in_flight == {"a": 3}  # each answered call was counted out again


@pytest.mark.parametrize("failure", ["refused", "500"])
def test_an_entry_that_fails_before_answering_is_skipped(failure: str) -> None:
    def first_fails(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            if failure == "refused":
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(500, json={"error": {"message": "boom"}})
        return answer(request)

    client, registry, called = tracker(first_fails)
    got = client.post("/v1/chat/completions", json=CHAT)
    assert got.status_code == 200 and got.json()["host"] == "b" and called == ["a", "b"]
    reported = registry.nodes["a"].reports.agreed(registry.clock())  # out of every route a while
    assert reported == (failure == "refused")


def test_a_4xx_from_the_entry_is_the_client_s_answer() -> None:
    def refuses(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": "missing API key"}})

    client, _, called = tracker(refuses)
    got = client.post("/v1/chat/completions", json=CHAT)
    assert got.status_code == 401 and got.json()["error"]["message"] == "missing API key"
    assert called == ["a"]


class Events(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes], breaks: bool) -> None:
        self.chunks, self.breaks = chunks, breaks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        if self.breaks:
            raise httpx.ReadError("connection reset")


@pytest.mark.parametrize("breaks", [False, True])
def test_streams_are_relayed_and_a_broken_one_ends_with_an_error_event(breaks: bool) -> None:
    chunks = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n'] + (
        [] if breaks else [b"data: [DONE]\n\n"]
    )

    def streams(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, stream=Events(chunks, breaks))

    client, _, _ = tracker(streams)
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as got:
        assert got.headers["content-type"].startswith("text/event-stream")
        text = "".join(got.iter_text())
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[:2] == ['{"n": 1}', '{"n": 2}']
    if breaks:
        assert "the entry broke off" in json.loads(events[2])["error"]["message"]
    else:
        assert events[2] == "[DONE]"


def test_clear_errors_for_no_entry_an_unknown_model_and_bad_bodies() -> None:
    client, registry, _ = tracker(answer)
    stranger = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": ""})
    assert stranger.status_code == 401  # the tracker checks the key before forwarding
    none = client.post("/v1/chat/completions", json={**CHAT, "model": "other"})
    assert none.status_code == 503
    assert "other has no live entry: no node serves layers 0:4" in none.json()["error"]["message"]
    unknown = client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    for bad, param in ((b"{", "body"), (b"[1]", "model"), (b'{"model": 3}', "model")):
        got = client.post("/v1/chat/completions", content=bad)
        assert got.status_code == 400 and got.json()["error"]["param"] == param
    registry.nodes["c"].loaded.add((ModelId("m"), LayerSpan(0, 10)))  # a plain copy of 0:10
    registry.leave("a")  # type: ignore[arg-type]
    registry.leave("b")  # type: ignore[arg-type]
    headless = client.post("/v1/chat/completions", json=CHAT)
    assert headless.status_code == 503
    assert "no node that runs its head is up" in headless.json()["error"]["message"]


def test_models_lists_the_offered_models_that_can_answer() -> None:
    client, registry, _ = tracker(answer)
    ids: Any = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == ["m"]  # "other" has no layers served, so no entry either
    registry.leave("c")  # type: ignore[arg-type]
    assert client.get("/v1/models").json()["data"] == []


def test_a_tracker_as_node_never_forwards_to_itself() -> None:
    client, registry, called = tracker(answer)
    forwarder = EntryForwarder(registry, httpx.AsyncClient(transport=httpx.MockTransport(answer)))
    assert forwarder.exclude == frozenset()
    own = EntryForwarder(
        registry,
        httpx.AsyncClient(
            transport=httpx.MockTransport(lambda r: (called.append(r.url.host), answer(r))[1])
        ),
        exclude=frozenset({"a"}),  # "a" is the least loaded entry, and this very process
    )
    app = create_app(
        registry,
        TrackerConfig(),
        prober=TrustingProber(),
        access=AccessConfig(api_keys=(KEY,)),
        forwarder=own,
    )
    got = TestClient(app, headers={"Authorization": f"Bearer {KEY}"}).post(
        "/v1/chat/completions", json=CHAT
    )
    assert got.json()["host"] == "b" and called == ["b"]


def test_a_wrong_key_stops_at_the_tracker_and_reaches_no_entry() -> None:
    """Review N10: 62 calls with a wrong key through the tracker got 7 answers, from a keyless
    entry the planner had made (it took the tracker's loopback call as trusted). The tracker
    now checks the key itself and forwards only the clients it let in."""
    client, _, called = tracker(answer)
    wrong = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer x"})
    assert wrong.status_code == 401 and called == []


def test_a_planned_entry_is_forwarded_to_before_one_that_claimed_its_span() -> None:
    """Review N4: a member that registered claiming an entry span got its share of clients'
    prompts. While an entry the planner gave its span to is up, claims get none."""
    client, registry, called = tracker(answer)
    registry.nodes[NodeId("b")].earned = {(ModelId("m"), LayerSpan(0, 10))}
    for _ in range(6):
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert called == ["b"] * 6


def test_the_forwarded_call_carries_the_trackers_vouch_for_its_client_entry_and_body() -> None:
    """Review P1: only the tracker can say whom a forwarded call is for (ADR-0059)."""
    from meshnet.security.vouch import TrackerKeys, client_statement

    seen: list[httpx.Request] = []

    def keep(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answer(request)

    client, registry, _ = tracker(keep)
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    sent = seen[0]
    keys = TrackerKeys()
    keys.add(registry.identity.public)
    digest = hashlib.sha256(sent.content).hexdigest()
    statement = client_statement(sent.headers["x-meshnet-client"], sent.url.host, digest)
    assert keys.vouched(sent.headers["x-meshnet-vouch"], statement)
    assert not keys.vouched(sent.headers["x-meshnet-vouch"], statement.replace(b"\na\n", b"\nb\n"))
