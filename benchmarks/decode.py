"""Decode and prefill speed on one machine: transformers, one meshnet node (fast path on and
off), the 3-hop mesh, and llama.cpp on the same GGUF file.

    python benchmarks/decode.py                                   # fp32, bf16 and int8
    python benchmarks/decode.py --llama-python /tmp/llama/bin/python   # adds llama.cpp
    python benchmarks/decode.py --quant gguf --llama-bin /path/llama.cpp/build/bin
        # ggml rows beside llama.cpp built from source: one process (llama-bench) and RPC
        # (llama-bench --rpc and two ggml-rpc-server processes on this machine), 2 threads
    python benchmarks/decode.py --tiny                            # what the tests run
    python benchmarks/decode.py --device cuda --quant bf16        # the CUDA rows (a GPU)

Decode: greedy tokens after a 38-token English prompt; tokens/s = N / (t(N+1) - t(1)), so
prefill and request overheads cancel (the node's own generator reports the same directly).
Prefill: a 501-token prompt, tokens / time to first token. One node: an entry node holding
all 30 layers and the head, in this process (what `meshnet node --entry` runs, without its
HTTP API). 3-hop mesh: a tracker-as-entry-node (0:10) and two nodes, separate processes on
loopback, asked through the API. llama.cpp: `llama-cpp-python` (not a dependency of ours;
install it in another venv and pass its python), 2 threads; or its binaries (`--llama-bin`:
llama-bench's own tg/pp figures). Medians of `--repeats`; every ratio is to the first row.
Resident memory: the peak (VmHWM) of each process of a row that runs in processes of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshnet.assemble.entry import load_entry_model, make_generator
from meshnet.config import EntryConfig, NodeConfig, WireConfig, WireLimits
from meshnet.entry.generation import Generator
from meshnet.entry.routes import StaticRoutes
from meshnet.entry.transport import HttpTransport
from meshnet.models.device import resolve_device
from meshnet.models.loader import load_tokenizer
from meshnet.models.source import default_gguf, resolve
from meshnet.node.app import NodeService
from meshnet.node.compute import compute_executor, pin_loop_thread
from meshnet.text.events import Finished
from meshnet.text.params import GenerationParams, SamplingParams
from meshnet.types import LayerSpan
from pipeline import DATA, free_port, median_s, wait_routable  # benchmarks/pipeline.py

Row = dict[str, Any]  # tok/s figures, and `rss_mib`: each process's peak
MiB = 1 << 20
LLAMA = """
import json, sys, time, statistics
from llama_cpp import Llama
path, short, long = sys.argv[1:4]
tokens, repeats = int(sys.argv[4]), int(sys.argv[5])
model = Llama(model_path=path, n_threads=2, n_ctx=2048, verbose=False, seed=0)
def run(text, new):
    model.reset()  # no prompt reuse between calls: every call evaluates its prompt
    t = time.perf_counter()
    model.create_completion(text, max_tokens=new, temperature=0.0, top_k=1)
    return time.perf_counter() - t
run(short, 2)
med = lambda f: statistics.median([f() for _ in range(repeats)])
first, full = med(lambda: run(short, 1)), med(lambda: run(short, tokens + 1))
long_first, long_tokens = med(lambda: run(long, 1)), len(model.tokenize(long.encode()))
speeds = {"decode_tok_s": tokens / (full - first), "prefill_tok_s": long_tokens / long_first}
print(json.dumps(speeds))
"""


def prompts(tokenizer: Any, short: int, long: int) -> tuple[list[int], list[int]]:
    ids = tokenizer.encode(DATA.read_text(), add_special_tokens=False)
    return ids[:short], ids[:long]


COMPUTE = compute_executor()  # every row's model work runs here (see node/compute.py)


def on_compute(fn: Callable[..., Row], *args: Any) -> Row:
    return COMPUTE.submit(fn, *args).result()


def transformers_row(
    quant: str, short: list[int], long: list[int], n: int, r: int, device: str = "cpu"
) -> Row:
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if quant == "fp32" else torch.bfloat16
    path = default_gguf()
    model = (
        AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        .eval()
        .to(device)
    )

    def run(ids: list[int], new: int) -> None:
        with torch.inference_mode():
            model.generate(
                torch.tensor([ids], device=device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
            )

    return timed(run, short, long, n, r)


def timed(
    run: Callable[[list[int], int], None], short: list[int], long: list[int], n: int, r: int
) -> Row:
    run(short, 2)  # warm-up
    first = median_s(lambda: run(short, 1), r)
    full = median_s(lambda: run(short, n + 1), r)
    return {
        "decode_tok_s": n / (full - first),
        "prefill_tok_s": len(long) / median_s(lambda: run(long, 1), r),
    }


def node_row(
    quant: str, fast: bool, short: list[int], long: list[int], n: int, r: int, device: str = "cpu"
) -> Row:
    """An entry node holding every layer on `device`, through its generator (no remote hop)."""
    config = NodeConfig(quant=quant, fast_path=fast, device=device)
    span = LayerSpan(0, resolve("default").spec.num_layers)
    model = load_entry_model(config, "default", "default", span)
    service = NodeService([model.runner], WireLimits(), WireConfig(), node_id="bench")
    service.scheduler.worker = COMPUTE
    generator = make_generator(model, service, StaticRoutes([]), HttpTransport(), EntryConfig())

    def run(ids: list[int], new: int) -> None:
        asyncio.run(generate(generator, ids, new))

    return timed(run, short, long, n, r)


async def generate(generator: Generator, ids: list[int], new: int) -> Finished:
    greedy = GenerationParams(max_tokens=new, sampling=SamplingParams(temperature=0.0))
    end = None
    async for event in generator.stream(ids, greedy):
        end = event if isinstance(event, Finished) else end
    assert end is not None
    return end


def mesh_row(quant: str, short: list[int], long: list[int], n: int, r: int, logs: Path) -> Row:
    """Tracker-as-entry-node (0:10) and two nodes; greedy completions through the API."""
    import httpx

    from meshnet.models.sizing import file_layer_bytes, layer_bytes

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    source = resolve("default")
    per_layer = (
        file_layer_bytes(source.path) if quant == "gguf" else layer_bytes(source.spec, quant)
    )
    budget = int(10.5 * per_layer / 0.9)
    commands = [["tracker", "--port", str(port), "--layers", "0:10"]] + [
        ["node", "--tracker", url, "--port", str(free_port()), "--budget", str(budget)]
        + ["--no-entry"]  # spans alone: with gguf, a node that never loads torch (ADR-0052)
        for _ in range(2)
    ]
    env = {"MESHNET_SWARM_KEY": "b" * 64, "PATH": "/usr/bin:/bin"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "meshnet.cli",
                *c,
                "--quant",
                quant,
                "--data-dir",
                str(logs / f"{quant}{i}"),
            ],
            stdout=(logs / f"{quant}-{i}.log").open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        for i, c in enumerate(commands)
    ]
    try:
        wait_routable(url, 3)
        client = httpx.Client(base_url=url, timeout=600)

        def run(ids: list[int], new: int) -> None:
            body = {
                "model": "default",
                "prompt": ids_text[tuple(ids)],
                "max_tokens": new,
                "temperature": 0,
            }
            client.post("/v1/completions", json=body).raise_for_status()

        tokenizer = load_tokenizer(resolve("default"))
        ids_text = {tuple(p): tokenizer.decode(p) for p in (short, long)}
        row = timed(run, short, long, n, r)
        rss = [peak_rss_mib(p.pid) for p in procs]
        kv = 10 * kv_bytes_per_layer_token(source.spec) * (len(long) + n)
        bound = 1.2 * 10 * per_layer + kv + 100 * MiB  # #46's target for each node's 10 layers
        return {**row, "rss_mib": rss, "node_bound_mib": round(bound / MiB)}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


def llama_row(
    python: str, tokenizer: Any, short: list[int], long: list[int], n: int, r: int
) -> Row:
    args = [str(default_gguf()), tokenizer.decode(short), tokenizer.decode(long), str(n), str(r)]
    out = subprocess.run([python, "-c", LLAMA, *args], capture_output=True, text=True, check=True)
    row: Row = json.loads(out.stdout.strip().splitlines()[-1])
    return row


def peak_rss_mib(pid: int) -> int:
    """A live process's peak resident memory (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    return 0


def llama_bench_row(folder: Path, short: int, long: int, n: int, r: int, rpc: bool) -> Row:
    """llama.cpp's own figures (`llama-bench -t 2`): tg of `n` after nothing, pp of `long`;
    with `rpc`, every layer on two `ggml-rpc-server` processes of this machine (2 threads
    each). Peak memory of each process: the bench, then the servers."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(folder)}
    servers, ports = [], [free_port(), free_port()]
    if rpc:
        for port in ports:
            args = [str(folder / "ggml-rpc-server"), "-p", str(port), "-t", "2"]
            servers.append(subprocess.Popen(args, env=env, stderr=subprocess.DEVNULL))
        time.sleep(1.0)
    args = [str(folder / "llama-bench"), "-m", str(default_gguf()), "-t", "2", "-o", "json"]
    args += ["-p", str(long), "-n", str(n), "-r", str(r)]
    args += ["--rpc", ",".join(f"127.0.0.1:{p}" for p in ports)] if rpc else []
    try:
        bench = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        out = bench.stdout.read() if bench.stdout else b""
        _, _, usage = os.wait4(bench.pid, 0)
        results = json.loads(out)
        rss = [usage.ru_maxrss // 1024] + [peak_rss_mib(s.pid) for s in servers]
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=30)
    speed = {(x["n_prompt"], x["n_gen"]): x["avg_ts"] for x in results}
    return {"decode_tok_s": speed[(0, n)], "prefill_tok_s": speed[(long, 0)], "rss_mib": rss}


def kv_bytes_per_layer_token(spec: Any) -> int:
    """A layer's F16 keys and values for one token (what a ggml node's cache holds)."""
    return 2 * spec.num_kv_heads * spec.head_dim * 2


def memory_lines(rows: dict[str, Row]) -> list[str]:
    """Each 3-hop row's nodes against their bound: 1.2x their layers' file bytes, their KV
    cache at the longest prompt, and 100 MiB."""
    lines = []
    for name, row in rows.items():
        if "node_bound_mib" in row:
            nodes = ", ".join(f"{m} MiB" for m in row["rss_mib"][1:])
            lines.append(f"{name}: nodes' peak RSS {nodes}; bound {row['node_bound_mib']} MiB")
    return lines


def table(rows: dict[str, Row], base: str) -> str:
    ref = rows[base]
    lines = [
        f"| setup | decode tok/s | x {base} | prefill tok/s | x {base} | peak RSS MiB |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        rss = " + ".join(str(m) for m in row.get("rss_mib", [])) or "(in this process)"
        lines.append(
            f"| {name} | {row['decode_tok_s']:.1f} "
            f"| {row['decode_tok_s'] / ref['decode_tok_s']:.2f} "
            f"| {row['prefill_tok_s']:.0f} | {row['prefill_tok_s'] / ref['prefill_tok_s']:.2f} "
            f"| {rss} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tiny", action="store_true", help="fp32 and gguf, 4 tokens, in-process rows only"
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-python", help="a python with llama-cpp-python installed")
    parser.add_argument(
        "--quant", action="append", choices=["fp32", "bf16", "int8", "nf4", "q4", "gguf"]
    )
    parser.add_argument("--llama-bin", type=Path, help="llama.cpp's build/bin (llama-bench)")
    parser.add_argument(
        "--device", default="cpu", help="cpu, cuda or cuda:N: where the 1-node rows run"
    )
    args = parser.parse_args()
    device = resolve_device(args.device)
    on = "" if device == "cpu" else f", {device}"
    pin_loop_thread()
    random.seed(0)
    tokenizer = load_tokenizer(resolve("default"))
    short, long = prompts(tokenizer, 38, 501)
    n, r = (4, 1) if args.tiny else (args.tokens, args.repeats)
    if args.tiny:
        short, long = short[:16], long[:32]
    rows: dict[str, Row] = {}
    if args.llama_bin and not args.tiny:
        for rpc in (False, True):
            name = "llama.cpp RPC, host + 2 rpc servers" if rpc else "llama.cpp, 1 process"
            rows[name] = llama_bench_row(args.llama_bin, len(short), len(long), n, r, rpc)
    if args.llama_python and not args.tiny:
        rows["llama.cpp Q4_1, 2 threads"] = llama_row(
            args.llama_python, tokenizer, short, long, n, r
        )
    for quant in args.quant or (
        ["fp32", "gguf"] if args.tiny else ["fp32", "bf16", "int8", "gguf"]
    ):
        if quant in ("fp32", "bf16"):  # transformers has no int8/nf4 of its own to compare with
            rows[f"transformers generate, {quant}{on}"] = on_compute(
                transformers_row, quant, short, long, n, r, device
            )
        for fast in (True,) if quant == "gguf" else (True, False):  # ggml has no slow path
            name = f"meshnet 1 node, {quant}{on}, fast path {'on' if fast else 'off'}"
            name = f"meshnet 1 node, gguf on ggml{on}" if quant == "gguf" else name
            rows[name] = node_row(quant, fast, short, long, n, r, device)
        if not args.tiny and device == "cpu":
            with tempfile.TemporaryDirectory(prefix="meshnet-decode-") as logs:
                rows[f"meshnet 3-hop mesh, {quant}"] = mesh_row(
                    quant, short, long, n, r, Path(logs)
                )
    base = next(iter(rows))
    print(f"greedy, {n} tokens after {len(short)}; prefill of {len(long)}; medians of {r}\n")
    print(table(rows, base))
    print("\n".join(memory_lines(rows)))


if __name__ == "__main__":
    main()
