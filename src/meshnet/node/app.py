"""The node's HTTP app: `POST /forward` (binary activation frames), sessions, identity, health.

Every route but `/health` needs a swarm-key proof (the access guard, ADR-0017).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

import torch
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from meshnet import __version__
from meshnet.config import AccessConfig, WireConfig, WireLimits
from meshnet.errors import (
    LimitError,
    PayloadTooLargeError,
    RequestError,
    SessionNotFoundError,
    UnavailableError,
    WireError,
)
from meshnet.http_errors import WireVersionHeader, install_error_handlers
from meshnet.node.compute import HostTurns, compute_executor
from meshnet.node.runner import ShardRunner
from meshnet.observe.logs import session_context
from meshnet.observe.metrics import Metrics
from meshnet.security.access import Credentials, Guard, Rule, rule
from meshnet.security.swarm import SwarmKey, challenge_proof
from meshnet.tracker import messages as msg
from meshnet.types import LayerSpan, SessionId, is_valid_id
from meshnet.wire import FrameMeta, decode, encode, require_finite
from meshnet.wire import headers as h

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


class NodeService:
    """Binds the node's shard runners to HTTP.

    Runner calls are serialised by one lock (the runners share all cores; their sessions need
    no locking of their own) and run on one compute thread (`node/compute.py`); anyio's pool
    (Starlette's `run_in_threadpool`) cost ~0.27 ms per call here.
    """

    def __init__(
        self,
        runners: Sequence[ShardRunner],
        limits: WireLimits,
        wire: WireConfig,
        max_sessions: int = 64,
        metrics: Metrics | None = None,
        turns: HostTurns | None = None,
    ) -> None:
        self.runners: dict[tuple[str, LayerSpan], ShardRunner] = {}
        for runner in runners:
            self.add(runner)
        self.limits = limits
        self.wire = wire
        self.lock = asyncio.Lock()
        self.worker = compute_executor()
        self.turns = turns or HostTurns()  # compute turns shared with co-located processes
        self.draining = False  # set on SIGTERM: sessions in flight finish, new ones are refused
        self.on_exit: Callable[[], object] = lambda: None  # set by the lifespan: leave the tracker
        self.max_sessions = max_sessions  # sessions of all shards together
        self.node_id = "unregistered"  # answered to the tracker's identity probe
        self.swarm_key: SwarmKey | None = None  # proves membership in that answer
        self.refused_sessions = 0  # new sessions refused by `max_sessions`
        self.metrics = metrics or Metrics()
        self.metrics.on_scrape(self._sample)
        # generations this entry finished, not yet told to the tracker (heartbeats carry them)
        self.finished: deque[msg.RequestSummary] = deque(maxlen=msg.MAX_REQUESTS)

    def _sample(self) -> None:
        runners = list(self.runners.values())
        self.metrics.sessions_active.set(sum(r.session_count() for r in runners))
        self.metrics.kv_cache_bytes.set(sum(r.cache_bytes() for r in runners))

    def add(self, runner: ShardRunner) -> None:
        self.runners[(runner.model, runner.span)] = runner

    def remove(self, model: str, span: LayerSpan) -> bool:
        return self.runners.pop((model, span), None) is not None

    def session_count(self) -> int:
        return sum(r.session_count() for r in self.runners.values())

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` alone, on the compute thread.

        Never on the event loop's thread: a hand-off costs ~0.2 ms, a second thread running
        torch ops costs a decode step 12+ ms (`node/compute.py`).
        """
        async with self.lock:
            context = contextvars.copy_context()  # the worker's log lines name our session
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.worker, context.run, self.turns.run, fn, *args)

    async def forward(self, request: Request) -> Response:
        started = time.perf_counter()
        body = await read_body(request, self.limits.max_body_bytes)
        meta, hidden = decode(request.headers, body, self.limits)
        encoding = request.headers.get(h.ENCODING, "none").strip().lower()  # decode checked it
        self.metrics.bytes_received.labels(encoding).inc(len(body))
        require_finite(hidden)  # poison must not reach a cache
        with session_context(meta.session):
            response = await self._run(meta, hidden)
        sent_encoding = response.headers.get(h.ENCODING, "none")
        self.metrics.bytes_sent.labels(sent_encoding).inc(len(response.body))
        self.metrics.forward_seconds.labels(meta.model).observe(time.perf_counter() - started)
        return response

    async def _run(self, meta: FrameMeta, hidden: torch.Tensor) -> Response:
        runner = self.runners.get((meta.model, meta.span))
        if runner is None:
            served = ", ".join(f"{m} {s}" for m, s in sorted(self.runners)) or "nothing yet"
            raise WireError(
                f"this node serves {served}, not {meta.model} layers {meta.span}", field=h.LAYERS
            )
        if meta.position == 0:
            self.admit_session()
        out = await self.call(runner.forward, meta, hidden)
        encoded = encode(out, meta, self.wire)
        return Response(bytes(encoded.body), headers=encoded.headers, media_type=h.OCTET_STREAM)

    def admit_session(self) -> None:
        """A new session may start: not draining, and under `max_sessions`."""
        if self.draining:
            raise UnavailableError("this node is shutting down; it takes no new sessions")
        if self.session_count() >= self.max_sessions:
            self.refused_sessions += 1
            raise LimitError(
                f"this node holds {self.session_count()} sessions, its limit; retry later",
                retry_after_s=1.0,
                field="X-Meshnet-Session",
            )

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
        dropped = [await self.call(r.drop, session) for r in list(self.runners.values())]
        if not any(dropped):
            raise SessionNotFoundError(
                f"no session {session[:128]!r} on this node", field="session"
            )
        return JSONResponse({"dropped": session})

    async def health(self, _: Request) -> Response:
        shards = [{"model": m, "span": str(s)} for m, s in sorted(self.runners)]
        body: dict[str, object] = {
            "status": "ok",
            "version": __version__,
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
) -> Starlette:
    """The node's ASGI app around `runner` (or a prepared `service` with many runners).

    Plain Starlette: the activation plane is on every token's path, and FastAPI's layers
    (parameter machinery, extra middleware) cost a measurable share of a hop. The JSON apps
    (tracker, API) use FastAPI for schemas and OpenAPI.
    """
    service = service or NodeService([runner] if runner else [], limits, wire)
    guard = Middleware(Guard, rules=access_rules(limits), credentials=Credentials(access))
    if access.swarm_key:
        service.swarm_key = SwarmKey.from_text(access.swarm_key)
    app = Starlette(middleware=[Middleware(WireVersionHeader), guard], lifespan=lifespan)
    install_error_handlers(app)
    add_node_routes(app, service)
    add_metrics_route(app, service.metrics)
    app.add_route("/health", service.health, methods=["GET"])
    return app


def add_metrics_route(app: Starlette, metrics: Metrics) -> None:
    """`GET /metrics` (Prometheus text) and the errors counter of the one error mapper."""
    app.state.metrics = metrics
    app.add_route("/metrics", metrics.endpoint, methods=["GET"], include_in_schema=False)


def add_node_routes(app: Starlette, service: NodeService) -> None:
    """The activation plane's routes (`/forward`, `/sessions/{id}`) on any app."""
    app.state.service = service
    app.add_route("/forward", service.forward, methods=["POST"])
    app.add_route("/sessions/{session}", service.drop_session, methods=["DELETE"])
    app.add_route("/v1/identity", service.identity, methods=["GET"])
