"""Framework overhead of one loopback hop: `/forward` on an echo node, decode-step frames.

    python benchmarks/hop.py          # 2,000 round trips
    python benchmarks/hop.py --tiny   # 50 (what the tests run)

The node runs `EchoRunner` (no model) under uvicorn in its own process; the client is one
`httpx.AsyncClient` with keep-alive. Round-trip time is all framework, wire codec and TCP.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time

import httpx
import torch

from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import FrameMeta, decode, encode

SERVER = """
import sys, uvicorn
from meshnet.node.app import create_app
from meshnet.node.runner import EchoRunner
from meshnet.types import LayerSpan, ModelId
app = create_app(EchoRunner(ModelId("default"), LayerSpan(0, 10), max_sessions=4))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def round_trips(url: str, count: int, hidden: int) -> list[float]:
    samples = []
    async with httpx.AsyncClient(base_url=url) as client:
        x = torch.randn(1, 1, hidden)
        for position in range(count):
            meta = FrameMeta(
                SessionId(f"hop-{hidden}"), ModelId("default"), LayerSpan(0, 10), position
            )
            start = time.perf_counter()
            frame = encode(x, meta)
            response = await client.post(
                "/forward", headers=frame.headers, content=bytes(frame.body)
            )
            assert response.status_code == 200, response.text
            decode(response.headers, response.content)
            samples.append(time.perf_counter() - start)
    return samples


def wait_ready(url: str) -> None:
    for _ in range(200):
        try:
            httpx.get(f"{url}/health", timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError("echo node did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    count = 50 if args.tiny else 2000
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        print("| frame | round trips | median ms | p90 ms |")
        print("|---|---:|---:|---:|")
        for hidden in (576, 16384):
            samples = sorted(asyncio.run(round_trips(url, count, hidden)))[count // 10 :]
            print(
                f"| [1, 1, {hidden}] decode step | {count} | "
                f"{statistics.median(samples) * 1e3:.3f} | "
                f"{samples[int(len(samples) * 0.9)] * 1e3:.3f} |"
            )
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
