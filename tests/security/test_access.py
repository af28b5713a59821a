"""The access guard in front of a small app: open paths, member paths, client paths, bodies."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from meshnet.config import AccessConfig, WireConfig, WireLimits
from meshnet.errors import MeshError
from meshnet.http_errors import install_error_handlers
from meshnet.node.app import NodeService
from meshnet.node.app import create_app as create_node_app
from meshnet.security.access import Credentials, Guard, client_of, match, rule
from meshnet.security.signing import Signer
from meshnet.tracker.probe import HttpProber, OwnNodeTrusted, TrustingProber
from tests.conftest import run

SWARM = "guard-test-swarm-key"
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


def app(access: AccessConfig) -> Starlette:
    guard = Middleware(Guard, rules=RULES, credentials=Credentials(access))
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
        auth = signer.auth() if signer else None
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
    wrong = call(KEYED, "POST", "/member", signer=Signer("another-swarm-key"))
    assert wrong.status_code == 401


def test_a_signed_call_sent_twice_to_the_same_app_gets_in_once() -> None:
    """The same signed headers (method, path, time, nonce, body) replayed to the same app:
    the nonce store refuses the second one, and the app never sees it."""
    headers = Signer(SWARM).headers("POST", "/member", b"payload")
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
    for node_id, target in (("node-b", SWARM), ("node-a", "a-different-swarm-key")):
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
