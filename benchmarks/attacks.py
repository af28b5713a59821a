"""What a stranger's traffic costs a real node process now (review finding 1, ADR-0030).

    python benchmarks/attacks.py          # every probe, the slow ones included (~90 s)
    python benchmarks/attacks.py --tiny   # the quick probes only, ~15 s (what the tests run)

A node process (an echo runner behind the real guard and uvicorn settings, swarm key set)
is probed over raw sockets: how many body bytes it takes before refusing an unsigned or
stale upload, how many header bytes before refusing oversized headers, how long half-sent
headers or a stalled signed body keep a connection, and the node's RSS after 100 refused
48 MiB uploads at once. Then the review of 2026-12-06's member attacks (N1-N3, N6): what a
member's signed call gets after 1,100 half-sent requests and 61 refusals from its address,
and what a member that did not open a session gets when it forks, continues or closes it,
or pushes a frame to an address the tracker does not list.

Then the review of 2026-12-07 (shared/reviews/security-2026-12-07.md), each against the
real code, over real HTTP servers where the attack is: N1's other half (1,030 strangers'
connections kept alive with complete `GET /health`s, then 30 member calls); W1, W2 (the
`Fetcher` as a node builds it, a member posing as the first holder answering 1 GiB of zeros
in 1 MB of gzip, or a byte every few seconds, the tracker holding the file second: seconds
until fetched and peak traced memory); L1 (a member's term 2**62 in a registration and a
heartbeat to a tracker's `Registry`, then the term of that tracker's next lease ask); P1
(the prefix scope an entry's guard gives a member-signed call naming another client's key
tag without a tracker's vouch, and the victim's kept tokens a match there finds); K1 (the
ggml KV pool's pages given back once a 1,200-token session closed, and the KV that a node
lending 300 MB may hold, live and kept).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from harness import free_port  # benchmarks/harness.py
from meshnet.entry.transport import signed_for
from meshnet.security.ownership import PROOF, SessionKeys
from meshnet.security.signing import Signer
from meshnet.security.swarm import SwarmKey, route_proof, sign
from meshnet.types import LayerSpan, ModelId
from meshnet.wire import FrameMeta, encode

KEY = "attack-benchmark-swarm-key-padded-to-128-bits-0123456789"
MiB = 1 << 20
Row = tuple[str, str, int | float | str, str]  # attack, answer, figure, unit
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
    import gzip
    import os

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


FLOOD = 1030  # kept-alive strangers: past the 1,024 connections of `ServerLimits`
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"  # complete: an open path, never throttled


def raise_open_files(needed: int) -> None:
    """Room for `needed` sockets here and in the node started after (its limit is ours)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def kept_alive(port: int) -> tuple[dict[socket.socket, float], Counter[str]]:
    """FLOOD connections, each sending a complete GET /health: the sockets (with when each
    last sent one) and the statuses of their answers."""
    socks: dict[socket.socket, float] = {}
    for _ in range(FLOOD):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(HEALTH)
        socks[sock] = time.monotonic()
    codes: Counter[str] = Counter()
    for sock in socks:
        try:
            codes[sock.recv(65536).split(b" ")[1].decode()] += 1
        except (OSError, IndexError):  # closed (b"" splits into one piece) or timed out
            codes["closed"] += 1
        sock.setblocking(False)
    return socks, codes


def keep_sending(socks: dict[socket.socket, float], codes: Counter[str]) -> None:
    """Each open connection's answers read (their statuses counted in `codes`) and, 2 s after
    its last, another GET /health (the server closes one that sends no next headers 3 s
    after an answer: `header_timeout_s`); closed ones gone."""
    now = time.monotonic()
    for sock, sent in list(socks.items()):
        try:
            while data := answered(sock):
                codes.update(code.decode() for code in re.findall(rb"HTTP/1\.1 (\d{3})", data))
            if data == b"":
                raise ConnectionResetError
            if now - sent > 2:
                sock.send(HEALTH)
                socks[sock] = now
        except OSError:
            sock.close()
            del socks[sock]


def member_calls(port: int, spacing_s: float) -> list[str]:
    """30 member calls, `spacing_s` apart: each answer's status line (or what failed)."""
    answers = []
    for _ in range(30):
        try:
            answers.append(member_call(port, "GET", IDENTITY))
        except httpx.HTTPError as exc:
            answers.append(type(exc).__name__)
        time.sleep(spacing_s)
    return answers


def flood_rows(port: int, spacing_s: float) -> list[Row]:
    """N1's other half: FLOOD strangers keep connections alive with complete requests, and
    30 member calls are made `spacing_s` apart while they go on (the review's script: a GET
    every 3 s on each, which lets some close; a member call a second). A stranger's request
    while a member's call is open (the 1,024th connection) is answered 503 and closed."""
    socks, codes = kept_alive(port)
    try:
        with ThreadPoolExecutor(1) as pool:
            calling = pool.submit(member_calls, port, spacing_s)
            while not calling.done():
                keep_sending(socks, codes)
                time.sleep(0.1)
        answers, held = calling.result(), len(socks)
    finally:
        for sock in socks:
            sock.close()
    seen = ", ".join(f"{n:,} x {code}" for code, n in sorted(codes.items()))
    ok = sum(answer.startswith("200") for answer in answers)
    others = Counter(answer for answer in answers if not answer.startswith("200"))
    rest = "".join(f", {n} x {answer}" for answer, n in sorted(others.items()))
    flood = f"N1 {FLOOD:,} kept-alive strangers' GET /health (all answers)"
    calls = f"N1 30 member calls {spacing_s:g} s apart beside them"
    return [
        (flood, seen, held, "of them still open"),
        (calls, f"{ok} x 200{rest}", ok, "of 30 answered 200"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the quick probes only")
    args = parser.parse_args()
    raise_open_files(FLOOD + 256)  # before the node starts: it takes our limit
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
        rows: list[Row] = [
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
        # before them too: a throttled address's GET /health is answered 429 and closed
        rows += flood_rows(port, 0.0 if args.tiny else 0.3)  # ~1.5 s; ~10 s (GETs resent)
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
    rows += weight_rows(args.tiny) + lease_rows() + scope_rows() + pool_rows()  # 2026-12-07
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
    from member_attacks import lease_rows, pool_rows, scope_rows, weight_rows  # ./member_attacks.py

    main()
