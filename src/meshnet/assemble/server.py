"""uvicorn for a node: the first signal drains it before the usual shutdown."""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette

from meshnet.assemble.http import ServerLimits, server_config
from meshnet.config import NodeConfig, TlsConfig
from meshnet.node.app import NodeService
from meshnet.security.tls import server_options

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT drains the node before the usual shutdown.

    The node refuses new sessions at once (503) and leaves the tracker (which re-plans its
    spans), but keeps listening: the sessions it holds go on with their next chunks and
    decode steps until their entries close them, for up to `drain_s`. Only then does uvicorn
    stop accepting connections and shut down. A second signal stops it at once.
    """

    def __init__(self, config: uvicorn.Config, service: NodeService, drain_s: float) -> None:
        super().__init__(config)
        self.service = service
        self.drain_s = drain_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain: asyncio.Future[None] | None = None

    async def serve(self, sockets: list[Any] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.service.draining or self.loop is None:  # the second signal: stop now
            super().handle_exit(sig, frame)
            return
        self.service.draining = True
        log.info("draining: no new sessions; leaving the tracker")
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self.service.on_exit()
        self.drain = asyncio.ensure_future(self._wait_for_sessions())

    async def _wait_for_sessions(self) -> None:
        started = time.monotonic()
        while self.service.session_count() and time.monotonic() - started < self.drain_s:
            await asyncio.sleep(0.05)
        left = self.service.session_count()
        log.info("drained in %.1f s; %d sessions left; stopping", time.monotonic() - started, left)
        self.should_exit = True


def run_server(app: Starlette, service: NodeService, node: NodeConfig, tls: TlsConfig) -> None:
    drain_s = node.drain_timeout_s
    config = server_config(
        app,
        node.host,
        node.port,
        ServerLimits(),
        timeout_graceful_shutdown=int(drain_s),
        **server_options(tls),
    )
    DrainingServer(config, service, drain_s).run()
