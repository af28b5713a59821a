"""The mesh over slow links: each remote node behind a delaying, rate-limiting TCP proxy.

    python benchmarks/wan.py          # {0, 5, 25, 50} ms x {unlimited, 100 Mbit/s}, int8
    python benchmarks/wan.py --tiny   # 0 and 5 ms, unlimited, fp32, short prompts (the tests)
    python benchmarks/wan.py --compare encodings [--tiny]   # `auto` against none and zstd
    python benchmarks/wan.py --compare all --tiny   # designs, encodings and drafts on one mesh

A tracker-as-entry-node (layers 0:10), two nodes (10:20, 20:30) and two more entries (0:10),
real processes. Each node registers `--public-address` pointing at its own proxy, so every
frame an entry sends it crosses one emulated link (there is no `tc netem` here): the proxy
holds every byte `delay` ms in each direction and paces it at the link rate. Decode tokens/s
is (t(N+1) - t(1)) / N for the same prompt; TTFT is a request with `max_tokens=1`.

Three entries share the nodes, one per design, their requests alternating so that all see
the same machine state:
- `sequential` (today's design before ADR-0036, `--no-pipelined-prefill --no-push`): the
  entry sends every frame to every hop and gets its answer back, a prompt one 128-token chunk
  at a time through every hop;
- `relay` (the tracker, `--no-push`): the same per token, a prompt's chunks pipelined;
- `push` (`node --entry --push`, ADR-0034): each hop sends a token on to the next, the last
  one to the entry; prompts pipelined.

Bounds, from compute measured at 0 ms: per token, a relayed step is 2 x hops legs of `delay`
plus serialization at the link rate plus that mode's compute; a pushed one hops + 1 legs.
Per prompt, one chunk at a time costs chunks x (stages x chunk compute + 2 x hops legs);
pipelined, every stage's chunk time once and the slowest stage's for each further chunk
(a hop's chunk time: its compute and its two legs; one stage's chunk compute taken from
the sequential 0 ms TTFT / (chunks x stages)): what independent machines would give. Here
all stages share one machine's cores, which the pipelined bound does not charge.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from meshnet.models.loader import load_tokenizer
from meshnet.models.source import resolve
from pipeline import free_port, prompts_for, running, wait_routable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.e2e.slowlink import Link, LinkProxy  # noqa: E402

HIDDEN_BYTES = 576 * 2  # one token's activations on the wire (bf16)
FRAME_OVERHEAD = 600  # request line and headers, each way (measured: ~550 bytes)
CHUNK = 128  # prefill tokens a frame


# the entries each comparison runs: flags of its two `node --entry`s, and the tracker's name
DESIGNS = {"sequential": ["--no-push", "--no-pipelined-prefill"], "push": ["--push"]}
ENCODINGS = {e: ["--no-push", "--wire-encoding", e] for e in ("none", "zstd-shuffle")}
ALL = ("designs", "encodings", "drafts")  # `--compare all`: one mesh for the three (the tests)
COMPARISONS = {
    "designs": (DESIGNS, "relay", ("sequential", "relay", "push")),
    "encodings": (ENCODINGS, "auto", ("none", "zstd-shuffle", "auto")),
    # two entries of the same kind (the tracker's entry has the control plane's work too)
    "drafts": (
        {"plain": ["--no-push"], "lookup": ["--no-push", "--draft", "lookup"]},
        "tracker",
        ("plain", "lookup"),
    ),
}


@contextmanager
def mesh(
    logs: Path,
    quant: str,
    link: Link,
    compare: Sequence[str],
    auto_below_mbit_s: float | None = None,
) -> Iterator[tuple[dict[str, str], list[str]]]:
    """The entries of layers 0:10 of each comparison in `compare` (the tracker is one of
    them) over the same nodes 10:20 and 20:30, one per mode (see the module's docstring).
    Every process is reached by its peers through its own proxy on `link` (an entry too:
    the last hop's pushed answer crosses a link), while clients and heartbeats reach the
    tracker directly. The entries' URLs by mode, and the nodes' URLs."""
    entries = {mode: flags for c in compare for mode, flags in COMPARISONS[c][0].items()}
    tracker_modes = [COMPARISONS[c][1] for c in compare]
    order = list(dict.fromkeys(mode for c in compare for mode in COMPARISONS[c][2]))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"MESHNET_SWARM_KEY": secrets.token_hex(32)}
    common = ["--quant", quant, "--spot-check-rate", "0"]
    if auto_below_mbit_s is not None:
        common += ["--auto-compress-below", str(auto_below_mbit_s)]
    commands = [["tracker", "--port", str(port), "--layers", "0:10", *common, "--no-push"]]
    commands[0] += ["--data-dir", str(logs / "tracker")]
    node_ports = [free_port(), free_port()]
    for i, (span, node_port) in enumerate(zip(["10:20", "20:30"], node_ports, strict=True)):
        proxy = LinkProxy(node_port, link)
        commands.append(
            ["node", "--tracker", url, "--port", str(node_port), "--layers", span, *common]
            + ["--no-entry", "--public-address", f"http://127.0.0.1:{proxy.port}"]
            + ["--data-dir", str(logs / f"node{i}")]
        )
    ports = {mode: free_port() for mode in entries}
    for mode, flags in entries.items():
        proxy = LinkProxy(ports[mode], link)
        commands.append(
            ["node", "--tracker", url, "--port", str(ports[mode]), "--layers", "0:10", *common]
            + ["--entry", *flags, "--public-address", f"http://127.0.0.1:{proxy.port}"]
            + ["--data-dir", str(logs / f"{mode}-entry")]
        )
    with running(commands, logs, "", env):
        wait_routable(url, 3)
        urls = {mode: f"http://127.0.0.1:{p}" for mode, p in ports.items()}
        for entry_url in urls.values():
            with httpx.Client(base_url=entry_url, timeout=600) as client:
                wait_answers(client)
        nodes = [f"http://127.0.0.1:{p}" for p in node_ports]
        urls |= {mode: url for mode in tracker_modes}
        yield {mode: urls[mode] for mode in order}, nodes


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
    raise RuntimeError(f"the entry at {client.base_url} never answered")


def timed(client: httpx.Client, text: str, tokens: int) -> float:
    body = {"model": "default", "prompt": text, "max_tokens": tokens, "temperature": 0}
    start = time.perf_counter()
    answer = client.post("/v1/completions", json=body).json()
    took = time.perf_counter() - start
    if "usage" not in answer:
        raise RuntimeError(f"the entry refused a {len(text)}-character prompt: {answer}")
    if answer["usage"]["completion_tokens"] != tokens or len(answer["meshnet"]["route"]) != 3:
        raise RuntimeError(f"unexpected answer: {answer['usage']}, {answer['meshnet']['route']}")
    return took


def warm_link(url: str, prompt: str, prompts: int = 3) -> None:
    """Send `prompts` long prompts first, so that every hop's link measurement (the median of
    its last 5 large frames, ADR-0037) holds only frames over the link as it is now: one or
    two frames taken on a busy 2-core machine otherwise decide `auto`'s choice alone."""
    with httpx.Client(base_url=url, timeout=600) as client:
        for _ in range(prompts):
            timed(client, prompt, 1)


def bytes_sent(url: str) -> float:
    """Activation bytes a process has sent so far (`/metrics`, all encodings)."""
    lines = httpx.get(f"{url}/metrics", timeout=60).text.splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith("meshnet_bytes_sent_total"))


def slowest_link_mbit_s(url: str) -> float | None:
    """The slowest link rate the process at `url` measured to its peers (ADR-0037), Mbit/s;
    None before it measured one."""
    lines = httpx.get(f"{url}/metrics", timeout=60).text.splitlines()
    rates = [float(x.split()[-1]) for x in lines if x.startswith("meshnet_link_mbit_per_second{")]
    return min(rates) if rates else None


def traffic(url: str, nodes: list[str], prompts: dict[int, str], tokens: int) -> list[float]:
    """Bytes the entry at `url`, then all `nodes` together, send per decode token and per
    prompt of the longest length (entry's token, nodes' token, entry's prompt, nodes')."""
    senders = [[url], nodes]
    with httpx.Client(base_url=url, timeout=600) as client:
        start = [sum(map(bytes_sent, group)) for group in senders]
        timed(client, prompts[max(prompts)], 1)
        long_done = [sum(map(bytes_sent, group)) for group in senders]
        timed(client, prompts[16], 1)
        short_done = [sum(map(bytes_sent, group)) for group in senders]
        timed(client, prompts[16], tokens + 1)
        ended = [sum(map(bytes_sent, group)) for group in senders]
    # a decode token: the long request less its prompt (what the short one sent)
    per_token = [
        (e - 2 * s + d) / tokens for e, s, d in zip(ended, short_done, long_done, strict=True)
    ]
    return [*per_token, *(d - s for d, s in zip(long_done, start, strict=True))]


def measure(
    urls: dict[str, str], prompts: dict[int, str], tokens: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Per mode, median TTFT per prompt length and decode ms/token; the modes' requests
    alternate, so both see the same machine."""
    clients = {mode: httpx.Client(base_url=u, timeout=600) for mode, u in urls.items()}
    samples: dict[str, dict[str, list[float]]] = {m: {} for m in urls}
    try:
        for client in clients.values():
            timed(client, prompts[16], 2)  # warm-up, and `auto` measures the link anew
            timed(client, prompts[max(prompts)], 1)
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


def bounds(mode: str, link: Link, base: dict[str, dict[str, float]], n: int) -> tuple[float, float]:
    """Physical bounds (ms) of `mode` at `link`: a decode token, and the TTFT of an
    `n`-token prompt; compute from the 0 ms rows (`base`, by mode)."""
    d_ms, hops, stages = 1000 * link.delay_s, 2, 3
    step_ms = 1000 * serialization_s(HIDDEN_BYTES, link.rate_bps)
    legs = hops + 1 if mode == "push" else 2 * hops
    decode = legs * (d_ms + step_ms) + base[mode]["decode_ms"]
    chunks = -(-n // CHUNK)
    chunk_ms = 1000 * serialization_s(min(n, CHUNK) * HIDDEN_BYTES, link.rate_bps)
    sequential = 1000 * base.get("sequential", base[mode])[f"ttft_{n}"]  # chunks x stages
    if mode == "sequential" or chunks == 1:
        return decode, sequential + chunks * 2 * hops * (d_ms + chunk_ms)
    stage_ms = sequential / (chunks * stages)  # one chunk's compute on one stage
    hop_ms = stage_ms + 2 * (d_ms + chunk_ms)  # a hop's chunk time: compute and two legs
    return decode, stage_ms + hops * hop_ms + (chunks - 1) * max(stage_ms, hop_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quant", default="int8")
    parser.add_argument("--compare", choices=[*sorted(COMPARISONS), "all"], default="designs")
    parser.add_argument("--mode", default=["all"], nargs="+", help="of the comparison's three")
    parser.add_argument("--lengths", default="16,512,2048", help="prompt lengths for TTFT")
    parser.add_argument("--delays", default="0,5,25,50", help="one-way delays (ms) per link")
    parser.add_argument("--rates", default="0,100", help="link rates (Mbit/s, 0: unlimited)")
    args = parser.parse_args()
    tiny = args.tiny
    compared = ALL if args.compare == "all" else (args.compare,)
    # tiny: a 2-core machine busy with other work measured its loopback below the default
    # 600 Mbit/s (suite runs of 2026-12-03 and -04); 100 Mbit/s still tells it from the
    # 20 Mbit/s link of the encodings, with a factor of 5 on either side
    auto_below = 100.0 if tiny else None
    lengths = [16, 160] if tiny else [int(n) for n in args.lengths.split(",")]  # 160: 2 chunks
    tokens, repeats = (4, 1) if tiny else (args.tokens, args.repeats)
    prompts = prompts_for(load_tokenizer(resolve("default")), lengths)
    link = Link()
    with (
        tempfile.TemporaryDirectory(prefix="meshnet-wan-") as logs,
        mesh(Path(logs), "fp32" if tiny else args.quant, link, compared, auto_below) as (
            urls,
            nodes,
        ),
    ):
        for compare in compared:
            chosen = {m: urls[m] for m in COMPARISONS[compare][2] if {m, "all"} & set(args.mode)}
            link.delay_s, link.rate_bps = 0.0, None
            if compare == "drafts":  # benchmarks/speculative.py's table, on this mesh
                from speculative import tiny_table  # it imports this module

                tiny_table(chosen, link)
                continue
            delays, rates = grid(compare, tiny, args.delays, args.rates)
            table(compare, chosen, nodes, link, prompts, lengths, tokens, repeats, delays, rates)
            print()


def grid(
    compare: str, tiny: bool, delays: str, rates: str
) -> tuple[list[float], list[float | None]]:
    """The one-way delays (s) and link rates (bit/s, None: unlimited) a comparison runs at."""
    if tiny:  # encodings: a link slow enough to pay for compression (loopback: the full run)
        delays, rates = ("0,5", "0") if compare == "designs" else ("0", "20")
    return (
        [float(d) / 1000 for d in delays.split(",")],
        [float(r) * 1e6 if float(r) else None for r in rates.split(",")],
    )


def table(
    compare: str,
    urls: dict[str, str],
    nodes: list[str],
    link: Link,
    prompts: dict[int, str],
    lengths: list[int],
    tokens: int,
    repeats: int,
    delays: list[float],
    rates: list[float | None],
) -> None:
    """One comparison's table, a row per mode and link; the designs' bytes after it."""
    designs = compare == "designs"
    print(designs_head(lengths) if designs else encodings_head(lengths))
    base: dict[str, dict[str, float]] = {}
    for rate in rates:
        for delay in delays:
            link.delay_s, link.rate_bps = delay, rate
            rows = measure(urls, prompts, tokens, repeats)
            base = base or rows  # the first row's compute (0 ms, unlimited)
            for mode, row in rows.items():
                if designs:
                    print(line(mode, link, row, base, lengths), flush=True)
                else:
                    warm_link(urls[mode], prompts[max(prompts)])
                    sent = traffic(urls[mode], nodes, prompts, tokens)
                    measured = slowest_link_mbit_s(urls[mode])
                    print(encodings_line(mode, link, row, lengths, sent, measured), flush=True)
    if designs:
        link.delay_s, link.rate_bps = 0.0, None
        for mode, url in urls.items():
            per_token, _, per_prompt, _ = traffic(url, nodes, prompts, tokens)
            print(
                f"\n{mode}: activation bytes the entry sends to its hops: {per_token:,.0f} a "
                f"decode token, {per_prompt:,.0f} for a {max(lengths)}-token prompt"
            )


def designs_head(lengths: list[int]) -> str:
    heads = " | ".join(f"TTFT {n} ms | bound | x bound" for n in lengths)
    return (
        f"| mode | one-way delay | link | decode ms/token | bound | x bound | {heads} |\n"
        + "|---|---:|---|---:|---:|---:|"
        + "---:|---:|---:|" * len(lengths)
    )


def encodings_head(lengths: list[int]) -> str:
    heads = " | ".join(f"TTFT {n} ms" for n in lengths)
    n = max(lengths)
    return (
        f"| entry encoding | one-way delay | link | decode ms/token | {heads} | entry sends a "
        f"token | hops send a token | entry sends a {n}-token prompt | hops send it | slowest "
        "link the entry measured, Mbit/s |\n" + "|---|---:|---|---:|" + "---:|" * (len(lengths) + 5)
    )


def encodings_line(
    mode: str,
    link: Link,
    row: dict[str, float],
    lengths: list[int],
    sent: list[float],
    measured_mbit_s: float | None,
) -> str:
    rate = f"{link.rate_bps / 1e6:.0f} Mbit/s" if link.rate_bps else "unlimited"
    cells = [f"{row['decode_ms']:.1f}", *(f"{1000 * row[f'ttft_{n}']:.0f}" for n in lengths)]
    cells += [f"{b:,.0f}" for b in sent]
    cells.append("-" if measured_mbit_s is None else f"{measured_mbit_s:.0f}")
    return f"| {mode} | {1000 * link.delay_s:.0f} ms | {rate} | " + " | ".join(cells) + " |"


def line(
    mode: str,
    link: Link,
    row: dict[str, float],
    base: dict[str, dict[str, float]],
    lengths: list[int],
) -> str:
    rate = f"{link.rate_bps / 1e6:.0f} Mbit/s" if link.rate_bps else "unlimited"
    decode = bounds(mode, link, base, lengths[0])[0]
    cells = [f"{row['decode_ms']:.1f} | {decode:.1f} | {row['decode_ms'] / decode:.2f}"]
    for n in lengths:
        ms, bound = 1000 * row[f"ttft_{n}"], bounds(mode, link, base, n)[1]
        cells.append(f"{ms:.0f} | {bound:.0f} | {ms / bound:.2f}")
    return f"| {mode} | {1000 * link.delay_s:.0f} ms | {rate} | " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
