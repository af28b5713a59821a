"""The node's HTTP app: `POST /forward` (binary activation frames), sessions, health."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from meshnet import __version__
from meshnet.config import WireConfig, WireLimits
from meshnet.errors import PayloadTooLargeError, SessionNotFoundError, WireError
from meshnet.http_errors import WireVersionHeader, install_error_handlers
from meshnet.node.runner import ShardRunner
from meshnet.types import SessionId
from meshnet.wire import decode, encode
from meshnet.wire import headers as h

log = logging.getLogger(__name__)


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
    """Binds a runner to HTTP; one forward pass at a time (the runner owns all cores)."""

    def __init__(self, runner: ShardRunner, limits: WireLimits, wire: WireConfig) -> None:
        self.runner = runner
        self.limits = limits
        self.wire = wire
        self.compute_lock = asyncio.Lock()

    async def forward(self, request: Request) -> Response:
        body = await read_body(request, self.limits.max_body_bytes)
        meta, hidden = decode(request.headers, body, self.limits)
        if meta.model != self.runner.model or meta.span != self.runner.span:
            raise WireError(
                f"this node serves {self.runner.model} layers {self.runner.span}, "
                f"not {meta.model} layers {meta.span}",
                field=h.LAYERS,
            )
        async with self.compute_lock:
            out = await run_in_threadpool(self.runner.forward, meta, hidden)
        encoded = encode(out, meta, self.wire)
        return Response(bytes(encoded.body), headers=encoded.headers, media_type=h.OCTET_STREAM)

    async def drop_session(self, request: Request) -> Response:
        session = SessionId(request.path_params["session"])
        async with self.compute_lock:
            existed = self.runner.drop(session)
        if not existed:
            raise SessionNotFoundError(
                f"no session {session[:128]!r} on this node", field="session"
            )
        return JSONResponse({"dropped": session})

    async def health(self, _: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "version": __version__,
                "model": self.runner.model,
                "span": str(self.runner.span),
                "sessions": self.runner.session_count(),
            }
        )


def create_app(
    runner: ShardRunner, limits: WireLimits = WireLimits(), wire: WireConfig = WireConfig()
) -> FastAPI:
    """The node's ASGI app around `runner`."""
    service = NodeService(runner, limits, wire)
    app = FastAPI(title="meshnet node", version=__version__)
    install_error_handlers(app)
    # Plain Starlette routes: the activation plane skips FastAPI's parameter machinery.
    app.router.add_route("/forward", service.forward, methods=["POST"])
    app.router.add_route("/sessions/{session}", service.drop_session, methods=["DELETE"])
    app.router.add_route("/health", service.health, methods=["GET"])
    app.add_middleware(WireVersionHeader)
    return app
