"""What a stranger's traffic costs a real node process now (review finding 1, ADR-0030).

    python benchmarks/attacks.py          # every probe, the slow ones included (~25 s)
    python benchmarks/attacks.py --tiny   # the quick probes only (what the tests run)

A node process (an echo runner behind the real guard and uvicorn settings, swarm key set)
is probed over raw sockets: how many body bytes it takes before refusing an unsigned or
stale upload, how many header bytes before refusing oversized headers, how long half-sent
headers or a stalled signed body keep a connection, and the node's RSS after 100 refused
48 MiB uploads at once.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from meshnet.security.swarm import SwarmKey, sign

KEY = "attack-benchmark-swarm-key-padded-to-128-bits-0123456789"
MiB = 1 << 20
TO = "unregistered"  # the node id of a node that never joined a tracker
SERVER = """
import sys, uvicorn
from meshnet.assemble.http import ServerLimits, server_config
from meshnet.config import AccessConfig
from meshnet.node.app import create_app
from meshnet.node.runner import EchoRunner
from meshnet.types import LayerSpan, ModelId
runner = EchoRunner(ModelId("default"), LayerSpan(0, 10))
app = create_app(runner, access=AccessConfig(swarm_key=sys.argv[2]))
uvicorn.Server(server_config(app, "127.0.0.1", int(sys.argv[1]), ServerLimits())).run()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    return sock


def answered(sock: socket.socket) -> bytes | None:
    """What the server sent so far (b"" once it closed), or None when nothing yet."""
    try:
        return sock.recv(65536)
    except BlockingIOError:
        return None


def upload(port: int, proof: str | None) -> tuple[str, int]:
    """A 48 MiB POST /forward sent 64 KiB at a time until the server answers: its status
    line and the body bytes sent by then."""
    sock, sent = connect(port), 0
    head = f"POST /forward HTTP/1.1\r\nHost: x\r\nContent-Length: {48 * MiB}\r\n"
    head += f"X-Meshnet-Auth: {proof}\r\n" if proof else ""
    sock.sendall((head + "\r\n").encode())
    time.sleep(0.2)  # the refusal needs no body: give it the chance to come first
    piece = b"x" * (64 << 10)
    while (reply := answered(sock)) is None and sent < 48 * MiB:
        try:
            sent += sock.send(piece)
        except BlockingIOError:
            time.sleep(0.01)
    sock.close()
    return (reply or b"(none)").split(b"\r\n")[0].decode(), sent


def big_headers(port: int) -> tuple[str, int]:
    """Up to 8 MiB of headers, one 16 KiB header at a time with a pause to let an answer
    come: the status, and header bytes sent when it came."""
    sock, sent = connect(port), 0
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    line = b"X-Pad: " + b"a" * (16 << 10) + b"\r\n"
    while (reply := answered(sock)) is None and sent < 8 * MiB:
        with contextlib.suppress(BlockingIOError, BrokenPipeError, ConnectionResetError):
            sent += sock.send(line)
        time.sleep(0.02)
    sock.close()
    return (reply or b"(none)").split(b"\r\n")[0].decode(), sent


def held_s(port: int, data: bytes, limit_s: float = 60.0) -> tuple[str, float]:
    """Send `data` and nothing more: what came back, and seconds until the server answered
    or, answering nothing, closed the connection."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(limit_s)
    sock.sendall(data)
    started, reply, took = time.monotonic(), b"", 0.0
    try:
        while chunk := sock.recv(65536):
            took, reply = took or time.monotonic() - started, reply + chunk
    except TimeoutError:
        pass
    sock.close()
    status = reply.split(b"\r\n")[0].decode() if reply else "(closed)"
    return status, took or time.monotonic() - started


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def probe_bomb(megabytes: int) -> tuple[str, float]:
    """The real registration prober (in this process) against a server answering a gzip
    bomb of `megabytes` inflated: how it failed, and this process's RSS growth in MiB."""
    import asyncio
    import gzip
    import os
    import threading

    from meshnet.security.signing import Signer
    from meshnet.tracker.probe import HttpProber, ProbeError

    bomb = gzip.compress(b" " * (megabytes << 20), compresslevel=9)
    head = f"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: {len(bomb)}\r\n"
    reply = (head + "Content-Type: application/json\r\n\r\n").encode() + bomb
    server = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            with contextlib.suppress(OSError):
                conn.sendall(reply)

    threading.Thread(target=answer, daemon=True).start()
    with contextlib.suppress(ProbeError):  # warm-up: imports, TLS defaults, the event loop
        asyncio.run(HttpProber(Signer(KEY), timeout_s=0.5).probe("n1", "http://127.0.0.1:9"))
    before = rss_mib(os.getpid())
    address = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        asyncio.run(HttpProber(Signer(KEY), timeout_s=3.0).probe("n1", address))
        outcome = "accepted (!)"
    except ProbeError as exc:
        outcome = f"{type(exc).__name__} ({exc.field})"
    server.close()
    return outcome, rss_mib(os.getpid()) - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the quick probes only")
    args = parser.parse_args()
    port = free_port()
    node = subprocess.Popen([sys.executable, "-c", SERVER, str(port), KEY])
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except OSError:
                time.sleep(0.05)
        stale = sign(SwarmKey.from_text(KEY), "POST", b"/forward", b"", time.time() - 3600, TO)
        rows = [
            ("unsigned 48 MiB POST /forward", *upload(port, None), "body bytes sent"),
            ("48 MiB POST with an hour-old proof", *upload(port, stale), "body bytes sent"),
            ("8 MiB of headers", *big_headers(port), "header bytes sent"),
        ]
        if not args.tiny:  # before the refusals below: past 60 a minute, answers are 429
            status, took = held_s(port, b"GET /health HTTP/1.1\r\nHost: x\r\n")
            rows.append(("half-sent headers", status, round(took, 1), "s until closed"))
            body = b"x" * 10
            key = SwarmKey.from_text(KEY)
            proof = sign(key, "POST", b"/forward", b"x" * 200_000, time.time(), TO)
            head = "POST /forward HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n"
            head += f"X-Meshnet-Auth: {proof}\r\n\r\n"
            status, took = held_s(port, head.encode() + body)
            rows.append(
                ("signed body stalled after 10 bytes", status, round(took, 1), "s until answered")
            )
        before = rss_mib(node.pid)
        with ThreadPoolExecutor(100) as pool:
            answers = list(pool.map(lambda _: upload(port, None), range(100)))
        codes = Counter(status.split(" ")[1] for status, _ in answers)
        seen = ", ".join(f"{n} x {code}" for code, n in sorted(codes.items()))
        rows.append(("100 unsigned 48 MiB POSTs at once", seen, 0, "RSS growth"))
        grown = rss_mib(node.pid) - before
    finally:
        node.terminate()
        node.wait(10)
    outcome, grown_probe = probe_bomb(20 if args.tiny else 200)
    size = "20 MB" if args.tiny else "200 MB"
    rows.append(
        (f"probe answered by a {size} gzip bomb", outcome, f"{grown_probe:.1f}", "probe RSS")
    )
    print("| attack | answer | figure | unit |")
    print("|---|---|---:|---|")
    for name, status, figure, unit in rows:
        if unit == "RSS growth":
            figure, unit = f"{grown:.1f}", "MiB of RSS growth"
        if unit == "probe RSS":
            unit = "MiB of the prober's RSS growth"
        print(
            f"| {name} | {status} | {figure:,} | {unit} |"
            if isinstance(figure, int)
            else f"| {name} | {status} | {figure} | {unit} |"
        )


if __name__ == "__main__":
    main()
