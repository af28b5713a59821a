"""Framework overhead of one loopback hop: `/forward` on an echo node, decode-step frames.

    python benchmarks/hop.py          # 2,000 round trips
    python benchmarks/hop.py --tiny   # 50 (what the tests run)

The node runs `EchoRunner` (no model) under uvicorn in its own process; the client keeps
its connection alive. Round-trip time is all framework, wire codec and TCP. The `signed` rows
run against a second node that requires swarm-key proofs (ADR-0017), the client signing each
frame: their difference from the unsigned aiohttp rows is the cost of membership.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import aiohttp
import httpx
import torch

from harness import free_port  # benchmarks/harness.py
from meshnet.entry.transport import signed_for
from meshnet.security.ownership import PROCESS_KEYS, PROOF
from meshnet.security.signing import Signer
from meshnet.types import LayerSpan, ModelId
from meshnet.wire import FrameMeta, decode, encode

SERVER = """
import sys, uvicorn
from meshnet.config import AccessConfig
from meshnet.node.app import create_app
from meshnet.node.runner import EchoRunner
from meshnet.types import LayerSpan, ModelId
access = AccessConfig(swarm_key=sys.argv[2] if len(sys.argv) > 2 else None)
app = create_app(EchoRunner(ModelId("default"), LayerSpan(0, 10), max_sessions=8), access=access)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


KEY = "hop-benchmark-swarm-key-padded-to-128-bits-0123456789"


async def round_trips(url: str, count: int, hidden: int, client_name: str) -> list[float]:
    """Seconds per hop: encode, POST, read, decode, on one kept-alive connection."""
    x = torch.randn(1, 1, hidden)
    session = PROCESS_KEYS.new_id("hop")  # each frame signed as the entry signs it (ADR-0049)
    metas = [FrameMeta(session, ModelId("default"), LayerSpan(0, 10), p) for p in range(count)]
    samples = []
    if client_name == "httpx":
        async with httpx.AsyncClient(base_url=url) as client:
            for meta in metas:
                start = time.perf_counter()
                frame = encode(x, meta)
                owned = {PROOF: signed_for(PROCESS_KEYS, meta, (meta.span,), x)}
                response = await client.post(
                    "/forward", headers=frame.headers | owned, content=bytes(frame.body)
                )
                decode(response.headers, response.content)
                samples.append(time.perf_counter() - start)
        return samples
    signer = Signer(KEY if client_name == "aiohttp signed" else None)
    async with aiohttp.ClientSession(url) as client_session:
        for meta in metas:
            start = time.perf_counter()
            frame = encode(x, meta)
            frame.headers[PROOF] = signed_for(PROCESS_KEYS, meta, (meta.span,), x)
            body = bytes(frame.body)
            to = "unregistered"  # a node that never joined a tracker
            proof = signer.headers("POST", "/forward", body, to=to, headers=frame.headers)
            headers = frame.headers | proof
            async with client_session.post("/forward", headers=headers, data=body) as reply:
                decode(reply.headers, await reply.read())
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
    port, signed_port = free_port(), free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    signed = subprocess.Popen([sys.executable, "-c", SERVER, str(signed_port), KEY])
    urls = {"aiohttp": f"http://127.0.0.1:{port}", "httpx": f"http://127.0.0.1:{port}"}
    urls["aiohttp signed"] = f"http://127.0.0.1:{signed_port}"
    try:
        for url in urls.values():
            wait_ready(url)
        print("| client | frame | round trips | median ms | p90 ms |")
        print("|---|---|---:|---:|---:|")
        for client_name in ("aiohttp", "aiohttp signed", "httpx"):
            for hidden in (576, 16384):
                runs = asyncio.run(round_trips(urls[client_name], count, hidden, client_name))
                samples = sorted(runs[count // 10 :])  # the first tenth warms up
                print(
                    f"| {client_name} | [1, 1, {hidden}] decode step | {count} | "
                    f"{statistics.median(samples) * 1e3:.3f} | "
                    f"{samples[int(len(samples) * 0.9)] * 1e3:.3f} |"
                )
    finally:
        for process in (server, signed):
            process.terminate()
            process.wait(timeout=10)


if __name__ == "__main__":
    main()
