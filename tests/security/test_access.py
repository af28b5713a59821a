"""The access guard in front of a small app: open paths, member paths, client paths, bodies."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from meshnet.config import AccessConfig, TrackerConfig, WireConfig, WireLimits
from meshnet.errors import MeshError
from meshnet.http_errors import install_error_handlers
from meshnet.node.app import NodeService
from meshnet.node.app import create_app as create_node_app
from meshnet.node.trackers import tracker_client
from meshnet.security.access import Credentials, Guard, client_of, match, rule
from meshnet.security.signing import AnswerNotSigned, CheckedSwarmAuth, Signer
from meshnet.tracker.app import create_app as create_tracker_app
from meshnet.tracker.planner import ModelOffer
from meshnet.tracker.probe import HttpProber, OwnNodeTrusted, TrustingProber
from meshnet.tracker.registry import Registry
from meshnet.types import ModelId
from tests.conftest import run

SWARM = "guard-test-swarm-key-padded-to-128-bits-0123456789"
RULES = [
    rule("/member", "swarm"),
    rule("/api", "client", max_body_bytes=100),
    rule("/either", "swarm", "client"),
]
calls: list[tuple[str, bytes]] = []


async def echo(request: Request) -> Response:
    body = await request.body()
    calls.append((client_of(request.scope), body))
    return JSONResponse({"client": client_of(request.scope), "bytes": len(body)})


ME = "node-me"


def app(access: AccessConfig, name: str = ME) -> Starlette:
    guard = Middleware(Guard, rules=RULES, credentials=Credentials(access, frozenset({name})))
    application = Starlette(middleware=[guard])
    install_error_handlers(application)
    for path in ("/health", "/member", "/api", "/either", "/unlisted"):
        application.add_route(path, echo, methods=["GET", "POST"])
    return application


def call(
    access: AccessConfig,
    method: str,
    path: str,
    *,
    host: str = "127.0.0.1",
    signer: Signer | None = None,
    **kwargs: object,
) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app(access), client=(host, 1234))
        auth = signer.auth(ME) if signer else None
        local = "http://localhost"
        async with httpx.AsyncClient(transport=transport, base_url=local, auth=auth) as c:
            return await c.request(method, path, **kwargs)  # type: ignore[arg-type]

    calls.clear()
    return run(go())


KEYED = AccessConfig(swarm_key=SWARM, api_keys=("client-key-1",))


@pytest.mark.parametrize(
    ("path", "kwargs", "status"),
    [
        ("/health", {}, 200),  # open
        ("/member", {}, 401),  # no proof
        ("/unlisted", {}, 401),  # paths no rule names need a proof too
        ("/api", {}, 401),  # no key
        ("/api", {"headers": {"Authorization": "Bearer wrong-key"}}, 401),
        ("/api", {"headers": {"Authorization": "Bearer client-key-1"}}, 200),
        ("/either", {"headers": {"Authorization": "Bearer client-key-1"}}, 200),
        ("/either", {"headers": {"X-Meshnet-Auth": "v1 t=1 n=abcdefgh s=" + "0" * 64}}, 401),
    ],
)
def test_who_gets_in(path: str, kwargs: dict[str, object], status: int) -> None:
    response = call(KEYED, "POST", path, host="10.1.2.3", content=b"x", **kwargs)
    assert response.status_code == status
    if status == 401:
        assert response.json()["error"]["type"] == "AuthError" and not calls
        assert "WWW-Authenticate" in response.headers


def test_signed_member_calls_get_in_and_a_replay_does_not() -> None:
    signer = Signer(SWARM)
    ok = call(KEYED, "POST", "/member?x=1", signer=signer, content=b"payload")
    assert ok.json() == {"client": "swarm", "bytes": 7}  # the body reached the app intact
    assert call(KEYED, "POST", "/either", signer=signer).json()["client"] == "swarm"
    wrong = call(
        KEYED, "POST", "/member", signer=Signer("another-swarm-key-padded-to-128-bits-0123456789")
    )
    assert wrong.status_code == 401


def test_a_signed_call_sent_twice_to_the_same_app_gets_in_once() -> None:
    """The same signed headers (method, path, time, nonce, body) replayed to the same app:
    the nonce store refuses the second one, and the app never sees it."""
    headers = Signer(SWARM).headers("POST", "/member", b"payload", to=ME)
    application = app(KEYED)

    async def send_twice() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=application, client=("127.0.0.1", 1234))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return [
                await client.post("/member", headers=headers, content=b"payload") for _ in range(2)
            ]

    calls.clear()
    first, replay = run(send_twice())
    assert first.status_code == 200 and first.json()["client"] == "swarm"
    assert replay.status_code == 401 and "replay" in replay.json()["error"]["message"]
    assert len(calls) == 1


def test_without_api_keys_only_loopback_clients_use_the_api() -> None:
    open_mesh = AccessConfig(swarm_key=SWARM)
    assert call(open_mesh, "GET", "/api").json()["client"] == "ip:127.0.0.1"
    far = call(open_mesh, "GET", "/api", host="192.0.2.7")
    assert far.status_code == 401 and "loopback" in far.json()["error"]["message"]
    anyone = AccessConfig(swarm_key=SWARM, allow_unauthenticated=True)
    assert call(anyone, "GET", "/api", host="192.0.2.7").status_code == 200


def test_bodies_over_the_limit_are_refused_before_the_app_sees_them() -> None:
    headers = {"Authorization": "Bearer client-key-1"}
    declared = call(KEYED, "POST", "/api", headers=headers, content=b"x" * 101)
    assert declared.status_code == 413 and declared.json()["error"]["field"] == "body"

    async def chunks():  # type: ignore[no-untyped-def]
        for _ in range(5):
            yield b"x" * 30

    streamed = call(KEYED, "POST", "/api", headers=headers, content=chunks())
    assert streamed.status_code == 413 and not calls
    assert call(KEYED, "POST", "/api", headers=headers, content=b"x" * 100).status_code == 200


def test_the_longest_rule_prefix_wins() -> None:
    rules = [rule("/v1", "client"), rule("/v1/nodes", "swarm")]
    assert match(rules, "/v1/nodes/register").needs == {"swarm"}
    assert match(rules, "/v1/models").needs == {"client"}
    assert match(rules, "/v1x").needs == {"swarm"}  # not under /v1: the default


def probe_target(key: str | None) -> httpx.ASGITransport:
    service = NodeService([], WireLimits(), WireConfig())
    service.node_id = "node-a"
    return httpx.ASGITransport(app=create_node_app(service=service, access=AccessConfig(key)))


def test_the_probe_accepts_a_member_at_its_address_and_nothing_else() -> None:
    prober = HttpProber(Signer(SWARM), transport=probe_target(SWARM))
    run(prober.probe("node-a", "http://node-a"))
    for node_id, target in (
        ("node-b", SWARM),
        ("node-a", "a-different-swarm-key-padded-to-128-bits-0123456789"),
    ):
        prober = HttpProber(Signer(SWARM), transport=probe_target(target))
        with pytest.raises(MeshError) as refused:
            run(prober.probe(node_id, "http://node-a"))
        assert refused.value.field == "address"
    unreachable = HttpProber(Signer(SWARM), timeout_s=0.5)
    with pytest.raises(MeshError, match="did not answer the tracker.s probe"):
        run(unreachable.probe("node-a", "http://127.0.0.1:9"))


def test_only_the_trackers_own_entry_node_skips_the_probe() -> None:
    inner = TrustingProber()
    prober = OwnNodeTrusted(inner, "entry-1", "http://127.0.0.1:8000")
    run(prober.probe("entry-1", "http://127.0.0.1:8000"))
    run(prober.probe("entry-1", "http://10.0.0.9:8000"))  # same id elsewhere: probed
    run(prober.probe("node-b", "http://127.0.0.1:8000"))  # another id here: probed
    assert inner.probed == [
        ("entry-1", "http://10.0.0.9:8000"),
        ("node-b", "http://127.0.0.1:8000"),
    ]


@pytest.mark.parametrize(
    ("host", "status"),
    [("localhost:8000", 200), ("127.0.0.1", 200), ("[::1]:8000", 200), ("evil.example", 401)],
)
def test_keyless_loopback_trust_needs_a_local_host_name(host: str, status: int) -> None:
    """Review finding 5: DNS rebinding makes a browser page on this machine a loopback
    caller, but its requests still name the page's own host."""
    response = call(AccessConfig(swarm_key=SWARM), "GET", "/api", headers={"Host": host})
    assert response.status_code == status
    if status == 401:
        assert response.json()["error"]["field"] == "Host"


def send(application: Starlette, method: str, path: str, **kwargs: object) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=application, client=("127.0.0.1", 1234))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            return await c.request(method, path, **kwargs)  # type: ignore[arg-type]

    return run(go())


def test_a_proof_accepted_by_one_member_is_refused_by_another() -> None:
    """Review finding 4: the same signed call, sent on to a second member, got in there too."""
    headers = Signer(SWARM).headers("POST", "/member", b"payload", to=ME)
    assert send(app(KEYED), "POST", "/member", headers=headers, content=b"payload").is_success
    other = send(app(KEYED, "node-b"), "POST", "/member", headers=headers, content=b"payload")
    assert other.status_code == 401 and "addressed to 'node-me'" in other.json()["error"]["message"]


def test_a_frame_header_changed_after_signing_is_refused() -> None:
    frame = {"X-Meshnet-Session": "s1", "X-Meshnet-Position": "0"}
    proof = Signer(SWARM).headers("POST", "/member", b"p", to=ME, headers=frame)
    assert send(app(KEYED), "POST", "/member", headers=frame | proof, content=b"p").is_success
    proof = Signer(SWARM).headers("POST", "/member", b"p", to=ME, headers=frame)
    moved = frame | proof | {"X-Meshnet-Position": "9"}
    calls.clear()
    refused = send(app(KEYED), "POST", "/member", headers=moved, content=b"p")
    assert refused.status_code == 401 and not calls


def test_answers_to_members_are_signed_and_checked() -> None:
    signer = Signer(SWARM)
    answer = call(KEYED, "POST", "/member", signer=signer, content=b"payload")
    assert answer.headers["X-Meshnet-Answer"].startswith("v2 s=")  # checked by the client
    client = call(KEYED, "POST", "/api", headers={"Authorization": "Bearer client-key-1"})
    assert "X-Meshnet-Answer" not in client.headers  # clients hold no key to check it with


class Tamper:
    """A man in the middle that changes answers: their bodies, or strips their MAC."""

    def __init__(self, inner: Starlette, strip: bool) -> None:
        self.inner, self.strip = inner, strip

    async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
        async def changed(message):  # type: ignore[no-untyped-def]
            if message["type"] == "http.response.start" and self.strip:
                message = {**message, "headers": message["headers"][:-1]}
            if message["type"] == "http.response.body" and not self.strip:
                message = {**message, "body": message["body"].replace(b"7", b"8")}
            await send(message)

        await self.inner(scope, receive, changed)


@pytest.mark.parametrize("strip", [True, False])
def test_a_changed_or_unsigned_answer_is_refused(strip: bool) -> None:
    """The agent's tracker client checks answers this way: an unsigned directive is dropped
    like a broken connection."""

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=Tamper(app(KEYED), strip), client=("127.0.0.1", 1))
        auth = Signer(SWARM).auth(ME)
        async with httpx.AsyncClient(transport=transport, base_url="http://x", auth=auth) as c:
            return await c.post("/member", content=b"payload")

    with pytest.raises(AnswerNotSigned):
        run(go())


@pytest.mark.parametrize("path", ["//member", "/health/../member", "/health//x", "//"])
def test_paths_that_only_look_open_need_a_proof(path: str) -> None:
    """Review finding 11: `rule("/")` opened every path starting with `//`."""
    assert match([rule("/"), *RULES], path).needs == {"swarm"}
    response = send(app(KEYED), "POST", path, content=b"x")
    assert response.status_code == 401


def test_websockets_are_closed_without_reaching_the_app() -> None:
    """Review finding 11: websocket scopes passed the guard unchecked."""
    application = app(KEYED)
    reached: list[str] = []

    async def socket(ws):  # type: ignore[no-untyped-def]
        reached.append("in")
        await ws.accept()

    application.router.add_websocket_route("/health", socket)
    with (
        TestClient(application) as client,
        pytest.raises(WebSocketDisconnect),
        client.websocket_connect("/health"),
    ):
        pass
    assert not reached


def test_a_nodes_tracker_client_refuses_unsigned_directives() -> None:
    client = tracker_client("http://tracker:1", AccessConfig(swarm_key=SWARM))
    assert isinstance(client.auth, CheckedSwarmAuth) and client.auth.to == "tracker"
    run(client.aclose())


def test_real_tracker_and_node_apps_answer_members_with_signed_answers() -> None:
    """Nothing outside the guard may change an answer it signed (the wire-version header
    once did, and every node's registration failed)."""
    offers = [ModelOffer(ModelId("m"), 4, {"fp32": 1000})]
    registry = Registry(offers, {ModelId("m"): "m"}, dead_after_s=60.0, clock=lambda: 0.0)
    tracker = create_tracker_app(
        registry, TrackerConfig(), prober=TrustingProber(), access=AccessConfig(swarm_key=SWARM)
    )

    async def go() -> list[httpx.Response]:
        answers = []
        for application, to, path in (
            (tracker, "tracker", "/v1/coverage"),
            (probe_target(SWARM).app, "node-a", "/v1/identity?challenge=" + "c" * 32),
        ):
            transport = httpx.ASGITransport(app=application, client=("10.0.0.2", 1))
            auth = Signer(SWARM).auth(to)
            async with httpx.AsyncClient(transport=transport, base_url="http://x", auth=auth) as c:
                answers.append(await c.get(path))
        return answers

    answers = run(go())
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
