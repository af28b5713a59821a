"""Reading a request body under the guard: its limit, a deadline, the process's in-flight
budget, and its SHA-256 computed as it streams (the swarm proof covers it).

A body is refused (413) before a byte is read when it declares more than its limit, and
while it is read once it passes that limit. The bodies every request of a process holds
in memory at once are capped (`InFlight`): past that, new bodies are refused (503) until
those in flight are done. A body that stalls longer than `idle_s` between pieces, or is
slower overall than `deadline_s` plus `min_bytes_per_s`, is given up (408): a slowloris
holds a connection for seconds, not forever.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

from starlette.types import Message, Receive

from meshnet.errors import PayloadTooLargeError, SlowRequestError, UnavailableError

MiB = 1 << 20


@dataclass(frozen=True)
class BodyLimits:
    """How long a body may take, and how much of them a process holds at once."""

    idle_s: float = 10.0  # at most this long between two pieces of a body
    deadline_s: float = 10.0  # plus size / min_bytes_per_s for the whole body
    min_bytes_per_s: float = 1 * MiB
    max_in_flight_bytes: int = 512 * MiB  # bodies buffered by all requests at once


class InFlight:
    """Bytes of request bodies this process holds now, never more than its cap."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used = 0

    def take(self, size: int) -> None:
        """Count `size` more bytes, or refuse (503) when they would pass the cap."""
        if self.used + size > self.max_bytes:
            raise UnavailableError(
                f"this process holds {self.used} bytes of request bodies already (cap "
                f"{self.max_bytes}); try again shortly",
                field="body",
            )
        self.used += size

    def give(self, size: int) -> None:
        self.used -= size


@dataclass(frozen=True)
class Body:
    data: bytes
    sha256: str  # hex digest of `data`


async def read_body(
    declared: str | None,
    receive: Receive,
    max_bytes: int,
    budget: InFlight,
    limits: BodyLimits = BodyLimits(),
) -> Body:
    """The whole body, counted in `budget` (the caller gives `len(data)` back when done)."""
    small = declared is not None and declared.isdigit() and len(declared) < 20
    if declared is not None and small and int(declared) > max_bytes:
        raise PayloadTooLargeError(
            f"body of {declared} bytes exceeds this endpoint's limit of {max_bytes}", field="body"
        )
    loop = asyncio.get_running_loop()
    digest, parts, size, more = hashlib.sha256(), list[bytes](), 0, True
    started = loop.time()
    try:
        while more:
            allowed = limits.deadline_s + size / limits.min_bytes_per_s - (loop.time() - started)
            message = await _next(receive, min(limits.idle_s, max(allowed, 0.0)), size)
            if message["type"] != "http.request":
                break  # the client went away
            piece = bytes(message.get("body", b""))
            if size + len(piece) > max_bytes:
                raise PayloadTooLargeError(
                    f"body exceeds this endpoint's limit of {max_bytes} bytes", field="body"
                )
            budget.take(len(piece))
            size += len(piece)
            digest.update(piece)
            parts.append(piece)
            more = bool(message.get("more_body", False))
    except BaseException:
        budget.give(size)
        raise
    return Body(b"".join(parts), digest.hexdigest())


async def _next(receive: Receive, timeout_s: float, size: int) -> Message:
    try:
        return await asyncio.wait_for(receive(), timeout_s)
    except TimeoutError:
        raise SlowRequestError(
            f"the request body stalled after {size} bytes; giving up", field="body"
        ) from None
