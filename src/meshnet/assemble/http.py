"""uvicorn as every meshnet process runs it: connections capped, headers capped and on a
deadline (review finding 1: 8 MiB of headers got a 200; a half-sent request stayed open).

uvicorn's httptools protocol has no header-size cap and no deadline for a request's
headers (its keep-alive timeout covers only idle connections between requests), so
`GuardedHttpTools` adds both: a request whose URL and headers pass `max_header_bytes` is
answered 431 and the connection closed; a connection that has not sent a complete set of
headers `header_timeout_s` after it opened (or after its last response) is closed. Body
deadlines are the access guard's (`security/body.py`).

Connections that have not finished their first request's headers are also capped, apart
from the process's connection cap: past `max_pending_connections` the oldest of them is
closed to make room (review N1: 1,100 half-sent requests held the tracker's 1,024
connections, every member call got 503 and every node was declared dead). A member sends
its headers as it connects, so a stranger opening sockets can only evict its own. Past
`max_connections`, `member_reserve` more are kept for calls carrying a swarm proof (review
N1: complete kept-alive requests took the whole cap); a made-up proof gets in only to be
refused by the guard, and counted against its address.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)
KiB = 1 << 10


@dataclass(frozen=True)
class ServerLimits:
    max_connections: int = 1024  # open connections (and requests in flight); 503 beyond...
    member_reserve: int = 128  # ...but for calls carrying a swarm proof: this many more
    max_pending_connections: int = 256  # not done with their first headers; oldest closed
    max_header_bytes: int = 64 * KiB  # request line and headers together; 431 beyond
    header_timeout_s: float = 3.0  # to send a request's headers, once connected
    keep_alive_s: int = 5  # an idle connection between requests is closed after this


class HeadersTooLarge(Exception):
    """Raised from the parser's callbacks: uvicorn turns it into an answer and a close."""


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header-size cap and a header deadline."""

    limits = ServerLimits()  # set per server by `server_config`
    # this server's connections still sending their first headers, oldest first
    pending: dict[GuardedHttpTools, None] = {}

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_bytes, self._too_large = 0, False
        self._deadline: asyncio.TimerHandle | None = None
        self._arm()
        self.pending[self] = None
        if len(self.pending) > self.limits.max_pending_connections:
            oldest = next(iter(self.pending))
            self.pending.pop(oldest)
            log.debug("closing the oldest connection still sending its headers: room for one")
            oldest.transport.close()

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.limits.header_timeout_s, self._expire)

    def _expire(self) -> None:
        if not self.transport.is_closing():
            log.info("closing a connection that sent no complete headers in time")
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.limits.max_header_bytes:
            self._too_large = True
            raise HeadersTooLarge

    def on_headers_complete(self) -> None:
        # a call with a swarm proof may use the reserve (review N1: 1,030 kept-alive
        # connections asking /health took every slot; the guard checks the proof next)
        signed = any(name == b"x-meshnet-auth" for name, _ in self.headers)
        reserve = self.limits.member_reserve if signed else 0
        self.limit_concurrency = self.limits.max_connections + reserve
        self.pending.pop(self, None)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's headers get their own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self.pending.pop(self, None)
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        if not self._too_large:
            super().send_400_response(msg)
            return
        body = (
            b'{"error":{"message":"request headers exceed %d bytes","type":"LimitError",'
            b'"param":"headers","code":null,"field":"headers"}}' % self.limits.max_header_bytes
        )
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()


def server_config(
    app: Any, host: str, port: int, limits: ServerLimits, **extra: Any
) -> uvicorn.Config:
    """The uvicorn config of a meshnet process serving `app`."""
    protocol = type("Guarded", (GuardedHttpTools,), {"limits": limits, "pending": {}})
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        http=protocol,
        limit_concurrency=limits.max_connections + limits.member_reserve,
        # the caller is the TCP peer: no X-Forwarded-For may make a stranger loopback
        proxy_headers=False,
        timeout_keep_alive=limits.keep_alive_s,
        **extra,
    )


@contextmanager
def in_thread(
    app: Any, port: int, limits: ServerLimits = ServerLimits(), loop: str = ""
) -> Iterator[int]:
    """`app` under uvicorn as meshnet runs it, at `port` in a daemon thread of this process
    (tests and benchmarks: several servers in one process; `loop`: another event loop than
    meshnet's); stopped when the block ends."""
    config = server_config(app, "127.0.0.1", port, limits)
    config.loop = loop or config.loop
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(5)
