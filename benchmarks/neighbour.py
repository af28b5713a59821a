"""One node's decode and prefill with busy neighbours: processes we do not control that
busy-loop on the same cores (issue 47, ADR-0053).

    python benchmarks/neighbour.py                 # ggml and torch, threads 1, 2 and auto
    python benchmarks/neighbour.py --tiny          # what the tests run

Each cell is its own process (OpenMP reads its wait policy once, at load): an entry node
holding all 30 layers of the default model and its head, driven through its generator (no
HTTP), with 0, 1 or 2 `while True: pass` processes beside it. Threads: `1` and `2` pinned
(`--threads N`), `auto` following the free cores (the default). OpenMP wait policies: our
default (`GOMP_SPINCOUNT=30000`, what `meshnet` sets) and `OMP_WAIT_POLICY=passive`. Decode:
tokens/s of greedy tokens after a 38-token prompt, N / (t(N+1) - t(1)) after a warm-up that
lets `auto` settle; prefill: a 501-token prompt over its time to first token. Medians of
`--repeats`; ratios are to the same row's idle column.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

BUSY = "while True: pass"
POLICIES = {
    "spin 30000 (default)": {"GOMP_SPINCOUNT": "30000"},
    "passive": {"OMP_WAIT_POLICY": "passive"},
}


def cell(backend: str, threads: str, tokens: int, repeats: int, tiny: bool) -> dict[str, Any]:
    """This process: one node's figures (run with the neighbours already busy)."""
    from decode import COMPUTE, generate, median_s, prompts
    from meshnet.assemble.entry import load_entry_model, make_generator
    from meshnet.config import EntryConfig, NodeConfig, WireConfig, WireLimits
    from meshnet.entry.routes import StaticRoutes
    from meshnet.entry.transport import HttpTransport
    from meshnet.models.loader import load_tokenizer
    from meshnet.models.source import resolve
    from meshnet.node.app import NodeService
    from meshnet.node.compute import compute_threads, pin_loop_thread
    from meshnet.node.threads import ComputeThreads
    from meshnet.types import LayerSpan

    pin_loop_thread()
    pinned = None if threads == "auto" else int(threads)
    config = NodeConfig(backend=backend, threads=pinned)  # type: ignore[arg-type]
    model = load_entry_model(config, "default", "default", LayerSpan(0, 30))
    chosen = ComputeThreads(compute_threads(), pinned)
    service = NodeService([model.runner], WireLimits(), WireConfig(), threads=chosen)
    service.scheduler.worker = COMPUTE
    generator = make_generator(model, service, StaticRoutes([]), HttpTransport(), EntryConfig())
    short, long = prompts(load_tokenizer(resolve("default")), 38, 64 if tiny else 501)
    run = lambda ids, new: asyncio.run(generate(generator, ids, new))  # noqa: E731
    run(short, 4 if tiny else 96)  # warm-up, long enough for `auto` to settle
    first = median_s(lambda: run(short, 1), repeats)
    full = median_s(lambda: run(short, tokens + 1), repeats)
    prefill = median_s(lambda: run(long, 1), repeats)
    return {
        "decode_tok_s": tokens / (full - first),
        "prefill_tok_s": len(long) / prefill,
        "threads": chosen.threads,
    }


def measure(
    backend: str, threads: str, policy: str, neighbours: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One cell in a process of its own, with `neighbours` busy loops running meanwhile."""
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(neighbours)]
    try:
        time.sleep(0.2)
        command = [sys.executable, __file__, "--cell", backend, threads]
        command += ["--tokens", str(args.tokens), "--repeats", str(args.repeats)]
        command += ["--tiny"] if args.tiny else []
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
        out = subprocess.run(
            command, env=env | POLICIES[policy], capture_output=True, text=True, check=True
        )
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        for process in busy:
            process.kill()
            process.wait()


def table(rows: dict[str, list[dict[str, Any]]], levels: list[int]) -> str:
    head = " | ".join(f"{n} busy: decode (x idle) / prefill [threads]" for n in levels)
    lines = [f"| setup | {head} |", "|---|" + "---|" * len(levels)]
    for name, cells in rows.items():
        idle = cells[0]["decode_tok_s"]
        parts = [
            f"{c['decode_tok_s']:.1f} ({c['decode_tok_s'] / idle:.2f}) / "
            f"{c['prefill_tok_s']:.0f} [{c['threads']}]"
            for c in cells
        ]
        lines.append(f"| {name} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="ggml, auto, 0 and 1 busy, 16 tokens")
    parser.add_argument("--backends", nargs="+", default=["ggml", "torch"])
    parser.add_argument("--threads", nargs="+", default=["1", "2", "auto"])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--levels", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cell", nargs=2, metavar=("BACKEND", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(cell(*args.cell, args.tokens, args.repeats, args.tiny)))
        return
    if args.tiny:
        args.backends, args.threads, args.policies = ["ggml"], ["auto"], [next(iter(POLICIES))]
        # 16 tokens: with 4, decode (full - first prefill) was under the noise of a loaded
        # suite and came out negative once (-94.1 tokens/s)
        args.levels, args.tokens, args.repeats = [0, 1], 16, 1
    rows = {}
    for backend in args.backends:
        for threads in args.threads:
            for policy in args.policies:
                name = f"{backend}, threads {threads}, {policy}"
                rows[name] = [measure(backend, threads, policy, n, args) for n in args.levels]
                print(table({name: rows[name]}, args.levels).splitlines()[-1], flush=True)
    cpus, n, r = os.cpu_count(), args.tokens, args.repeats
    print(f"\n{cpus} CPUs; greedy {n} tokens after 38; medians of {r}\n")
    print(table(rows, args.levels))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
