"""What the fuzz tests share: a signing proxy (so fuzz cases pass the swarm-key check and
reach the handlers behind it) and a tally of cases per endpoint."""

from __future__ import annotations

import time
from collections import Counter

from starlette.types import ASGIApp, Receive, Scope, Send

from meshnet.security.access import replay_body
from meshnet.security.swarm import HEADER, SwarmKey, sign

KEY = "fuzz-swarm-key-0123456789-padded-to-128-bits-0123456789"
API_KEY = "fuzz-client-key-0001"
tally: Counter[str] = Counter()  # fuzz cases run, by "app METHOD path"
crashes: Counter[str] = Counter()  # answers of 500 and above (target: none)
statuses: Counter[tuple[str, int]] = Counter()  # answers by endpoint and status


class SigningProxy:
    """ASGI middleware for tests: signs each request with `KEY`, like a member would, and
    sends `API_KEY` as a client would (unless the request carries its own)."""

    def __init__(self, app: ASGIApp, to: str = "tracker") -> None:
        self.app = app
        self.to = to  # the receiver's name: a node's id, or `tracker`
        self.key = SwarmKey.from_text(KEY)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        parts, more = [], True
        while more:
            message = await receive()
            parts.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(parts)
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        sent = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        proof = sign(self.key, scope["method"], target, body, time.time(), self.to, sent)
        headers = [*scope["headers"], (HEADER.lower().encode(), proof.encode())]
        if all(name != b"authorization" for name, _ in headers):
            headers.append((b"authorization", f"Bearer {API_KEY}".encode()))
        await self.app({**scope, "headers": headers}, replay_body(body, receive), send)


def record(endpoint: str, status: int) -> None:
    tally[endpoint] += 1
    statuses[endpoint, status] += 1
    if status >= 500:
        crashes[endpoint] += 1


def report() -> str:
    lines = []
    for endpoint, n in sorted(tally.items()):
        seen = {code: k for (e, code), k in sorted(statuses.items()) if e == endpoint}
        lines.append(f"{n:6d}  {endpoint}  ({crashes[endpoint]} crashes) statuses {seen}")
    return "fuzz cases per endpoint:\n" + "\n".join(lines)
