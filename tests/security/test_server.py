"""uvicorn as meshnet runs it (real sockets): oversized headers get 431, a connection that
never finishes its headers is closed, a normal request is served (review finding 1)."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from meshnet.assemble.http import ServerLimits, in_thread
from meshnet.config import AccessConfig
from meshnet.security.signing import Signer
from tests.e2e.procs import free_port
from tests.security.test_access import ME, SWARM
from tests.security.test_access import app as guarded_app

LIMITS = ServerLimits(max_header_bytes=4096, header_timeout_s=0.5, max_connections=16)


async def hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hello")


def serving(
    app: Starlette, limits: ServerLimits = LIMITS, port: int | None = None, loop: str = ""
) -> contextlib.AbstractContextManager[int]:
    """`app` under uvicorn as meshnet configures it, in a thread; its port (`port`: that one;
    `loop`: another event loop than meshnet's)."""
    return in_thread(app, port or free_port(), limits, loop)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    app = Starlette()
    app.add_route("/", hello)
    with serving(app) as chosen:
        yield chosen


def exchange(port: int, data: bytes, wait_s: float = 5.0) -> tuple[bytes, float]:
    """Send `data`, read until the server closes (or `wait_s`); what came back, and when."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(wait_s)
        sock.sendall(data)
        started, received = time.monotonic(), b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            pass
        return received, time.monotonic() - started


def test_a_normal_request_is_served(port: int) -> None:
    answer, _ = exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"hello")


def test_headers_over_the_cap_get_431_and_a_close(port: int) -> None:
    big = b"X-Pad: " + b"a" * 8192 + b"\r\n"
    answer, took_s = exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 431") and b"exceed 4096 bytes" in answer
    assert took_s < 2.0  # closed by the server, not by our timeout


def test_half_sent_headers_are_closed_after_the_header_deadline(port: int) -> None:
    answer, took_s = exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n")  # never ends them
    assert answer == b"" and took_s < 2.0  # the deadline is 0.5 s; before it was never


def test_the_next_request_on_a_kept_alive_connection_has_a_deadline_too(port: int) -> None:
    first = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    answer, took_s = exchange(port, first + b"GET / HTTP/1.1\r\nHost: x\r\n")
    assert answer.count(b"HTTP/1.1 200") == 1 and took_s < 2.0


async def who(request: Request) -> PlainTextResponse:
    return PlainTextResponse(str(request.client.host if request.client else None))


def test_forwarded_headers_never_change_who_the_caller_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding 5: with FORWARDED_ALLOW_IPS=* (common in containers) uvicorn took
    X-Forwarded-For as the caller, so "X-Forwarded-For: 127.0.0.1" made a stranger loopback.
    The caller is the TCP peer, whatever the headers say."""
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "*")
    app = Starlette()
    app.add_route("/who", who)
    with serving(app) as chosen:
        request = b"GET /who HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 203.0.113.9\r\n"
        answer, _ = exchange(chosen, request + b"Connection: close\r\n\r\n")
    assert answer.endswith(b"127.0.0.1")  # the peer, not the header's 203.0.113.9


def test_strangers_half_sent_requests_and_refusals_never_keep_members_out() -> None:
    """Review N1 and N2 from the members' own address: 1,100 half-sent requests held open
    (more than the 1,024-connection cap) and 61 refused unsigned calls; a member's signed
    calls still get 200 each time, while the stranger is throttled."""
    access = AccessConfig(swarm_key=SWARM, max_refusals_per_minute=60)
    with serving(guarded_app(access), ServerLimits()) as chosen, contextlib.ExitStack() as held:
        for _ in range(1100):
            sock = held.enter_context(socket.create_connection(("127.0.0.1", chosen)))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
        url = f"http://127.0.0.1:{chosen}"
        refused = [httpx.post(f"{url}/member").status_code for _ in range(61)]
        assert set(refused[:60]) == {401} and refused[60] == 429
        with httpx.Client(base_url=url, auth=Signer(SWARM).auth(ME)) as member:
            beats = [member.post("/member", content=b"beat").status_code for _ in range(5)]
        assert beats == [200] * 5


def test_kept_alive_complete_requests_past_the_cap_leave_room_for_members() -> None:
    """Review N1's other half: connections that each finish a `GET /health` and stay open
    took every slot, and a member's signed calls got 503. Past `max_connections` a stranger
    is answered 503; a call with a swarm proof takes one of the `member_reserve` more."""
    access = AccessConfig(swarm_key=SWARM)
    limits = ServerLimits(max_connections=16, member_reserve=4)
    with serving(guarded_app(access), limits) as chosen, contextlib.ExitStack() as held:
        for _ in range(20):
            sock = held.enter_context(socket.create_connection(("127.0.0.1", chosen)))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # complete, kept alive
            sock.recv(4096)
        url = f"http://127.0.0.1:{chosen}"
        assert httpx.get(f"{url}/health").status_code == 503  # a stranger past the cap
        with httpx.Client(base_url=url, auth=Signer(SWARM).auth(ME)) as member:
            beats = [member.post("/member", content=b"beat").status_code for _ in range(5)]
        assert beats == [200] * 5
