"""The API's per-client limits and keys, in-process over the fake mesh: each refusal is a 4xx
naming its limit, and none leaves a session or a slot behind."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import httpx
import openai
import pytest
from fastapi import FastAPI

from meshnet.api.app import create_app
from meshnet.config import AccessConfig, ApiLimits
from meshnet.errors import LimitError
from meshnet.security.limits import ClientLimiter
from meshnet.security.signing import Signer
from meshnet.security.vouch import TrackerIdentity, TrackerKeys
from tests.conftest import run
from tests.entry.fakes import fake_mesh

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


TRACKER = TrackerIdentity()  # the tracker the entries of these tests registered with


def make(limits: ApiLimits = ApiLimits(), access: AccessConfig = AccessConfig()) -> FastAPI:
    generator, _, runners = fake_mesh()
    limiter = ClientLimiter(limits)
    names = frozenset({"entry-1"})  # members address their proofs to it
    keys = TrackerKeys()
    keys.add(TRACKER.public)
    app = create_app(
        {"fake": generator},
        8,
        limits=limits,
        access=access,
        limiter=limiter,
        names=names,
        trackers=keys,
    )
    app.state.runners, app.state.limiter = runners, limiter
    app.state.generator = generator
    app.state.service = generator.pipeline.executor  # the entry's NodeService
    return app


def post(app: FastAPI, body: dict[str, object], **kwargs: object) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            return await http.post("/v1/chat/completions", json=body, **kwargs)  # type: ignore[arg-type]

    return run(go())


def no_leftovers(app: FastAPI) -> bool:
    idle = all(r.session_count() == 0 for r in app.state.runners.values())
    return idle and app.state.limiter.in_flight == {}


@pytest.mark.parametrize(
    ("limits", "body", "status", "field"),
    [
        (ApiLimits(max_tokens=16), CHAT | {"max_tokens": 17}, 400, "max_tokens"),
        (
            ApiLimits(max_tokens=16),
            CHAT | {"max_completion_tokens": 17},
            400,
            "max_completion_tokens",
        ),
        (
            ApiLimits(max_prompt_tokens=30),
            CHAT | {"messages": [{"role": "user", "content": "x" * 50}]},
            400,
            "messages",
        ),
        (ApiLimits(max_body_bytes=200), CHAT | {"user": "u" * 200}, 413, "body"),
        (ApiLimits(), CHAT | {"seed": 2**70}, 400, "seed"),  # beyond torch's seed range
    ],
)
def test_request_limits(
    limits: ApiLimits, body: dict[str, object], status: int, field: str
) -> None:
    app = make(limits)
    response = post(app, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == field
    assert no_leftovers(app)
    assert post(app, CHAT).status_code == 200  # the next good request is served


def test_rate_limit_per_client_with_retry_after() -> None:
    app = make(ApiLimits(requests_per_minute=6, burst_requests=2))
    assert [post(app, CHAT).status_code for _ in range(3)] == [200, 200, 429]
    refused = post(app, CHAT)
    assert refused.headers["Retry-After"] == "10"  # one request per 10 s
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert app.state.limiter.refused["rate"] == 2 and no_leftovers(app)


def test_concurrent_generations_per_client() -> None:
    app = make(ApiLimits(max_concurrent_per_client=1))
    app.state.limiter.acquire("ip:127.0.0.1")  # a generation of this client is in flight
    refused = post(app, CHAT | {"stream": True})
    assert refused.status_code == 429 and "in flight" in refused.json()["error"]["message"]
    app.state.limiter.release("ip:127.0.0.1")
    assert post(app, CHAT | {"stream": True}).status_code == 200
    failing = post(app, CHAT | {"max_tokens": 10_000})  # refused by the model's context
    assert failing.status_code == 400
    assert no_leftovers(app)  # every slot was given back, on success and on failure


def test_api_keys_with_the_openai_client() -> None:
    app = make(access=AccessConfig(api_keys=("client-key-0001",)))

    def ask(key: str) -> str:
        http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://localhost"
        )
        client = openai.AsyncOpenAI(api_key=key, base_url="http://localhost/v1", http_client=http)
        answer = run(client.completions.create(model="fake", prompt="abc", max_tokens=3))
        return answer.choices[0].text

    with pytest.raises(openai.AuthenticationError):
        ask("not-the-key")
    assert ask("client-key-0001") == "def"
    assert no_leftovers(app)


def test_a_hop_at_its_session_limit_is_a_429_for_the_client() -> None:
    app = make()
    full = app.state.runners["a"]

    def refuse(meta: object, hidden: object) -> object:
        raise LimitError("this node holds 64 sessions, its limit; retry later", retry_after_s=1)

    full.forward = refuse
    response = post(app, CHAT)
    assert response.status_code == 429 and response.headers["Retry-After"] == "1"
    assert "64 sessions" in response.json()["error"]["message"]
    assert no_leftovers(app)


def test_a_chat_naming_no_length_gets_the_default_capped_at_the_limit() -> None:
    """The default `max_tokens` (8 here) above the limit (3) must not turn a plain request
    into a 400: the server gives the most it allows."""
    app = make(ApiLimits(max_tokens=3))
    answer = post(app, CHAT)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 3
    assert no_leftovers(app)


def test_the_entry_span_counts_against_the_session_limit() -> None:
    """A new generation on an entry already at `max_sessions` is a 429 naming the limit,
    before any hop sees it; below the limit the same request works."""
    app = make()
    service = app.state.service
    service.max_sessions = 0
    refused = post(app, CHAT)
    assert refused.status_code == 429 and "limit" in refused.json()["error"]["message"]
    assert refused.headers["Retry-After"] == "1"
    assert no_leftovers(app)
    service.max_sessions = 64
    assert post(app, CHAT).status_code == 200


def test_a_prompt_too_long_for_any_tokenization_is_refused_untokenized() -> None:
    """Review finding 9: a 4 MiB prompt was tokenized on the event loop before its length
    was checked (the schema caps a message at 1M characters). It is refused by its
    character count; the codec never sees it."""
    app = make(ApiLimits(max_prompt_tokens=1024, max_body_bytes=8 << 20))
    codec = app.state.generator.codec
    seen: list[int] = []
    chat = codec.chat
    codec.chat = lambda messages: seen.append(1) or chat(messages)
    huge = CHAT | {"messages": [{"role": "user", "content": "x" * 900_000}]}  # < the schema cap
    response = post(app, huge)
    assert response.status_code == 400 and "characters" in response.json()["error"]["message"]
    assert seen == [] and no_leftovers(app)
    assert post(app, CHAT).status_code == 200 and seen == [1]


def test_generations_in_flight_are_capped_across_clients() -> None:
    """Review finding 9: each client had its own cap, the server none."""
    app = make(ApiLimits(max_generations=2, max_concurrent_per_client=8))
    app.state.limiter.acquire("key:a")
    app.state.limiter.acquire("key:b")
    refused = post(app, CHAT)
    assert refused.status_code == 429 and "this server has 2" in refused.json()["error"]["message"]
    assert "Retry-After" in refused.headers
    app.state.limiter.release("key:a")
    assert post(app, CHAT).status_code == 200


def test_a_client_that_stops_reading_is_cut_off_and_every_hop_forgets_it() -> None:
    """Review finding 9: an SSE reader that never reads held its sessions on every hop with
    no deadline. Here the client's socket is full after the first event (its `send` never
    returns): at the write deadline the stream ends and the sessions close."""
    app = make(ApiLimits(write_timeout_s=0.3))
    body = json.dumps(CHAT | {"stream": True, "max_tokens": 50}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"localhost"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5000),
        "server": ("localhost", 80),
    }
    events: list[dict[str, object]] = []

    async def go() -> float:
        async def receive() -> dict[str, object]:
            if not events:
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)  # no disconnect: the client is there, just not reading
            return {"type": "http.disconnect"}

        async def send(message: dict[str, object]) -> None:
            events.append(message)
            if message["type"] == "http.response.body" and len(events) > 2:
                await asyncio.sleep(3600)  # the socket's buffers are full

        started = time.monotonic()
        await asyncio.wait_for(app(scope, receive, send), 10)
        return time.monotonic() - started

    took = run(go())
    assert took < 5 and events[0]["status"] == 200
    assert no_leftovers(app)


def test_every_answer_of_n_counts_against_the_clients_limit() -> None:
    """Review N7: with a limit of 8, one key's requests with n = 16, 16, 16, 12 held 62 of 64
    sessions on every hop. Each answer is a session on every hop, so each one counts."""
    app = make(ApiLimits(max_concurrent_per_client=8))
    too_many = post(app, CHAT | {"n": 16})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    app.state.limiter.acquire("ip:127.0.0.1", 5)  # five answers of this client in flight
    refused = post(app, CHAT | {"n": 4, "stream": True})
    assert refused.status_code == 429 and "5 answers" in refused.json()["error"]["message"]
    assert post(app, CHAT | {"n": 3}).status_code == 200  # exactly at the limit
    app.state.limiter.release("ip:127.0.0.1", 5)
    assert no_leftovers(app)


def test_answers_count_against_the_servers_limit_too() -> None:
    app = make(ApiLimits(max_generations=4, max_concurrent_per_client=8))
    app.state.limiter.acquire("key:a", 3)
    refused = post(app, CHAT | {"n": 2})
    assert refused.status_code == 429 and "this server has 3" in refused.json()["error"]["message"]
    app.state.limiter.release("key:a", 3)
    assert post(app, CHAT | {"n": 2}).status_code == 200 and no_leftovers(app)


SWARM = "api-limits-swarm-key-padded-to-128-bits-0123456789"


def forwarded(
    app: FastAPI,
    client: str,
    signer: Signer | None,
    vouch: TrackerIdentity | None = TRACKER,
    to: str = "entry-1",
    vouched_body: bytes | None = None,
) -> httpx.Response:
    """A call as a tracker forwards it: no API key, the client it let in named, and (with
    `vouch`) that tracker's vouch for the client, entry `to` and the body (or another)."""
    body = json.dumps(CHAT).encode()
    headers = {"Content-Type": "application/json", "X-Meshnet-Client": client}
    if vouch is not None:
        digest = hashlib.sha256(vouched_body or body).hexdigest()
        headers["X-Meshnet-Vouch"] = vouch.vouch(client, to, digest)
    if signer is not None:
        headers |= signer.headers(
            "POST", "/v1/chat/completions", body, to="entry-1", headers=headers
        )
    return post(app, {}, content=body, headers=headers)


def test_a_tracker_forwards_a_member_signed_call_limited_as_the_client_it_names() -> None:
    """Review N4: the tracker checks the client's key itself and forwards a member-signed
    call naming the client; the entry counts it against that client's limits."""
    access = AccessConfig(swarm_key=SWARM, api_keys=("client-key-0001",))
    app = make(ApiLimits(max_concurrent_per_client=1), access)
    assert forwarded(app, "key:0123456789ab", Signer(SWARM)).status_code == 200
    app.state.limiter.acquire("via-key:0123456789ab")  # that client has one in flight
    busy = forwarded(app, "key:0123456789ab", Signer(SWARM))
    assert busy.status_code == 429  # its limit, through the tracker too
    assert forwarded(app, "key:ba9876543210", Signer(SWARM)).status_code == 200  # another
    unsigned = forwarded(app, "key:0123456789ab", None)  # naming a client is no credential
    assert unsigned.status_code == 401


def test_a_member_naming_a_client_without_a_trackers_vouch_is_counted_as_itself() -> None:
    """Review P1: every member holds the swarm key, so a member-signed call naming a client
    is that client's only with a vouch of a tracker this entry registered with, for this
    entry and this body; else it is the member's own (`swarm`): not the client's scope."""
    access = AccessConfig(swarm_key=SWARM, api_keys=("client-key-0001",))
    app = make(ApiLimits(max_concurrent_per_client=1), access)
    app.state.limiter.acquire("via-key:0123456789ab")  # the victim has one in flight
    victim = "key:0123456789ab"
    assert forwarded(app, victim, Signer(SWARM)).status_code == 429  # vouched: its limits
    cases = {
        "no vouch": dict(vouch=None),
        "a member's own key pair": dict(vouch=TrackerIdentity()),
        "vouched for another entry": dict(to="entry-2"),
        "vouched for another body": dict(vouched_body=b'{"model": "fake"}'),
    }
    for name, kw in cases.items():
        call = forwarded(app, victim, Signer(SWARM), **kw)  # type: ignore[arg-type]
        assert call.status_code == 200, name  # not the victim's limit: the member's own


def test_without_a_swarm_key_a_proof_header_opens_no_api() -> None:
    """A process with API keys and no swarm key takes no member calls on its API: a made-up
    X-Meshnet-Auth must not stand in for the key."""
    app = make(access=AccessConfig(api_keys=("client-key-0001",)))
    fake = {"X-Meshnet-Auth": "v1 t=1 n=abcdefgh to=x s=" + "0" * 64}
    assert post(app, CHAT, headers=fake).status_code == 401
