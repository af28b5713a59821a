"""The registration probe against hostile addresses (review finding 8): only plain
addresses, a capped and never-inflated answer, a deadline for the whole probe, and one
failure text for every kind of failure (no oracle)."""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from meshnet.config import TrackerConfig
from meshnet.security.signing import Signer
from meshnet.tracker.app import create_app
from meshnet.tracker.planner import ModelOffer
from meshnet.tracker.probe import HttpProber, ProbeError, TrustingProber
from meshnet.tracker.registry import Registry
from meshnet.types import ModelId
from tests.conftest import run
from tests.e2e.procs import free_port

MB = 1 << 20


@pytest.mark.parametrize("address", ["http://a:b", "http://h:1?", "http://u@h:1", "http://[::1"])
def test_addresses_with_more_than_scheme_host_and_port_are_refused(address: str) -> None:
    offers = [ModelOffer(ModelId("m"), 4, {"fp32": MB})]
    registry = Registry(offers, {ModelId("m"): "m"}, dead_after_s=6.0, clock=lambda: 0.0)
    client = TestClient(create_app(registry, TrackerConfig(), prober=TrustingProber()))
    body = {"node_id": "a", "address": address, "budget_bytes": MB, "quant": "fp32"}
    response = client.post("/v1/nodes/register", json=body | {"throughput": 1})
    assert response.status_code == 400 and response.json()["error"]["field"] == "address"
    assert registry.nodes == {}


async def huge(request: Request) -> Response:
    return Response(b"[" + b"0," * (5 * MB) + b"0]", media_type="application/json")


async def bomb(request: Request) -> Response:
    body = gzip.compress(b" " * (200 * MB))
    return Response(body, headers={"Content-Encoding": "gzip"}, media_type="application/json")


async def trickle(request: Request) -> StreamingResponse:
    async def slowly() -> AsyncIterator[bytes]:
        for _ in range(100):
            yield b" "
            await asyncio.sleep(0.1)

    return StreamingResponse(slowly(), media_type="application/json")


@pytest.fixture(scope="module")
def hostile() -> Iterator[str]:
    app = Starlette()
    for path, handler in (("/huge", huge), ("/bomb", bomb), ("/trickle", trickle)):
        app.add_route(f"{path}/v1/identity", handler)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


@pytest.mark.parametrize("kind", ["huge", "bomb", "trickle"])
def test_hostile_answers_fail_the_probe_quickly_with_one_text(hostile: str, kind: str) -> None:
    """10 MB, a 200 MB gzip bomb (it took the tracker from 100 to 524 MB before), or an
    answer that trickles for 10 s: each fails within the probe's deadline, unread."""
    prober = HttpProber(Signer(None), timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(ProbeError) as failed:
        run(prober.probe("n1", f"{hostile}/{kind}"))  # the path only reaches the handler
    assert time.monotonic() - started < 3.0
    assert "did not answer the tracker's probe" in failed.value.message
