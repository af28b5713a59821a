"""Start a node process: load any pinned shard, join the tracker if given, serve `/forward`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import torch
import uvicorn
from starlette.applications import Starlette

from meshnet.config import AccessConfig, NodeConfig, WireConfig, WireLimits
from meshnet.models.loader import load_shard
from meshnet.models.quantize import default_quant
from meshnet.models.source import resolve
from meshnet.node.agent import NodeAgent, node_id
from meshnet.node.app import NodeService, create_app
from meshnet.node.compute import host_turns, pin_loop_thread
from meshnet.node.torch_runner import TorchShardRunner
from meshnet.security.signing import Signer
from meshnet.tracker import messages as msg
from meshnet.types import LayerSpan, ModelId

log = logging.getLogger(__name__)


def load_runner(
    config: NodeConfig, model_id: str, source: str, span: LayerSpan
) -> TorchShardRunner:
    shard = load_shard(
        resolve(source), span, config.quant, fast=config.fast_path, compile=config.compile
    )
    return TorchShardRunner(
        ModelId(model_id),
        shard,
        ttl_s=config.session_ttl_s,
        max_cache_bytes=config.max_cache_bytes,
        evict_idle_s=config.evict_idle_s,
    )


def pinned_runner(config: NodeConfig) -> TorchShardRunner | None:
    """The span given by hand (`--layers`), or the whole model when there is no tracker."""
    if config.layers is None and config.tracker_url is not None:
        return None
    source = resolve(config.model)
    span = LayerSpan.parse(config.layers) if config.layers else LayerSpan(0, source.spec.num_layers)
    return load_runner(config, config.model, config.model, span)


def default_budget_bytes() -> int:
    """Free GPU memory on CUDA; half the available RAM on the CPU."""
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(pages // 2)


def measure_throughput(repeats: int = 30) -> float:
    """Relative speed: 1024x1024 matrix-vector products per second (a short timed pass)."""
    layer = torch.nn.Linear(1024, 1024)
    x = torch.randn(1, 1024)
    with torch.inference_mode():
        layer(x)
        start = time.perf_counter()
        for _ in range(repeats):
            layer(x)
    return repeats / (time.perf_counter() - start)


def registration(config: NodeConfig) -> msg.RegisterRequest:
    budget = config.budget_bytes or default_budget_bytes()
    data_dir = Path(config.data_dir or Path.home() / ".meshnet" / f"node-{config.port}")
    return msg.RegisterRequest(
        node_id=node_id(data_dir),
        address=config.public_address or f"http://{config.host}:{config.port}",
        budget_bytes=budget,
        kv_reserve_bytes=int(budget * config.kv_reserve_fraction),
        quant=config.quant or default_quant(),
        throughput=measure_throughput(),
    )


def tracker_client(url: str, access: AccessConfig, timeout_s: float = 10.0) -> httpx.AsyncClient:
    """An httpx client for the tracker that signs every call with the swarm key."""
    return httpx.AsyncClient(base_url=url, timeout=timeout_s, auth=Signer(access.swarm_key).auth())


def build_app(config: NodeConfig, access: AccessConfig) -> Starlette:
    pinned = pinned_runner(config)
    request = registration(config)
    service = NodeService(
        [pinned] if pinned else [],
        WireLimits(),
        WireConfig(),
        config.max_sessions,
        turns=host_turns(config.host_turns),
        max_batch=config.max_batch,
        max_batch_tokens=config.max_batch_tokens,
        batch_wait_s=config.batch_wait_s,
        node_id=request.node_id,
    )
    if config.tracker_url is None:
        return create_app(service=service, access=access)
    tracker_url = config.tracker_url

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        async with tracker_client(tracker_url, access) as client:
            agent = NodeAgent(
                service, client, request, lambda m, s, span: load_runner(config, m, s, span)
            )
            task = asyncio.create_task(agent.run())
            service.on_exit = lambda: asyncio.ensure_future(agent.retire(task))
            yield
            task.cancel()
            await agent.leave()  # a no-op when the signal handler already left

    return create_app(service=service, lifespan=lifespan, access=access)


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


def run_server(app: Starlette, service: NodeService, host: str, port: int, drain_s: float) -> None:
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=int(drain_s)
    )
    DrainingServer(config, service, drain_s).run()


def serve(config: NodeConfig, access: AccessConfig) -> None:
    """Load, (join,) then serve until SIGTERM or Ctrl-C."""
    pin_loop_thread()  # before any torch op: model work belongs to the compute thread
    app = build_app(config, access)
    log.info("node listening on http://%s:%d", config.host, config.port)
    run_server(app, app.state.service, config.host, config.port, config.drain_timeout_s)
