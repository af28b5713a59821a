"""The guard refuses what headers show before reading a body, reads bodies under a deadline
and a process-wide budget, and checks the proof's MAC over the digest of what it read
(review finding 1: an unsigned 48 MiB POST had 48 MiB read before its 401)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from meshnet.config import AccessConfig
from meshnet.security.access import Credentials, Guard, rule
from meshnet.security.body import BodyLimits
from meshnet.security.swarm import SwarmKey, sign
from tests.conftest import run

SWARM = "body-test-swarm-key-padded-to-128-bits-0123456789"
MiB = 1 << 20
RULES = [rule("/forward", "swarm", max_body_bytes=64 * MiB), rule("/api", "client")]
ACCESS = AccessConfig(swarm_key=SWARM, api_keys=("client-key-1",))


class Stream:
    """A client sending `total` bytes in 1 MiB pieces (stalling after `stall_after`); it
    counts what the server has read."""

    def __init__(self, total: int, stall_after: int | None = None) -> None:
        self.total, self.stall_after, self.read = total, stall_after, 0

    async def __call__(self) -> Message:
        if self.stall_after is not None and self.read >= self.stall_after:
            await asyncio.sleep(3600)
        piece = min(MiB, self.total - self.read)
        self.read += piece
        return {"type": "http.request", "body": b"x" * piece, "more_body": self.read < self.total}


async def inner(scope: Scope, receive: Receive, send: Send) -> None:
    message = await receive()
    body = json.dumps({"bytes": len(message["body"])}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def scope(path: str, headers: dict[str, str]) -> Scope:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
            "query_string": b"", "headers": raw, "client": ("10.0.0.9", 1)}  # fmt: skip


async def answer(guard: Guard, s: Scope, receive: Receive) -> tuple[int, dict[str, Any]]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await guard(s, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body or b"{}")


def guard(limits: BodyLimits | None = None, app: Callable[..., Awaitable[None]] = inner) -> Guard:
    return Guard(app, RULES, Credentials(ACCESS, frozenset({"node-a"})), limits or BodyLimits())


def signed(body: bytes) -> dict[str, str]:
    """The proof a member sends with `body` to `/forward`."""
    key = SwarmKey.from_text(SWARM)
    return {"x-meshnet-auth": sign(key, "POST", b"/forward", body, time.time(), "node-a")}


def test_an_unsigned_48_mib_post_is_refused_before_a_byte_of_it_is_read() -> None:
    stream = Stream(48 * MiB)
    status, body = run(
        answer(guard(), scope("/forward", {"content-length": str(48 * MiB)}), stream)
    )
    assert status == 401 and stream.read == 0
    assert "proof" in body["error"]["message"]


def test_a_stale_or_malformed_proof_and_a_missing_api_key_read_nothing() -> None:
    for path, headers in [
        ("/forward", {"x-meshnet-auth": "v1 t=1 n=abcdefgh s=" + "0" * 64}),  # 1970: stale
        ("/forward", {"x-meshnet-auth": "v2 nonsense"}),
        ("/api", {"authorization": "Bearer wrong-key"}),
    ]:
        stream = Stream(8 * MiB)
        status, _ = run(answer(guard(), scope(path, headers), stream))
        assert status == 401 and stream.read == 0, (path, headers)


def test_the_mac_covers_the_body_as_streamed() -> None:
    body = b"x" * (3 * MiB)
    status, answered = run(answer(guard(), scope("/forward", signed(body)), Stream(3 * MiB)))
    assert status == 200 and answered == {"bytes": 3 * MiB}
    tampered = signed(b"y" * (3 * MiB))  # a proof for other bytes
    status, answered = run(answer(guard(), scope("/forward", tampered), Stream(3 * MiB)))
    assert status == 401 and "does not match" in answered["error"]["message"]


def test_a_stalled_body_is_given_up_after_the_idle_limit() -> None:
    limits = BodyLimits(idle_s=0.2, deadline_s=0.2)
    stream = Stream(4 * MiB, stall_after=MiB)
    headers = signed(b"x" * (4 * MiB))

    async def timed() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        status, _ = await answer(guard(limits), scope("/forward", headers), stream)
        return status, loop.time() - started

    status, took_s = run(timed())
    assert status == 408 and took_s < 2.0


def test_bodies_in_flight_are_capped_per_process_and_given_back() -> None:
    """A body that would pass the process's in-flight cap is refused (503) while another is
    held by the app; once that one is done, the same body is taken."""
    release = asyncio.Event()

    async def holding(s: Scope, receive: Receive, send: Send) -> None:
        await release.wait()
        await inner(s, receive, send)

    shared = guard(BodyLimits(max_in_flight_bytes=5 * MiB), holding)
    body = b"x" * (3 * MiB)

    async def scenario() -> list[int]:
        first = asyncio.create_task(
            answer(shared, scope("/forward", signed(body)), Stream(3 * MiB))
        )
        await asyncio.sleep(0.05)
        second, _ = await answer(shared, scope("/forward", signed(body)), Stream(3 * MiB))
        release.set()
        done, _ = await first
        third, _ = await answer(shared, scope("/forward", signed(body)), Stream(3 * MiB))
        return [done, second, third]

    assert run(scenario()) == [200, 503, 200]
    assert shared.in_flight.used == 0
