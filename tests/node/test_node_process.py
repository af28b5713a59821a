"""A real node process on loopback serves real weights over HTTP."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from meshnet.security.signing import Signer
from meshnet.types import LayerSpan, ModelId
from meshnet.wire import FrameMeta, decode
from meshnet.wire import headers as h
from tests.owned import close_proof, encode, new_session

KEY = "node-process-test-key-padded-to-128-bits-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def node_process(args: list[str], key: str) -> Iterator[tuple[str, int]]:
    """`meshnet node ARGS` on a free port with swarm key `key`: its URL and pid once healthy."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "meshnet.cli", "node", *args, "--port", str(port)],
        env={**os.environ, "MESHNET_SWARM_KEY": key},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert process.poll() is None, "node exited during start-up"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)  # waiting on the readiness signal, not a fixed sleep
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def node_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data_dir = tmp_path_factory.mktemp("node")
    args = ["--model", "default", "--layers", "10:20", "--quant", "fp32"]
    with node_process([*args, "--data-dir", str(data_dir)], KEY) as (url, _):
        yield url


@pytest.mark.slow
def test_real_node_runs_its_span_and_refuses_bad_frames(node_url: str) -> None:
    health = httpx.get(f"{node_url}/health").json()
    assert health["span"] == "10:20" and health["model"] == "default"
    x = torch.randn(1, 130, 576)
    meta = FrameMeta(new_session(), ModelId("default"), LayerSpan(10, 20), 0)
    frame = encode(x, meta)
    unsigned = httpx.post(f"{node_url}/forward", headers=frame.headers, content=bytes(frame.body))
    assert unsigned.status_code == 401 and unsigned.json()["error"]["field"] == "X-Meshnet-Auth"
    assert httpx.get(f"{node_url}/health").json()["sessions"] == 0  # refused: nothing changed
    auth = Signer(KEY).auth(health["node_id"])
    with httpx.Client(base_url=node_url, auth=auth) as client:
        response = client.post("/forward", headers=frame.headers, content=bytes(frame.body))
        assert response.status_code == 200
        out_meta, out = decode(response.headers, response.content)
        assert out.shape == (1, 130, 576) and torch.isfinite(out.float()).all()
        assert out_meta.span == LayerSpan(10, 20)
        bad = client.post(
            "/forward", headers={**frame.headers, h.DTYPE: "float16"}, content=bytes(frame.body)
        )
        assert bad.status_code == 400 and bad.json()["error"]["field"] == h.DTYPE
        step = encode(torch.randn(1, 1, 576), FrameMeta(meta.session, meta.model, meta.span, 130))
        assert (
            client.post("/forward", headers=step.headers, content=bytes(step.body)).status_code
            == 200
        )
        anyone = client.delete(f"/sessions/{meta.session}")  # a member, not its entry
        assert anyone.status_code == 403, anyone.text
        closing = close_proof(meta.session, health["node_id"])
        assert client.delete(f"/sessions/{meta.session}", headers=closing).status_code == 200
        assert httpx.get(f"{node_url}/health").json()["sessions"] == 0  # open: unsigned
