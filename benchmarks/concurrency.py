"""Many users at once: aggregate and per-request speed at 1 to 16 concurrent requests.

    python benchmarks/concurrency.py                      # 3-hop mesh and 1 node; fp32, bf16, int8
    python benchmarks/concurrency.py --tiny               # 3-hop fp32, 1 and 2 at once, 8 tokens
    python benchmarks/concurrency.py --setups 3hop --quants bf16 --extra=--no-host-turns
    python benchmarks/concurrency.py --setups 1node --quants gguf   # ggml nodes

Setups, each its own processes on loopback: `3hop` is a tracker-as-entry-node (0:10) and two
nodes (10:20, 20:30); `1node` is a tracker-as-entry-node holding all 30 layers. Each level
sends N greedy chat requests at once (different prompts, 48 tokens each, streamed) and
measures: aggregate tokens/s (all tokens / wall time), per-request tokens/s (median), time to
first token p50 and p95; each as a ratio to one request alone. Medians of `--repeats` rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

from meshnet.models.quantize import local_layer_bytes
from meshnet.models.sizing import file_layer_bytes
from meshnet.models.source import resolve

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.e2e.procs import free_port  # noqa: E402

TOPICS = ["a robot", "the sea", "a forest", "a city", "a bicycle", "the moon", "a river", "tea"]
TOPICS += ["a clock", "a violin", "snow", "a garden", "a lighthouse", "bread", "a train", "a cat"]
SPANS = {"3hop": ["0:10", "10:20", "20:30"], "1node": ["0:30"]}


@contextmanager
def mesh(setup: str, quant: str, extra: list[str], logs: Path) -> Iterator[str]:
    """The processes of `setup` at `quant`; yields the API's URL once the model is routable."""
    spans, port = SPANS[setup], free_port()
    url = f"http://127.0.0.1:{port}"
    source = resolve("default")
    per_layer = (  # gguf: ggml at the file's own types (ADR-0051)
        file_layer_bytes(source.path) if quant == "gguf" else local_layer_bytes(source.spec, quant)  # type: ignore[arg-type]
    )
    # one benchmark client sends every request: allow it the highest level at once
    commands = [["tracker", "--port", str(port), "--layers", spans[0], "--max-concurrent", "64"]]
    for _ in spans[1:]:  # the tracker's planner gives each node the next ten layers
        budget = math.floor(10.5 * per_layer / 0.9)  # ten layers and the 10% KV reserve
        commands.append(["node", "--tracker", url, "--port", str(free_port())])
        commands[-1] += ["--budget", str(budget), "--no-entry"]  # spans alone (ADR-0052)
    env = {**os.environ, "MESHNET_SWARM_KEY": secrets.token_hex(32)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli", *c, "--quant", quant, *extra]
            + ["--data-dir", str(logs / f"{setup}-{quant}-{i}")],
            stdout=(logs / f"{setup}-{quant}-{i}.log").open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        for i, c in enumerate(commands)
    ]
    try:
        deadline = time.monotonic() + 600
        while not routable(url):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{setup} {quant} never became routable (logs in {logs})")
            time.sleep(0.5)
        yield url
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=60)


def routable(url: str) -> bool:
    try:
        return bool(httpx.get(f"{url}/v1/coverage", timeout=2).json()["models"][0]["routable"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return False


def one_request(url: str, topic: str, tokens: int) -> tuple[float, float, int]:
    """(time to first token s, total s, tokens) of one streamed greedy chat answer."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": f"Write a long story about {topic}."}],
        "temperature": 0,
        "max_tokens": tokens,
        "stream": True,
    }
    started, first, count = time.perf_counter(), 0.0, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if any(c["delta"].get("content") for c in event["choices"]):
                    count += 1
                    first = first or time.perf_counter() - started
    return first, time.perf_counter() - started, count


def level(url: str, n: int, tokens: int) -> dict[str, float]:
    """N requests at once: aggregate tok/s, median per-request tok/s, TTFT p50/p95 (s)."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=n) as pool:
        results = list(pool.map(lambda t: one_request(url, t, tokens), TOPICS[:n]))
    wall = time.perf_counter() - started
    ttfts = sorted(r[0] for r in results)
    return {
        "aggregate": sum(r[2] for r in results) / wall,
        "per_request": statistics.median(r[2] / r[1] for r in results),
        "ttft_p50": statistics.median(ttfts),
        "ttft_p95": ttfts[min(len(ttfts) - 1, math.ceil(0.95 * len(ttfts)) - 1)],
    }


def measure(url: str, levels: list[int], tokens: int, repeats: int) -> dict[int, dict[str, float]]:
    one_request(url, "warming up", 4)
    out = {}
    for n in levels:
        rounds = [level(url, n, tokens) for _ in range(repeats)]
        out[n] = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    return out


LONG_PROMPT = " ".join(f"Write a long story about {topic}." for topic in TOPICS * 3)


def choices_request(url: str, n: int, tokens: int) -> None:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": LONG_PROMPT}],
        "temperature": 0,
        "max_tokens": tokens,
        "n": n,
        # n against separate requests, each prefilled: kept prefixes would spare the later
        # ones their prompt (ADR-0058, measured in benchmarks/prefix.py)
        "cache_prompt": False,
    }
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    if answer.status_code != 200 or len(answer.json()["choices"]) != n:
        raise RuntimeError(f"HTTP {answer.status_code}: {answer.text[:200]}")


def received_bytes(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
            if line.startswith("meshnet_bytes_received_total"):
                total += float(line.split()[-1])
    return total


def separately(url: str, n: int, tokens: int) -> None:
    with ThreadPoolExecutor(max_workers=n) as pool:
        list(pool.map(lambda _: choices_request(url, 1, tokens), range(n)))


def choices(url: str, n: int, tokens: int, repeats: int) -> dict[str, float]:
    """Seconds and bytes received for one request with `n` and for `n` requests at once."""
    nodes = httpx.get(f"{url}/v1/coverage", timeout=5).json()["nodes"]
    hops = [node["address"] for node in nodes if node["node_id"] != "tracker"]
    out: dict[str, list[float]] = {"one_s": [], "many_s": [], "one_b": [], "many_b": []}
    for _ in range(repeats):
        for key, send in (
            ("one", lambda: choices_request(url, n, tokens)),
            ("many", lambda: separately(url, n, tokens)),
        ):
            before, started = received_bytes(hops), time.perf_counter()
            send()
            out[f"{key}_s"].append(time.perf_counter() - started)
            out[f"{key}_b"].append(received_bytes(hops) - before)
    return {k: statistics.median(v) for k, v in out.items()}


def choices_table(rows: dict[str, dict[int, dict[str, float]]]) -> str:
    lines = [
        "| setup | answers | one request with n: s | n requests: s | x | one request: MB "
        "received | n requests: MB received |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, by_n in rows.items():
        for n, r in by_n.items():
            lines.append(
                f"| {name} | {n} | {r['one_s']:.2f} | {r['many_s']:.2f} "
                f"| {r['many_s'] / r['one_s']:.2f} | {r['one_b'] / 1e6:.2f} "
                f"| {r['many_b'] / 1e6:.2f} |"
            )
    return "\n".join(lines)


def table(rows: dict[str, dict[int, dict[str, float]]]) -> str:
    lines = [
        "| setup | at once | aggregate tok/s | x one | per request tok/s | TTFT p50 s "
        "| TTFT p95 s | p95 x one |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, by_level in rows.items():
        alone = by_level[min(by_level)]
        for n, r in by_level.items():
            lines.append(
                f"| {name} | {n} | {r['aggregate']:.1f} "
                f"| {r['aggregate'] / alone['aggregate']:.2f} "
                f"| {r['per_request']:.1f} | {r['ttft_p50']:.2f} | {r['ttft_p95']:.2f} "
                f"| {r['ttft_p95'] / alone['ttft_p95']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="3hop fp32, 1 and 2 at once")
    parser.add_argument("--setups", nargs="+", default=["3hop", "1node"], choices=list(SPANS))
    parser.add_argument("--quants", nargs="+", default=["fp32", "bf16", "int8"])
    parser.add_argument("--levels", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--choices", nargs="*", type=int, default=[4], help="n per request")
    parser.add_argument("--extra", action="append", default=[], help="flags for every process")
    args = parser.parse_args()
    setups, quants, levels, tokens = args.setups, args.quants, args.levels, args.tokens
    answers = args.choices
    if args.tiny:
        setups, quants, levels, tokens, answers = ["3hop"], ["fp32"], [1, 2], 8, [2]
    rows: dict[str, dict[int, dict[str, float]]] = {}
    shared: dict[str, dict[int, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="meshnet-concurrency-") as logs:
        for setup in setups:
            for quant in quants:
                name = f"{setup} {quant}"
                with mesh(setup, quant, args.extra, Path(logs)) as url:
                    rows[name] = measure(url, levels, tokens, args.repeats)
                    shared[name] = {n: choices(url, n, tokens, args.repeats) for n in answers}
    print(table(rows))
    if answers:
        print()
        print(choices_table(shared))


if __name__ == "__main__":
    main()
