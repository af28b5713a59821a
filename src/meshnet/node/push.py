"""Server-to-server push (ADR-0034): a hop sends its output on itself; the entry waits for the last.

`Forwarder` is a hop's side. Before it computes a pushed frame it checks the route: the
entry's route proof, this node on the route at the frame's layers, and the same route as the
session's earlier frames. After, it posts its output to the next hop's `/forward` (or, last,
to the entry's `/push`) and answers its caller once that call was answered: 200, or a
`PushError` naming the node that failed, passed back up the chain as it came. A hop that
dies mid-step resets its caller's connection, so the hop before it names it at once; a hop
that hangs is named when the budget its caller gave it runs out (each hop gives the next 90%
of what is left, so the nearest caller to the fault times out first).

The entry's side is `entry/transport.py` (it sends the first hop its frame) and
`entry/inbox.py` (a pushed step waits there for the frame the last hop posts).
"""

from __future__ import annotations

import hmac
import logging
import ssl
import time
from collections.abc import Mapping
from dataclasses import replace

import aiohttp

from meshnet.config import WireConfig
from meshnet.errors import PushError, RequestError, SessionError, WireError
from meshnet.node.directory import Directory
from meshnet.node.peers import PeerTimes
from meshnet.node.post import AnswerTooLarge, FramePoster
from meshnet.observe.metrics import Metrics
from meshnet.security.ownership import PROOF
from meshnet.security.signing import Signer
from meshnet.security.swarm import ANSWER_HEADER, route_proof
from meshnet.types import Hop, SessionId
from meshnet.wire import FrameMeta
from meshnet.wire.frame import Hidden
from meshnet.wire.links import LinkRates
from meshnet.wire.route import (
    MAX_ANSWER_BYTES,
    PUSH_PATH,
    ROUTE,
    ROUTE_PROOF,
    SHARE_OF_BUDGET,
    PushRoute,
    passed_back,
)

log = logging.getLogger(__name__)
MAX_ROUTES = 4096  # sessions whose route a node remembers


class Forwarder:
    """A hop's side of push: checks pushed frames' routes and sends their outputs on."""

    def __init__(
        self,
        node_id: str,
        signer: Signer,
        wire: WireConfig,
        metrics: Metrics,
        tls: ssl.SSLContext | None = None,
        peers: PeerTimes | None = None,
        links: LinkRates | None = None,
    ) -> None:
        self.node_id = node_id
        self.peers = peers or PeerTimes()  # the next hops it sends to, pinged for their RTT
        self.links = links or LinkRates()  # their links' rates, for `auto` (ADR-0037)
        self.signer = signer
        self.wire = wire
        self.metrics = metrics
        self.tls = tls
        self.routes: dict[SessionId, str] = {}  # session -> the route proof it started with
        # the members it may push to (None: it knows no tracker, so it pushes to nobody)
        self.directory: Directory | None = None
        self.max_budget_ms = 60_000  # a route's budget, capped by this node's own hop timeout
        self._client: aiohttp.ClientSession | None = None

    def check(self, route: PushRoute, meta: FrameMeta, headers: Mapping[str, str]) -> None:
        """Refuse a pushed frame this node must not take (400/409), before it computes."""
        if self.signer.key is None:
            raise RequestError("this node has no swarm key: it pushes nothing on", field=ROUTE)
        given = headers.get(ROUTE_PROOF.lower(), "")
        if not hmac.compare_digest(
            route_proof(self.signer.key, meta.session, meta.model, *route.signed()), given
        ):
            raise WireError(
                f"{ROUTE_PROOF} does not match the route and session", field=ROUTE_PROOF
            )
        route.after(self.node_id, meta.span)  # raises when this node is not on it
        known = self.routes.get(meta.session)
        if known is not None and known != given and meta.position > 0:
            raise SessionError(f"session {meta.session} came by another route", field=ROUTE)
        if known is None:
            self._prune()
        self.routes[meta.session] = given

    async def check_target(self, route: PushRoute, meta: FrameMeta) -> None:
        """Refuse (400) a pushed frame whose output would go where the tracker lists no
        member (review N6: any host:port a member named), before it computes."""
        after = route.after(self.node_id, meta.span)
        target = route.reply if after is None else after
        if self.directory is None:
            raise RequestError("this node knows no tracker: it pushes to no one", field=ROUTE)
        missing = await self.directory.unlisted(meta.model, target)
        if missing is not None:
            raise RequestError(
                f"{missing}: a hop pushes only to members the tracker lists", field=ROUTE
            )

    def forget(self, session: SessionId) -> None:
        self.routes.pop(session, None)

    def _prune(self) -> None:
        """Sessions that end by expiry are never `forget`-ten: past MAX_ROUTES keep the newest
        half (far more than a node's session limit)."""
        if len(self.routes) >= MAX_ROUTES:
            self.routes = dict(list(self.routes.items())[MAX_ROUTES // 2 :])

    async def send_on(
        self,
        route: PushRoute,
        meta: FrameMeta,
        out: Hidden,
        budget_ms: int,
        since: float,
        session_proof: str | None,
    ) -> dict[str, object]:
        """Post `out` (this hop's output for `meta`) to the next hop or the entry, within what
        is left of `budget_ms` since `since` (perf_counter s), with the entry's
        `session_proof` (it covers every hop of the route); what the caller is answered."""
        after = route.after(self.node_id, meta.span)
        left_s = budget_ms / 1000 - (time.perf_counter() - since)
        if after is not None:
            self.peers.seen(after.node_id, after.address)  # measured for route choice
        if after is None:  # the last hop: its output goes to the entry, named by its layers
            target = Hop(route.reply.node_id, route.reply.address, meta.span)
            path, sent = PUSH_PATH, meta
        else:
            target, path, sent = after, "/forward", replace(meta, span=after.span)
        if left_s <= 0:
            raise PushError(
                f"no time left to reach {target.node_id}", failed=target.node_id, status=None
            )
        headers = route.headers(
            route_proof(self.signer.key, meta.session, meta.model, *route.signed()),
            int(1000 * SHARE_OF_BUDGET * left_s),
        )
        if session_proof is not None:
            headers[PROOF] = session_proof
        await self._post(target, path, sent, out, headers, SHARE_OF_BUDGET * left_s)
        return {"pushed": target.node_id}

    async def _post(
        self,
        target: Hop,
        path: str,
        meta: FrameMeta,
        out: Hidden,
        extra: dict[str, str],
        timeout_s: float,
    ) -> None:
        poster = FramePoster(self.wire, self.links, self.signer, self._count_sent, self._session)
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(2.0, timeout_s))
        failed = target.node_id
        try:
            answer = await poster.post(
                failed,
                target.address,
                path,
                meta,
                out,
                extra,
                max_bytes=MAX_ANSWER_BYTES,
                timeout=timeout,
            )
        except (TimeoutError, aiohttp.ClientError, AnswerTooLarge) as exc:
            raise PushError(f"{failed} failed: {exc!r}", failed=failed, status=None) from exc
        if answer.status != 200:
            raise passed_back(failed, answer.status, answer.body)
        if not answer.signed:  # an unsigned or forged answer: that node's failure
            raise PushError(
                f"{failed}: {ANSWER_HEADER} is missing or wrong", failed=failed, status=None
            )

    def _count_sent(self, encoding: str, nbytes: int) -> None:
        self.metrics.bytes_sent.labels(encoding).inc(nbytes)

    async def ping(self, address: str, timeout_s: float = 2.0) -> float | None:
        """The round trip (s) of `GET /health` at `address`; None when it fails."""
        started = time.perf_counter()
        try:
            async with self._session().get(
                f"{address}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                await response.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.debug("ping %s failed: %r", address, exc)
            return None
        return time.perf_counter() - started if response.status == 200 else None

    def _session(self) -> aiohttp.ClientSession:
        if self._client is None or self._client.closed:
            connector = aiohttp.TCPConnector(ssl=self.tls or True)
            self._client = aiohttp.ClientSession(auto_decompress=False, connector=connector)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
