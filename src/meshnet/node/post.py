"""One frame posted to a member: encoded, signed, metered, sent; its answer read (bounded),
its signature checked and its link timed (ADR-0034, ADR-0037).

The entry's transport (to its hops) and a pushing hop (to the next hop or the entry) both
send through `FramePoster`; each turns a failure into its own error (`HopError`,
`PushError`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp

from meshnet.config import WireConfig
from meshnet.security.signing import Signer
from meshnet.wire.frame import Hidden, encode
from meshnet.wire.headers import ENCODING, FrameMeta
from meshnet.wire.links import LinkRates, hold_s


@dataclass(frozen=True)
class Answer:
    """A member's answer to a posted frame."""

    status: int
    headers: Mapping[str, str]
    body: bytes
    signed: bool  # the member signed it (always True without a swarm key)


class AnswerTooLarge(Exception):
    """An answer past the caller's `max_bytes` (declared or read): the member's failure."""


class FramePoster:
    """Posts frames to members over `session()`'s connections."""

    def __init__(
        self,
        wire: WireConfig,
        links: LinkRates,
        signer: Signer,
        count_sent: Callable[[str, int], None],  # (encoding, bytes): the bytes-sent metric
        session: Callable[[], aiohttp.ClientSession],
    ) -> None:
        self.wire = wire
        self.links = links
        self.signer = signer
        self.count_sent = count_sent
        self.session = session

    async def post(
        self,
        to: str,
        address: str,
        path: str,
        meta: FrameMeta,
        hidden: Hidden,
        extra: Mapping[str, str],
        *,
        max_bytes: int,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> Answer:
        """POST `hidden` for `meta` to `path` of the member `to` at `address`, with `extra`
        headers. Raises aiohttp's errors, `TimeoutError` and `AnswerTooLarge`."""
        frame = encode(hidden, meta, self.wire, self.links.bytes_per_s(to))
        data = bytes(frame.body)
        headers = frame.headers | dict(extra)
        headers |= self.signer.headers("POST", path, data, to=to, headers=headers)
        self.count_sent(frame.headers.get(ENCODING, "none"), len(data))
        sent_s = time.perf_counter()
        session = self.session()
        url, timeout = f"{address}{path}", timeout or session.timeout
        async with session.post(url, data=data, headers=headers, timeout=timeout) as response:
            body = await bounded_read(response, max_bytes)
        signed = self.signer.signed(headers, response.status, response.headers.items(), body)
        if response.status == 200 and signed:
            took_s = time.perf_counter() - sent_s
            self.links.record(to, len(data) + len(body), took_s, hold_s(response.headers))
        return Answer(response.status, response.headers, body, signed)


async def bounded_read(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The answer's body; `AnswerTooLarge` once it passes `max_bytes`."""
    declared = response.content_length
    if declared is not None and declared > max_bytes:
        raise AnswerTooLarge(f"answered {declared} bytes (cap {max_bytes})")
    parts, size = [], 0
    async for piece in response.content.iter_any():
        size += len(piece)
        if size > max_bytes:
            raise AnswerTooLarge(f"answered over {max_bytes} bytes")
        parts.append(piece)
    return b"".join(parts)
