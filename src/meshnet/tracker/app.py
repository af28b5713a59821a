"""The tracker's HTTP app: registration, heartbeats, coverage, routes, health (JSON)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator

from fastapi import FastAPI, Query

from meshnet import __version__
from meshnet.config import TrackerConfig
from meshnet.http_errors import WireVersionHeader, install_error_handlers
from meshnet.tracker import messages as msg
from meshnet.tracker import views
from meshnet.tracker.registry import Registry
from meshnet.types import NodeId

log = logging.getLogger(__name__)


def create_app(registry: Registry, config: TrackerConfig) -> FastAPI:
    """The tracker's ASGI app over `registry`."""
    rng = random.Random(config.route_seed)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_expire_loop(registry, config.heartbeat_interval_s / 2))
        yield
        task.cancel()

    app = FastAPI(title="meshnet tracker", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(WireVersionHeader)

    @app.post("/v1/nodes/register")
    def register(request: msg.RegisterRequest) -> msg.RegisterResponse:
        directives = registry.register(request)
        return msg.RegisterResponse(
            node_id=request.node_id,
            heartbeat_interval_s=config.heartbeat_interval_s,
            directives=[registry.to_message(d) for d in directives],
        )

    @app.post("/v1/nodes/heartbeat")
    def heartbeat(beat: msg.HeartbeatRequest) -> msg.HeartbeatResponse:
        directives = registry.heartbeat(beat)
        return msg.HeartbeatResponse(directives=[registry.to_message(d) for d in directives])

    @app.post("/v1/nodes/leave")
    def leave(request: msg.LeaveRequest) -> dict[str, bool]:
        return {"left": registry.leave(NodeId(request.node_id))}

    @app.post("/v1/nodes/report")
    def report(request: msg.ReportRequest) -> dict[str, bool]:
        return {"reported": registry.report(NodeId(request.node_id), request.reason)}

    @app.get("/v1/coverage")
    def coverage() -> msg.CoverageResponse:
        registry.expire()
        return views.coverage(registry)

    @app.get("/v1/route")
    def route(
        model: str = Query(max_length=200),
        start: int = Query(0, ge=0),
        end: int | None = Query(None, ge=1),
        exclude: str = Query("", max_length=8000, description="node ids, comma-separated"),
    ) -> msg.RouteResponse:
        registry.expire()
        banned = frozenset(n for n in exclude.split(",") if n)
        return views.route(registry, model, start, rng, end, banned)

    @app.get("/health")
    def health() -> dict[str, object]:
        return {
            "status": "ok",
            "version": __version__,
            "nodes": len(registry.nodes),
            "models": sorted(registry.offers),
        }

    return app


async def _expire_loop(registry: Registry, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        registry.expire()
