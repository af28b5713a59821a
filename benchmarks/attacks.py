"""What a stranger's traffic costs a real node process now (review finding 1, ADR-0030).

    python benchmarks/attacks.py          # every probe, the slow ones included (~25 s)
    python benchmarks/attacks.py --tiny   # the quick probes only (what the tests run)

A node process (an echo runner behind the real guard and uvicorn settings, swarm key set)
is probed over raw sockets: how many body bytes it takes before refusing an unsigned or
stale upload, how many header bytes before refusing oversized headers, how long half-sent
headers or a stalled signed body keep a connection, and the node's RSS after 100 refused
48 MiB uploads at once. Then the review of 2026-12-06's member attacks (N1-N3, N6): what a
member's signed call gets after 1,100 half-sent requests and 61 refusals from its address,
and what a member that did not open a session gets when it forks, continues or closes it,
or pushes a frame to an address the tracker does not list.
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

import httpx
import torch

from meshnet.entry.transport import signed_for
from meshnet.security.ownership import PROOF, SessionKeys
from meshnet.security.signing import Signer
from meshnet.security.swarm import SwarmKey, route_proof, sign
from meshnet.types import LayerSpan, ModelId
from meshnet.wire import FrameMeta, encode

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


def member_call(
    port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> str:
    """A member's signed call: the answer's status line."""
    headers = dict(headers or {})
    headers |= Signer(KEY).headers(method, path, body, to=TO, headers=headers)
    url = f"http://127.0.0.1:{port}{path}"
    answer = httpx.request(method, url, content=body, headers=headers, timeout=30)
    return f"{answer.status_code} {answer.reason_phrase}"


def frame_call(port: int, meta: FrameMeta, keys: SessionKeys | None, extra: dict[str, str]) -> str:
    """`meta`'s frame, signed by the entry holding `keys` (None: unsigned)."""
    hidden = torch.randn(1, 2, 16)
    frame = encode(hidden, meta)
    owned = {PROOF: signed_for(keys, meta, (meta.span,), hidden)} if keys else {}
    return member_call(port, "POST", "/forward", bytes(frame.body), frame.headers | owned | extra)


IDENTITY = "/v1/identity?challenge=0123456789abcdef"  # a member call that answers 200


def crowded_rows(port: int) -> list[tuple[str, str, int | str, str]]:
    """N1, N2: strangers on the members' address, then a member's signed call."""
    socks = []
    try:
        for _ in range(1100):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
            sock.setblocking(False)
            socks.append(sock)
        member = member_call(port, "GET", IDENTITY)
        still = sum(answered(s) is None for s in socks)
    finally:
        for sock in socks:
            sock.close()
    refused = Counter(upload(port, None)[0].split(" ")[1] for _ in range(61))
    after = member_call(port, "GET", IDENTITY)
    seen = ", ".join(f"{n} x {code}" for code, n in sorted(refused.items()))
    return [
        ("N1 member call with 1,100 half-sent requests held", member, still, "of them open"),
        ("N2 member call after 61 refused calls from its address", after, seen, "refused"),
    ]


def session_rows(port: int) -> list[tuple[str, str, int | str, str]]:
    """N3, N6: a member that did not open a session, and a push to an address no tracker
    lists (this node has none: it pushes to no one)."""
    victim, attacker = SessionKeys(), SessionKeys()
    session, span, model = victim.new_id(), LayerSpan(0, 10), ModelId("default")
    opened = FrameMeta(session, model, span, 0)
    frame_call(port, opened, victim, {})
    mine = attacker.new_id()
    fork = FrameMeta(mine, model, span, 2, fork=session)
    step = FrameMeta(session, model, span, 2)
    pushed = FrameMeta(attacker.new_id(), model, span, 0)
    route = f"{TO} 0:10 http://127.0.0.1:{port}, svc 10:20 http://127.0.0.1:18199"
    reply = "e http://127.0.0.1:1"
    proof = route_proof(SwarmKey.from_text(KEY), pushed.session, model, route, reply)
    push = {"X-Meshnet-Route": route, "X-Meshnet-Reply-To": reply}
    push |= {"X-Meshnet-Route-Proof": proof, "X-Meshnet-Budget-Ms": "3600000"}
    forked = frame_call(port, fork, attacker, {})
    stepped = frame_call(port, step, None, {})
    closed = member_call(port, "DELETE", f"/sessions/{session}")
    sent = frame_call(port, pushed, attacker, push)
    return [
        ("N3 fork of another entry's session", forked, 0, "tokens read back"),
        ("N3 step on another entry's session", stepped, 0, "tokens read back"),
        ("N3 close of another entry's session", closed, 0, "sessions lost"),
        ("N6 push to an address no tracker lists", sent, 0, "bytes sent there"),
    ]


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
        rows += session_rows(port)  # before the refusals below, which throttle strangers
        if not args.tiny:  # ~5 s; tests/security/test_server.py checks the same in the tests
            rows += crowded_rows(port)
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
