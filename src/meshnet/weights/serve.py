"""Weights served to members: a model's manifest and byte ranges of its parts (ADR-0054).

    GET /v1/weights/{digest}/manifest       the manifest's canonical JSON
    GET /v1/weights/{digest}/parts/{name}   `Range: bytes=a-b` of one part (206), at most
                                            `MAX_RANGE_BYTES` a call

Members only (the access guard's `swarm` rule signs every answer over its body). Bytes are
read from the file (`os.pread`) for each range, never a whole tensor in memory; a member's
uploads keep to its `--weights-upload-limit` by delaying answers.

Members are not trusted with this process's memory (review W3: 256 ranges asked and never
read took a tracker from 345 to 4,444 MiB): the ranges being answered hold at most
`MAX_IN_FLIGHT_BYTES` in all and `PEER_IN_FLIGHT_BYTES` for one address (503 beyond), and
an answer the asker does not take within `WRITE_DEADLINE_S` is given up.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from meshnet.errors import NotHeldError, RangeError, WeightsBusyError
from meshnet.observe.metrics import Metrics
from meshnet.security.access import Rule, rule
from meshnet.weights.manifest import DIGEST_PATTERN, Part
from meshnet.weights.store import HeldFile, WeightStore

MAX_RANGE_BYTES = 16 << 20
MAX_IN_FLIGHT_BYTES = 64 << 20  # ranges being answered at once, all askers together
PEER_IN_FLIGHT_BYTES = 32 << 20  # ... from one address
WRITE_DEADLINE_S = 30.0  # to take an answer's bytes, once sent
log = logging.getLogger(__name__)
_RANGE = re.compile(r"^bytes=(\d{1,15})-(\d{0,15})$")


def parse_range(header: str | None, nbytes: int) -> tuple[int, int]:
    """`[start, end)` of a part of `nbytes` bytes that `Range: bytes=a-b` (inclusive) asks for;
    no header: the whole part. RangeError for anything else, a range past the part's end,
    or more than `MAX_RANGE_BYTES`."""
    if header is None:
        start, end = 0, nbytes
    else:
        match = _RANGE.match(header.strip())
        if match is None:
            raise RangeError(f"Range must be bytes=START-END, got {header[:60]!r}", field="Range")
        start = int(match.group(1))
        end = int(match.group(2)) + 1 if match.group(2) else nbytes
        if start >= end or end > nbytes:
            raise RangeError(
                f"Range {header.strip()} is outside the part's {nbytes} bytes", field="Range"
            )
    if end - start > MAX_RANGE_BYTES:
        raise RangeError(
            f"ask for at most {MAX_RANGE_BYTES} bytes a call (Range), not {end - start}",
            field="Range",
        )
    return start, end


class UploadLimit:
    """Keeps uploads to `bytes_per_s` on average: each answer waits its turn (None: no limit)."""

    def __init__(self, bytes_per_s: float | None, clock: Callable[[], float] = time.monotonic):
        self.bytes_per_s = bytes_per_s
        self.clock = clock
        self.free_at_s = 0.0  # when the uploads booked so far are done

    def book(self, nbytes: int) -> float:
        """Book `nbytes`; the seconds to wait before sending them."""
        if not self.bytes_per_s:
            return 0.0
        now = self.clock()
        start = max(now, self.free_at_s)
        self.free_at_s = start + nbytes / self.bytes_per_s
        return self.free_at_s - now


class WeightServer:
    """Answers weights calls from what `store` holds."""

    def __init__(
        self, store: WeightStore, limit: UploadLimit | None = None, metrics: Metrics | None = None
    ) -> None:
        self.store = store
        self.limit = limit or UploadLimit(None)
        self.metrics = metrics
        self.in_flight: dict[str, int] = {}  # bytes of ranges being answered, by address
        self.total = 0  # ... all together

    def _held(self, request: Request) -> HeldFile:
        digest = request.path_params["digest"]
        held = self.store.files.get(digest) if re.match(DIGEST_PATTERN, digest) else None
        if held is None:
            raise NotHeldError(f"this member holds no model {digest[:64]!r}", field="digest")
        return held

    async def manifest(self, request: Request) -> Response:
        held = self._held(request)
        return Response(held.manifest.canonical(), media_type="application/json")

    async def part(self, request: Request) -> Response:
        held = self._held(request)
        name = request.path_params["name"]
        part = held.manifest.part(name)
        if part is None or name not in held.held:
            raise NotHeldError(
                f"this member holds no part {name[:256]!r} of that model", field="name"
            )
        start, end = parse_range(request.headers.get("range"), part.nbytes)
        peer = request.client.host if request.client else "?"
        self.take(peer, end - start)
        try:
            wait_s = self.limit.book(end - start)
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            data = await asyncio.to_thread(_read, held, part, start, end)
        except BaseException:
            self.give(peer, end - start)
            raise
        if self.metrics is not None:
            self.metrics.weights_served.inc(len(data))
        headers = {"Content-Range": f"bytes {start}-{end - 1}/{part.nbytes}"}
        return _Bounded(data, lambda: self.give(peer, end - start), headers)

    def take(self, peer: str, nbytes: int) -> None:
        """Count `nbytes` against the budgets, or `WeightsBusyError` (503) when they are full."""
        mine = self.in_flight.get(peer, 0)
        if mine + nbytes > PEER_IN_FLIGHT_BYTES or self.total + nbytes > MAX_IN_FLIGHT_BYTES:
            raise WeightsBusyError(
                f"this member sends {self.total >> 20} MiB of weights now ({mine >> 20} MiB "
                f"to {peer}): ask again later",
                field="Range",
            )
        self.in_flight[peer], self.total = mine + nbytes, self.total + nbytes

    def give(self, peer: str, nbytes: int) -> None:
        left = self.in_flight.get(peer, 0) - nbytes
        if left > 0:
            self.in_flight[peer] = left
        else:
            self.in_flight.pop(peer, None)
        self.total -= nbytes


class _Bounded(Response):
    """A range's answer that gives its bytes back to the budget once sent, given up or
    failed, and is given up when the asker takes none of it for `WRITE_DEADLINE_S`."""

    def __init__(self, data: bytes, done: Callable[[], None], headers: dict[str, str]) -> None:
        super().__init__(
            data, status_code=206, headers=headers, media_type="application/octet-stream"
        )
        self.done = done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with asyncio.timeout(WRITE_DEADLINE_S):
                await super().__call__(scope, receive, send)
        except TimeoutError:
            log.info("gave up a weights answer not taken in %.0f s", WRITE_DEADLINE_S)
        finally:
            self.done()


def _read(held: HeldFile, part: Part, start: int, end: int) -> bytes:
    fd = os.open(held.path, os.O_RDONLY)
    try:
        return os.pread(fd, end - start, part.offset + start)
    finally:
        os.close(fd)


def weight_rules() -> list[Rule]:
    """Who may fetch weights: members only."""
    return [rule("/v1/weights", "swarm")]


def add_weight_routes(app: object, server: WeightServer) -> None:
    """The weights routes on a Starlette (or FastAPI) app."""
    add = app.add_route  # type: ignore[attr-defined]
    add("/v1/weights/{digest}/manifest", server.manifest, methods=["GET"], include_in_schema=False)
    add(
        "/v1/weights/{digest}/parts/{name:path}",
        server.part,
        methods=["GET"],
        include_in_schema=False,
    )
