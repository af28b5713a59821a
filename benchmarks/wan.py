"""The mesh over slow links: each remote node behind a delaying, rate-limiting TCP proxy.

    python benchmarks/wan.py          # {0, 5, 25, 50} ms x {unlimited, 100 Mbit/s}, int8
    python benchmarks/wan.py --tiny   # 5 ms, unlimited, a 16-token prompt (what tests run)

A tracker-as-entry-node (layers 0:10), two nodes (10:20, 20:30) and a second entry (0:10),
real processes. Each
node registers `--public-address` pointing at its own proxy, so every frame the entry sends
it crosses one emulated link (there is no `tc netem` here): the proxy holds every byte
`delay` ms in each direction and paces it at the link rate. Decode tokens/s is
(t(N+1) - t(1)) / N for the same prompt; TTFT is a request with `max_tokens=1`.

Two entries share the nodes: the tracker relays (`--no-push`: the entry sends every frame
to every hop and gets its answer back), a `node --entry --push` pushes (ADR-0034: each hop
sends on to the next, the last to the entry); their requests alternate, so the two modes
are measured side by side on the same machine state. The relay bound: per token, every
remote hop is a round trip from the entry (2 x hops legs of `delay`), plus the frame's
serialization at the link rate, plus the compute measured at 0 ms (that mode's first row);
per prompt, each 128-token chunk crosses every hop in turn. The push bound: hops + 1 legs
per token; chunks + hops - 1 chunk-times per prompt when chunks are pipelined.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from meshnet.models.loader import load_tokenizer
from meshnet.models.source import resolve
from pipeline import free_port, prompts_for, running, wait_routable

HIDDEN_BYTES = 576 * 2  # one token's activations on the wire (bf16)
FRAME_OVERHEAD = 600  # request line and headers, each way (measured: ~550 bytes)
CHUNK = 128  # prefill tokens a frame


@dataclass
class Link:
    """One emulated link: one-way delay and rate, changeable while it carries traffic."""

    delay_s: float = 0.0
    rate_bps: float | None = None  # bits per second; None = unlimited


class LinkProxy:
    """A TCP proxy on 127.0.0.1 that delays and paces bytes both ways (its own thread)."""

    def __init__(self, upstream_port: int, link: Link) -> None:
        self.upstream_port = upstream_port
        self.link = link
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._connect, "127.0.0.1", self.port)
        )
        started.set()
        self.loop.run_forever()

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Bytes from `reader` reach `writer` `delay` later, no faster than the rate."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.create_task(self._send(queue, writer))
        free_at = 0.0  # when the link finishes serializing what it was given so far
        try:
            while data := await reader.read(65536):
                now = time.monotonic()
                rate = self.link.rate_bps
                free_at = max(free_at, now) + (len(data) * 8 / rate if rate else 0.0)
                queue.put_nowait((free_at + self.link.delay_s, data))
        except OSError:
            pass
        queue.put_nowait((0.0, b""))  # end of stream
        await sender

    async def _send(
        self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter
    ) -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            try:
                writer.write(data)
                await writer.drain()
            except OSError:
                break
        writer.close()


@contextmanager
def mesh(logs: Path, quant: str, link: Link) -> Iterator[dict[str, str]]:
    """Two entries of layers 0:10 over the same nodes 10:20 and 20:30: the tracker relays,
    a `node --entry --push` pushes. Every process is reached by its peers through its own
    proxy on `link` (an entry too: the last hop's pushed answer crosses a link), while
    clients and heartbeats reach the tracker directly. The entries' URLs by mode."""
    port, push_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"MESHNET_SWARM_KEY": secrets.token_hex(32)}
    common = ["--quant", quant, "--spot-check-rate", "0"]
    commands = [["tracker", "--port", str(port), "--layers", "0:10", *common, "--no-push"]]
    commands[0] += ["--data-dir", str(logs / "tracker")]
    for i, span in enumerate(["10:20", "20:30"]):
        node_port = free_port()
        proxy = LinkProxy(node_port, link)
        commands.append(
            ["node", "--tracker", url, "--port", str(node_port), "--layers", span, *common]
            + ["--no-entry", "--public-address", f"http://127.0.0.1:{proxy.port}"]
            + ["--data-dir", str(logs / f"node{i}")]
        )
    push_proxy = LinkProxy(push_port, link)
    commands.append(
        ["node", "--tracker", url, "--port", str(push_port), "--layers", "0:10", *common]
        + ["--entry", "--push", "--public-address", f"http://127.0.0.1:{push_proxy.port}"]
        + ["--data-dir", str(logs / "push-entry")]
    )
    with running(commands, logs, "", env):
        wait_routable(url, 3)
        push_url = f"http://127.0.0.1:{push_port}"
        wait_routable(url, 3)
        with httpx.Client(base_url=push_url, timeout=600) as client:
            wait_answers(client)
        yield {"relay": url, "push": push_url}


def wait_answers(client: httpx.Client, timeout_s: float = 120.0) -> None:
    """Until the entry answers a completion (it has loaded its span and found a route)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            body = {"model": "default", "prompt": "Hi", "max_tokens": 1}
            if client.post("/v1/completions", json=body).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the pushing entry never answered")


def timed(client: httpx.Client, text: str, tokens: int) -> float:
    body = {"model": "default", "prompt": text, "max_tokens": tokens, "temperature": 0}
    start = time.perf_counter()
    answer = client.post("/v1/completions", json=body).json()
    took = time.perf_counter() - start
    if answer["usage"]["completion_tokens"] != tokens or len(answer["meshnet"]["route"]) != 3:
        raise RuntimeError(f"unexpected answer: {answer['usage']}, {answer['meshnet']['route']}")
    return took


def bytes_sent(client: httpx.Client) -> float:
    """Activation bytes the entry has sent to its hops so far (`/metrics`, all encodings)."""
    lines = client.get("/metrics").text.splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith("meshnet_bytes_sent_total"))


def traffic(url: str, prompts: dict[int, str], tokens: int) -> tuple[float, float]:
    """Bytes the entry sends per decode token, and per prompt of the longest length."""
    with httpx.Client(base_url=url, timeout=600) as client:
        start = bytes_sent(client)
        timed(client, prompts[max(prompts)], 1)
        long_done = bytes_sent(client)
        timed(client, prompts[16], 1)
        short_done = bytes_sent(client)
        timed(client, prompts[16], tokens + 1)
        decoded = bytes_sent(client) - short_done - (short_done - long_done)  # less its prompt
    return decoded / tokens, long_done - start


def measure(
    urls: dict[str, str], prompts: dict[int, str], tokens: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Per mode, median TTFT per prompt length and decode ms/token; the modes' requests
    alternate, so both see the same machine."""
    clients = {mode: httpx.Client(base_url=u, timeout=600) for mode, u in urls.items()}
    samples: dict[str, dict[str, list[float]]] = {m: {} for m in urls}
    try:
        for client in clients.values():
            timed(client, prompts[16], 2)  # warm-up
        for _ in range(repeats):
            for mode, client in clients.items():
                for n, text in prompts.items():
                    samples[mode].setdefault(f"ttft_{n}", []).append(timed(client, text, 1))
                samples[mode].setdefault("long", []).append(timed(client, prompts[16], tokens + 1))
    finally:
        for client in clients.values():
            client.close()
    rows = {m: {k: statistics.median(v) for k, v in got.items()} for m, got in samples.items()}
    for row in rows.values():
        row["decode_ms"] = 1000 * (row.pop("long") - row["ttft_16"]) / tokens
    return rows


def serialization_s(payload_bytes: int, rate_bps: float | None) -> float:
    return (payload_bytes + FRAME_OVERHEAD) * 8 / rate_bps if rate_bps else 0.0


def bounds(link: Link, base: dict[str, float], n: int) -> dict[str, float]:
    """Physical bounds (ms) for today's design and for push, from the 0 ms row's compute."""
    d_ms, hops = 1000 * link.delay_s, 2
    step_ms = 1000 * serialization_s(HIDDEN_BYTES, link.rate_bps)
    chunks = -(-n // CHUNK)
    chunk_ms = 1000 * serialization_s(min(n, CHUNK) * HIDDEN_BYTES, link.rate_bps)
    return {
        "decode_today": 2 * hops * (d_ms + step_ms) + base["decode_ms"],
        "decode_push": (hops + 1) * (d_ms + step_ms) + base["decode_ms"],
        f"ttft_{n}_today": 1000 * base[f"ttft_{n}"] + chunks * 2 * hops * (d_ms + chunk_ms),
        f"ttft_{n}_push": 1000 * base[f"ttft_{n}"] + (chunks + hops) * (d_ms + chunk_ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quant", default="int8")
    parser.add_argument("--mode", choices=["relay", "push", "both"], default="both")
    parser.add_argument("--lengths", default="16,512,2048", help="prompt lengths for TTFT")
    parser.add_argument("--delays", default="0,5,25,50", help="one-way delays (ms) per link")
    parser.add_argument("--rates", default="0,100", help="link rates (Mbit/s, 0: unlimited)")
    args = parser.parse_args()
    tiny = args.tiny
    lengths = [16] if tiny else [int(n) for n in args.lengths.split(",")]
    tokens, repeats = (4, 1) if tiny else (args.tokens, args.repeats)
    delays = [0.0, 5.0] if tiny else [float(d) for d in args.delays.split(",")]
    rates: list[float | None] = (
        [None] if tiny else [float(r) * 1e6 if float(r) else None for r in args.rates.split(",")]
    )
    prompts = prompts_for(load_tokenizer(resolve("default")), lengths)
    link = Link()
    heads = " | ".join(f"TTFT {n} ms (bound relay / push)" for n in lengths)
    print(f"| mode | one-way delay | link | decode ms/token | bound relay | push bound | {heads} |")
    print("|---|---:|---|---:|---:|---:|" + "---:|" * len(lengths))
    with (
        tempfile.TemporaryDirectory(prefix="meshnet-wan-") as logs,
        mesh(Path(logs), "fp32" if tiny else args.quant, link) as urls,
    ):
        urls = {m: u for m, u in urls.items() if args.mode in (m, "both")}
        base: dict[str, dict[str, float]] = {}
        for rate in rates:
            for delay in delays:
                link.delay_s, link.rate_bps = delay / 1000, rate
                rows = measure(urls, prompts, tokens, repeats)
                base = base or rows  # the first row's compute (0 ms, unlimited)
                for mode, row in rows.items():
                    print(line(mode, link, row, base[mode], lengths), flush=True)
        link.delay_s, link.rate_bps = 0.0, None
        for mode, url in urls.items():
            per_token, per_prompt = traffic(url, prompts, tokens)
            print(
                f"\n{mode}: activation bytes the entry sends to its hops: {per_token:,.0f} a "
                f"decode token, {per_prompt:,.0f} for a {max(lengths)}-token prompt"
            )


def line(
    mode: str, link: Link, row: dict[str, float], base: dict[str, float], lengths: list[int]
) -> str:
    rate = f"{link.rate_bps / 1e6:.0f} Mbit/s" if link.rate_bps else "unlimited"
    b = {k: v for n in lengths for k, v in bounds(link, base, n).items()}
    ttfts = " | ".join(
        f"{1000 * row[f'ttft_{n}']:.0f} ({b[f'ttft_{n}_today']:.0f} / {b[f'ttft_{n}_push']:.0f})"
        for n in lengths
    )
    return (
        f"| {mode} | {1000 * link.delay_s:.0f} ms | {rate} | {row['decode_ms']:.1f} "
        f"| {b['decode_today']:.1f} | {b['decode_push']:.1f} | {ttfts} |"
    )


if __name__ == "__main__":
    main()
