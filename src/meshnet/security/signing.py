"""The calling side of swarm-key proofs: headers for aiohttp, an `httpx.Auth` for httpx."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator

import httpx

from meshnet.security.swarm import HEADER, SwarmKey, sign


class Signer:
    """Signs outgoing member calls with the swarm key (no key: signs nothing)."""

    def __init__(self, key: str | None, clock: Callable[[], float] = time.time) -> None:
        self.key = SwarmKey.from_text(key) if key else None
        self.clock = clock

    def headers(self, method: str, target: str, body: bytes = b"") -> dict[str, str]:
        """`{X-Meshnet-Auth: ...}` for a call to `target` (path and query); `{}` without a key."""
        if self.key is None:
            return {}
        return {HEADER: sign(self.key, method, target.encode(), body, self.clock())}

    def auth(self) -> httpx.Auth | None:
        return SwarmAuth(self) if self.key is not None else None


class SwarmAuth(httpx.Auth):
    """httpx authentication that adds a swarm-key proof to every request."""

    requires_request_body = True

    def __init__(self, signer: Signer) -> None:
        self.signer = signer

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        target = request.url.raw_path.decode("ascii")
        request.headers.update(self.signer.headers(request.method, target, request.content))
        yield request
