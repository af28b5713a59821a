"""The node's HTTP app: `POST /forward` (binary activation frames), sessions, identity, health.

Every route but `/health` needs a swarm-key proof (the access guard, ADR-0017).
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from typing import Protocol, TypeVar

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

from meshnet import __version__
from meshnet.config import AccessConfig, WireConfig, WireLimits
from meshnet.errors import (
    LimitError,
    PayloadTooLargeError,
    RequestError,
    SessionError,
    SessionNotFoundError,
    UnavailableError,
)
from meshnet.http_errors import WireVersionHeader, install_error_handlers
from meshnet.node.compute import HostTurns
from meshnet.node.peers import PeerTimes
from meshnet.node.push import Forwarder
from meshnet.node.runner import ShardRunner
from meshnet.node.scheduler import Scheduler
from meshnet.node.shards import ShardTable
from meshnet.node.threads import ComputeThreads
from meshnet.observe.logs import session_context
from meshnet.observe.metrics import Metrics
from meshnet.security.access import Credentials, Guard, Rule, rule
from meshnet.security.ownership import PROOF, check_close, check_frame
from meshnet.security.signing import Signer
from meshnet.security.swarm import SwarmKey, challenge_proof
from meshnet.security.vouch import TrackerKeys
from meshnet.tracker import messages as msg
from meshnet.types import SessionId, is_valid_id
from meshnet.weights.serve import WeightServer, add_weight_routes, weight_rules
from meshnet.wire import FrameMeta, compression, decode_bits, encode, require_finite
from meshnet.wire import headers as h
from meshnet.wire.frame import Hidden, tensor_bytes
from meshnet.wire.links import LinkRates, hold_header
from meshnet.wire.route import budget_ms, parse_route

log = logging.getLogger(__name__)
T = TypeVar("T")
Lifespan = Callable[[Starlette], AbstractAsyncContextManager[None]]


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) before buffering more than `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLargeError(
            f"body of {declared} bytes exceeds the limit of {max_bytes}", field="body"
        )
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > max_bytes:
            raise PayloadTooLargeError(f"body exceeds the limit of {max_bytes} bytes", field="body")
        parts.append(part)
    return b"".join(parts)


class PushInbox(Protocol):
    """Where an entry's pushed steps wait for the frame their last hop posts (ADR-0034)."""

    def deliver(self, meta: FrameMeta, hidden: Hidden) -> None:
        """Hand `hidden` to the step waiting for it; raises (409, 400) when none fits."""
        ...


class NodeService:
    """The node's HTTP side: decodes frames, admits sessions, answers on its own response.

    The parts it binds each have one job: the shard table (`node/shards.py`), the scheduler
    that owns the compute thread and batches decode steps (`node/scheduler.py`), and the
    push forwarder (`node/push.py`). An entry role plugs in its inbox of pushed steps and
    the feed of its finished generations.
    """

    def __init__(
        self,
        runners: Sequence[ShardRunner],
        limits: WireLimits,
        wire: WireConfig,
        max_sessions: int = 64,
        metrics: Metrics | None = None,
        turns: HostTurns | None = None,
        *,
        node_id: str = "unregistered",
        swarm_key: SwarmKey | None = None,
        max_batch: int = 32,
        batch_wait_s: float = 0.01,
        max_batch_tokens: int = 512,
        signer: Signer | None = None,
        tls: ssl.SSLContext | None = None,
        threads: ComputeThreads | None = None,
    ) -> None:
        self.shards = ShardTable(list(runners))
        self.tracker_keys = TrackerKeys()  # of the trackers it registered with (ADR-0059)
        self.metrics = metrics or Metrics()
        self.scheduler = Scheduler(
            turns, max_batch, self.metrics.decode_batch_rows.observe, max_batch_tokens, threads
        )
        self.submit = self.scheduler.submit  # batched model work (the pipeline's `Executor`)
        # an entry's finished generations, taken by each heartbeat (the entry role's outbox)
        self.take_finished: Callable[[], list[msg.RequestSummary]] = list
        # pushed frames (ADR-0034): sent on by `forwarder`; an entry's steps wait in `inbox`
        self.peers = PeerTimes()  # round trips to the tracker and peers, for route choice
        self.links = LinkRates()  # rates of the links frames go out on, for `auto` (ADR-0037)
        self.forwarder = Forwarder(
            node_id, signer or Signer(None), wire, self.metrics, tls, self.peers, self.links
        )
        self.inbox: PushInbox | None = None  # an entry's: where its pushed steps wait
        self.batch_wait_s = batch_wait_s  # a decode round waits this long for its stragglers
        self.limits = limits
        self.wire = wire
        self.max_sessions = max_sessions  # sessions of all shards together
        self.node_id = node_id  # answered to the tracker's identity probe
        self.swarm_key = swarm_key  # proves membership in that answer
        self.draining = False  # set on SIGTERM: sessions in flight finish, new ones are refused
        self.on_exit: Callable[[], object] = lambda: None  # set by the lifespan: leave the tracker
        self.refused_sessions = 0  # new sessions refused by `max_sessions`
        self._opening: set[SessionId] = set()  # admitted, first call not over yet
        self.metrics.on_scrape(self._sample)

    def _sample(self) -> None:
        self.metrics.sessions_active.set(self.shards.session_count())
        self.metrics.kv_cache_bytes.set(self.shards.cache_bytes())
        prefixes = self.shards.prefix_stats()
        self.metrics.prefix_hits.set(prefixes.hits)
        self.metrics.prefix_tokens_reused.set(prefixes.tokens_reused)
        self.metrics.prefix_cache_sessions.set(prefixes.kept)
        self.metrics.prefix_cache_bytes.set(prefixes.kept_bytes)
        self.metrics.compute_threads.set(self.scheduler.threads.threads)
        self.metrics.other_cores_busy.set(round(self.scheduler.threads.others_cores, 3))
        for peer, mbit_s in self.links.report_mbit_s().items():
            self.metrics.link_mbit_s.labels(peer).set(mbit_s)

    def session_count(self) -> int:
        return self.shards.session_count()

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on the compute thread, between the scheduler's batches.

        Never on the event loop's thread: a hand-off costs ~0.2 ms, a second thread running
        torch ops costs a decode step 12+ ms (`node/compute.py`).
        """
        return await self.scheduler.call(fn, *args)

    def forget(self, session: SessionId) -> None:
        """A closed session: no batch waits for it (`Scheduler.forget`)."""
        self.scheduler.forget(session)

    async def forward(self, request: Request) -> Response:
        started = time.perf_counter()
        body = await read_body(request, self.limits.max_body_bytes)
        received = time.perf_counter()  # answers say how long we held the frame (ADR-0037)
        meta, hidden = decode_bits(request.headers, body, self.limits)  # bf16 bits
        encoding = request.headers.get(h.ENCODING, "none").strip().lower()  # decode checked it
        self.metrics.bytes_received.labels(encoding).inc(len(body))
        proof = request.headers.get(PROOF)
        # only the session's own entry, for this tensor (ADR-0049, review S1)
        check_frame(proof, meta, tensor_bytes(hidden), hidden.shape)
        require_finite(hidden)  # poison must not reach a cache
        lower = h.lower_keys(request.headers)
        route = parse_route(lower)
        if route is not None:  # pushed (ADR-0034): checked before it costs any compute
            budget = min(budget_ms(lower), self.forwarder.max_budget_ms)  # N6: no 1-hour hold
            self.forwarder.check(route, meta, lower)
            await self.forwarder.check_target(route, meta)
        with session_context(meta.session):
            out = await self._run(meta, hidden)
            self.metrics.forward_seconds.labels(meta.model).observe(time.perf_counter() - started)
            if route is not None:
                answer = await self.forwarder.send_on(route, meta, out, budget, started, proof)
                return JSONResponse(answer, headers=hold_header(received, time.perf_counter()))
        wire = replace(self.wire, encoding=compression.answering(self.wire.encoding, encoding))
        encoded = encode(out, meta, wire)
        self.metrics.bytes_sent.labels(encoded.headers.get(h.ENCODING, "none")).inc(
            len(encoded.body)
        )
        headers = encoded.headers | hold_header(received, time.perf_counter())
        return Response(bytes(encoded.body), headers=headers, media_type=h.OCTET_STREAM)

    async def _run(self, meta: FrameMeta, hidden: Hidden) -> Hidden:
        runner = self.shards.get(meta.model, meta.span)
        if meta.position == 0 or meta.fork is not None:  # a new session, unless replayed
            self.admit_session(meta.session)
        try:
            return await self.run_frame(runner, meta, hidden)
        finally:
            self.admitted(meta.session)

    async def pushed(self, request: Request) -> Response:
        """`POST /push`: the last hop of a pushed step posts its output here (the entry)."""
        body = await read_body(request, self.limits.max_body_bytes)
        received = time.perf_counter()
        meta, hidden = decode_bits(request.headers, body, self.limits)
        require_finite(hidden)
        if self.inbox is None:
            raise SessionError(
                f"no pushed step of session {meta.session} waits here: not an entry",
                field="X-Meshnet-Session",
            )
        self.inbox.deliver(meta, hidden)
        held = hold_header(received, time.perf_counter())
        return JSONResponse({"received": meta.position}, headers=held)

    async def run_frame(self, runner: ShardRunner, meta: FrameMeta, hidden: Hidden) -> Hidden:
        """One frame through `runner`, in one pass with the runner's other frames of the
        round (decode steps and prefill chunks of other sessions; ADR-0027). A frame of
        several rows runs alone."""
        tokens = hidden.shape[0] * hidden.shape[1]
        key = ("frames", id(runner)) if hidden.shape[0] == 1 else None
        out: Hidden = await self.scheduler.submit(
            key, runner.forward_many, (meta, hidden), tokens, meta.session, self.batch_wait_s
        )
        return out

    def admit_session(self, session: SessionId) -> None:
        """Let `session` start (not draining, under `max_sessions`) and hold its place until
        `admitted`: new sessions that arrive at once all count, before any cache exists."""
        if self.draining:
            raise UnavailableError("this node is shutting down; it takes no new sessions")
        held = self.session_count() + len(self._opening)
        if held >= self.max_sessions:
            self.refused_sessions += 1
            raise LimitError(
                f"this node holds {held} sessions, its limit; retry later",
                retry_after_s=1.0,
                field="X-Meshnet-Session",
            )
        self._opening.add(session)

    def admitted(self, session: SessionId) -> None:
        """`session`'s first call is over: its cache (if it made one) counts from now on."""
        self._opening.discard(session)

    async def identity(self, request: Request) -> Response:
        """The answer to the tracker's probe: our id and a proof only a member can make."""
        challenge = request.query_params.get("challenge", "")
        if not (16 <= len(challenge) <= 128 and challenge.isalnum()):
            raise RequestError("challenge must be 16-128 letters or digits", field="challenge")
        proof = challenge_proof(self.swarm_key, challenge, self.node_id) if self.swarm_key else ""
        return JSONResponse({"node_id": self.node_id, "proof": proof})

    async def drop_session(self, request: Request) -> Response:
        session = SessionId(request.path_params["session"])
        if not is_valid_id(session):
            raise RequestError(f"invalid session id {session[:128]!r}", field="session")
        keep = request.query_params.get("keep", "0")
        if keep not in ("0", "1"):
            raise RequestError(f"keep must be 0 or 1, not {keep[:16]!r}", field="keep")
        check_close(request.headers.get(PROOF), session, self.node_id, keep == "1")
        self.forget(session)
        self.forwarder.forget(session)
        ended = [await self.call(r.drop, session, keep == "1") for r in self.shards.runners()]
        if not any(ended):
            raise SessionNotFoundError(
                f"no session {session[:128]!r} on this node", field="session"
            )
        return JSONResponse({"kept" if keep == "1" else "dropped": session})

    async def health(self, _: Request) -> Response:
        shards = [{"model": m, "span": str(s)} for m, s in self.shards]
        body: dict[str, object] = {
            "status": "ok",
            "version": __version__,
            "node_id": self.node_id,  # what members address their proofs to
            "shards": shards,
            "sessions": self.session_count(),
        }
        if len(shards) == 1:
            body |= shards[0]
        return JSONResponse(body)


def access_rules(limits: WireLimits) -> list[Rule]:
    """Who may call the activation plane: members only (bodies up to the wire limit)."""
    return [
        rule("/forward", "swarm", max_body_bytes=limits.max_body_bytes),
        rule("/sessions", "swarm"),
        rule("/push", "swarm", max_body_bytes=limits.max_body_bytes),
        rule("/v1/identity", "swarm"),
        rule("/metrics", "swarm", "client"),  # Prometheus: an API key as bearer token
    ]


def create_app(
    runner: ShardRunner | None = None,
    limits: WireLimits = WireLimits(),
    wire: WireConfig = WireConfig(),
    *,
    service: NodeService | None = None,
    lifespan: Lifespan | None = None,
    access: AccessConfig = AccessConfig(),
    api: ASGIApp | None = None,
    api_rules: Sequence[Rule] = (),
    weights: WeightServer | None = None,
) -> Starlette:
    """The node's ASGI app around `runner` (or a prepared `service` with many runners).

    Plain Starlette: the activation plane is on every token's path, and FastAPI's layers
    (parameter machinery, extra middleware) cost a measurable share of a hop. The JSON apps
    (tracker, API) use FastAPI for schemas and OpenAPI. An entry's `api` (with its access
    `api_rules`) answers every path the node's own routes do not; `weights` serves what it
    holds of models' weights.
    """
    service = service or NodeService([runner] if runner else [], limits, wire)
    rules = [*access_rules(limits), *weight_rules(), *api_rules]
    credentials = Credentials(access, frozenset({service.node_id}), trackers=service.tracker_keys)
    guard = Middleware(Guard, rules=rules, credentials=credentials)
    if access.swarm_key:
        service.swarm_key = SwarmKey.from_text(access.swarm_key)
        if service.forwarder.signer.key is None:  # a service built without the key
            service.forwarder.signer = Signer(access.swarm_key)
    # the guard outermost: nothing runs before it, and nothing changes an answer it signed
    app = Starlette(
        middleware=[guard, Middleware(WireVersionHeader)], lifespan=closing(service, lifespan)
    )
    install_error_handlers(app)
    add_node_routes(app, service)
    add_metrics_route(app, service.metrics)
    if weights is not None:  # the parts of models it holds, to members (ADR-0054)
        add_weight_routes(app, weights)
    app.add_route("/health", service.health, methods=["GET"])
    if api is not None:
        app.mount("", api)  # after the node's routes: only what they leave
    return app


def closing(service: NodeService, lifespan: Lifespan | None) -> Lifespan:
    """`lifespan`, then the push client's connections closed (ADR-0034)."""

    @contextlib.asynccontextmanager
    async def both(app: Starlette) -> AsyncIterator[None]:
        try:
            if lifespan is None:
                yield
            else:
                async with lifespan(app):
                    yield
        finally:
            await service.forwarder.aclose()

    return both


def add_metrics_route(app: Starlette, metrics: Metrics) -> None:
    """`GET /metrics` (Prometheus text) and the errors counter of the one error mapper."""
    app.state.metrics = metrics
    app.add_route("/metrics", metrics.endpoint, methods=["GET"], include_in_schema=False)


def add_node_routes(app: Starlette, service: NodeService) -> None:
    """The activation plane's routes (`/forward`, `/sessions/{id}`) on any app."""
    app.state.service = service
    app.add_route("/forward", service.forward, methods=["POST"])
    app.add_route("/push", service.pushed, methods=["POST"])
    app.add_route("/sessions/{session}", service.drop_session, methods=["DELETE"])
    app.add_route("/v1/identity", service.identity, methods=["GET"])
