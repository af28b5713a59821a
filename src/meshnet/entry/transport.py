"""Sending activation frames to the next hop: the `Transport` seam, over HTTP and in-process.

`HttpTransport` posts binary frames (ADR-0008) with aiohttp, which measured ~2x faster per
loopback hop than httpx (ADR-0011). `InProcessTransport` is the fake: it runs runners by
address in this process, but still encodes and decodes every frame.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Protocol

import aiohttp
import torch

from meshnet.config import WireConfig, WireLimits
from meshnet.entry.inbox import Inbox
from meshnet.errors import HopError, MeshError, PushError, WireError, read_error
from meshnet.node.post import AnswerTooLarge, FramePoster
from meshnet.node.runner import ShardRunner
from meshnet.observe.metrics import Metrics
from meshnet.security.ownership import PROCESS_KEYS, PROOF, Body, SessionKeys
from meshnet.security.signing import Signer
from meshnet.security.swarm import ANSWER_HEADER, route_proof
from meshnet.types import Hop, LayerSpan, NodeId, SessionId
from meshnet.wire import FrameMeta, decode, encode, require_finite
from meshnet.wire.frame import tensor_bytes
from meshnet.wire.headers import ENCODING, LAYERS
from meshnet.wire.links import LinkRates
from meshnet.wire.route import MAX_ANSWER_BYTES, SHARE_OF_BUDGET, PushRoute, Reply, passed_back
from meshnet.wire.tensors import as_tensor

log = logging.getLogger(__name__)


class Transport(Protocol):
    """Carries one frame through one hop, and closes sessions on hops."""

    async def forward(self, hop: Hop, meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden` [B, T, H] into `hop` for layers `meta.span`; its output, bf16."""
        ...

    async def push(self, hops: list[Hop], meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden` [B, T, H] through all of `hops`, each sending its output to the next
        itself (ADR-0034); the last hop's output. A `HopError` names the hop that failed."""
        ...

    async def close_session(self, hop: Hop, session: SessionId, keep: bool = False) -> None:
        """End `session` on `hop`: drop its cache, or with `keep` keep it as a prefix to fork
        from (ADR-0058); never raises."""
        ...


class Peers(Protocol):
    """The node's record of the peers it sends frames to (their round trips are measured)."""

    def seen(self, node_id: str, address: str) -> None: ...


class NoPeers:
    def seen(self, node_id: str, address: str) -> None:
        return None


class HttpTransport:
    """Frames over HTTP/1.1 keep-alive connections; one client session per event loop."""

    def __init__(
        self,
        wire: WireConfig = WireConfig(),
        limits: WireLimits = WireLimits(),
        timeout_s: float = 60.0,
        signer: Signer | None = None,
        metrics: Metrics | None = None,
        tls: ssl.SSLContext | None = None,
        inbox: Inbox | None = None,
        reply: Reply | None = None,
        peers: Peers | None = None,
        links: LinkRates | None = None,
        keys: SessionKeys = PROCESS_KEYS,
    ) -> None:
        self.keys = keys  # signs for the sessions this process opened (ADR-0049)
        self.peers = peers or NoPeers()  # the hops it sends to, pinged for their RTT
        self.links = links or LinkRates()  # their links' rates, for `auto` (ADR-0037)
        self.wire = wire
        self.timeout_s = timeout_s
        self.inbox = inbox or Inbox()  # where pushed steps wait for their last hop (ADR-0034)
        self.reply = reply  # this entry's node id and address; None: it cannot push
        self.metrics = metrics or Metrics()
        self.limits = limits
        self.signer = signer or Signer(None)  # proves swarm membership to every hop
        self.tls = tls  # verifies https hops (None: the system's CAs)
        # a dead host fails fast at connect; a slow prefill chunk may take up to timeout_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(2.0, timeout_s))
        self._client: aiohttp.ClientSession | None = None
        self.poster = FramePoster(wire, self.links, self.signer, self._count_sent, self._session)

    def _count_sent(self, encoding: str, nbytes: int) -> None:
        self.metrics.bytes_sent.labels(encoding).inc(nbytes)

    def _session(self) -> aiohttp.ClientSession:
        if self._client is None or self._client.closed:
            # frames carry their own encoding: an HTTP Content-Encoding is never undone, so
            # a 149 KB gzip answer stays 149 KB (a hop's body is capped as it is read)
            connector = aiohttp.TCPConnector(ssl=self.tls or True)
            self._client = aiohttp.ClientSession(
                timeout=self.timeout, auto_decompress=False, connector=connector
            )
        return self._client

    async def forward(self, hop: Hop, meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        owned = {PROOF: signed_for(self.keys, meta, (hop.span,), hidden)}
        status, headers, body, _ = await self._post(
            hop, meta, hidden, owned, self.limits.max_body_bytes
        )
        if status != 200:
            raise hop_error(hop, status, body)
        output = checked_output(hop, headers, body, self.limits, meta, hidden)
        self.metrics.bytes_received.labels(headers.get(ENCODING, "none")).inc(len(body))
        return output

    async def push(self, hops: list[Hop], meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        if self.reply is None:
            raise HopError("this entry has no address to be pushed to", status=None, hop=hops[0])
        route = PushRoute(tuple(hops), self.reply)
        proof = route_proof(self.signer.key, meta.session, meta.model, *route.signed())
        waiter = self.inbox.expect(meta.session, meta.position, hops[-1].span, tuple(hidden.shape))
        sent = replace(meta, span=hops[0].span)
        post = asyncio.ensure_future(self._push_first(route, sent, hidden, proof))
        try:
            waiting: set[asyncio.Future[Any]] = {post, waiter}
            done, _ = await asyncio.wait(
                waiting, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if waiter.done():
                return as_tensor(waiter.result())  # posted bf16 bits, as a tensor
            if post in done:
                post.result()  # raises the failure the chain passed back
                raise HopError(f"hop {hops[-1]} never posted its output", status=None, hop=hops[-1])
            raise HopError(
                f"hop {hops[0]} timed out after {self.timeout_s} s", status=None, hop=hops[0]
            )
        finally:
            self.inbox.cancel(meta.session, meta.position)
            _unwinding.add(post)  # the chain's answers come after the output: not waited for
            post.add_done_callback(_settled)

    async def _push_first(
        self, route: PushRoute, meta: FrameMeta, hidden: torch.Tensor, proof: str
    ) -> None:
        """The call to the route's first hop; returns once the chain answered it."""
        first = route.hops[0]
        extra = route.headers(proof, int(1000 * self.timeout_s * SHARE_OF_BUDGET))
        extra[PROOF] = signed_for(self.keys, meta, tuple(hop.span for hop in route.hops), hidden)
        status, _, body, signed = await self._post(first, meta, hidden, extra, MAX_ANSWER_BYTES)
        if status != 200:
            error = passed_back(first.node_id, status, body)
            if not signed:  # review N9: unsigned words naming another node are the first's
                error = PushError(
                    f"{first.node_id} answered {status} (unsigned)",
                    failed=first.node_id,
                    status=status,
                )
            raise blamed(route, error)

    async def _post(
        self,
        hop: Hop,
        meta: FrameMeta,
        hidden: torch.Tensor,
        extra: dict[str, str],
        max_bytes: int,
    ) -> tuple[int, Mapping[str, str], bytes, bool]:
        """POST one signed frame to `hop`'s `/forward`: its answer's status, headers, body
        (at most `max_bytes`) and whether the hop signed it. A 200 answer must be signed
        (else a `HopError`); it times the link (ADR-0037)."""
        self.peers.seen(hop.node_id, hop.address)
        try:
            answer = await self.poster.post(
                hop.node_id, hop.address, "/forward", meta, hidden, extra, max_bytes=max_bytes
            )
        except AnswerTooLarge as exc:
            raise HopError(f"hop {hop} {exc}", status=None, hop=hop) from exc
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise HopError(f"hop {hop} failed: {exc!r}", status=None, hop=hop) from exc
        if answer.status == 200 and not answer.signed:
            raise HopError(f"hop {hop}: {ANSWER_HEADER} is missing or wrong", status=None, hop=hop)
        return answer.status, answer.headers, answer.body, answer.signed

    async def close_session(self, hop: Hop, session: SessionId, keep: bool = False) -> None:
        path = f"/sessions/{session}" + ("?keep=1" if keep else "")
        headers = {PROOF: self.keys.close_proof(session, hop.node_id, keep)}
        headers |= self.signer.headers("DELETE", path, to=hop.node_id, headers=headers)
        try:
            async with self._session().delete(
                f"{hop.address}{path}", timeout=aiohttp.ClientTimeout(total=5.0), headers=headers
            ) as response:
                await response.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("could not close session %s on %s: %r", session, hop, exc)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()


def signed_for(
    keys: SessionKeys, meta: FrameMeta, spans: tuple[LayerSpan, ...], hidden: torch.Tensor
) -> str:
    """The session proof of `meta` for the hops holding `spans`, naming the tensor the first
    of them is sent (`hidden`, [1, T, H], as bf16 on the wire: review S1)."""
    body = Body.of(tensor_bytes(hidden), tuple(hidden.shape))
    return keys.frame_proof(meta, spans, body)


def checked_output(
    hop: Hop,
    headers: Mapping[str, str],
    body: bytes,
    limits: WireLimits,
    sent: FrameMeta,
    hidden_in: torch.Tensor,
) -> torch.Tensor:
    """A hop's answer decoded; a `HopError` when it is not what we asked for.

    The answer must be the frame we sent, transformed: same session, layers, position and
    shape ([B, T, H] in, [B, T, H] out). A malformed frame, another shape, or non-finite
    values are signs of a faulty (or hostile) node: failing over to another copy beats
    passing garbage to the next hop, which would then be blamed, or to the user.
    """
    try:
        meta, hidden = decode(headers, body, limits)
        got = (meta.session, meta.span, meta.position, tuple(hidden.shape))
        wanted = (sent.session, hop.span, sent.position, tuple(hidden_in.shape))
        if got != wanted:
            raise WireError(f"the answer is (session, layers, position, shape) {got}, not {wanted}")
        require_finite(hidden)
    except WireError as exc:
        raise HopError(f"hop {hop} sent a bad frame: {exc.message}", status=None, hop=hop) from exc
    return hidden


_unwinding: set[asyncio.Future[None]] = set()  # pushed calls whose answers are still coming


def _settled(post: asyncio.Future[None]) -> None:
    _unwinding.discard(post)
    if not post.cancelled() and post.exception() is not None:
        log.debug("a pushed step's chain answered late: %s", post.exception())


def blamed(route: PushRoute, error: PushError) -> HopError:
    """The `HopError` for the hop a push error names (the last hop when it is the entry
    that it could not reach; the first when the name is on no hop: it lied)."""
    by_id = {hop.node_id: hop for hop in route.hops}
    if error.failed == route.reply.node_id:
        hop = route.hops[-1]
    else:
        hop = by_id.get(NodeId(error.failed), route.hops[0])
    return HopError(
        f"hop {hop} failed a pushed step: {error.message}", status=error.status, hop=hop
    )


def hop_error(hop: Hop, status: int, body: bytes) -> HopError:
    """A `HopError` carrying the remote node's own error message when it sent one."""
    error = read_error(body)
    if error is not None:
        message, field = error.message[:300], error.field  # the hop's words
    else:
        message, field = body[:200].decode("utf-8", "replace"), None
    failure = HopError(f"hop {hop} answered {status}: {message}", status=status, hop=hop)
    # "this node serves other layers": it dropped the span since our route was drawn
    failure.stale = status == 400 and field == LAYERS
    return failure


class InProcessTransport:
    """The fake: runners by address in this process, each frame encoded and decoded."""

    def __init__(self, runners: Mapping[str, ShardRunner], wire: WireConfig = WireConfig()) -> None:
        self.runners = runners
        self.wire = wire
        self.closed: list[tuple[str, SessionId]] = []
        self.frames: list[tuple[str, int, int, int]] = []  # (address, tokens, index, total)
        self.dead: set[str] = set()  # addresses that fail like a killed process
        self.pushes = 0  # steps pushed through a whole route
        self.before_frame: Callable[[str, FrameMeta], None] = lambda address, meta: None

    async def forward(self, hop: Hop, meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        frame = encode(hidden, meta, self.wire)
        meta, hidden = decode(frame.headers, bytes(frame.body))
        await asyncio.sleep(0)  # a network hop yields: concurrent sessions interleave here
        self.before_frame(hop.address, meta)
        if hop.address in self.dead:
            raise HopError(f"hop {hop} failed: connection refused", status=None, hop=hop)
        self.frames.append((hop.address, hidden.shape[1], meta.chunk_index, meta.chunk_total))
        try:
            out = self.runners[hop.address].forward(meta, hidden)
        except MeshError as exc:
            raise HopError(
                f"hop {hop} answered {exc.http_status}: {exc.message}",
                status=exc.http_status,
                hop=hop,
            ) from exc
        back = encode(out, meta, self.wire)
        return checked_output(hop, back.headers, bytes(back.body), WireLimits(), meta, hidden)

    async def push(self, hops: list[Hop], meta: FrameMeta, hidden: torch.Tensor) -> torch.Tensor:
        self.pushes += 1
        for hop in hops:
            hidden = await self.forward(hop, replace(meta, span=hop.span), hidden)
        return hidden

    async def close_session(self, hop: Hop, session: SessionId, keep: bool = False) -> None:
        self.closed.append((hop.address, session))
        if hop.address not in self.dead:
            self.runners[hop.address].drop(session, keep)
