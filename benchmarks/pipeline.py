"""The mesh against monolithic transformers on one machine: decode speed, first-token time.

    python benchmarks/pipeline.py          # 1, 2 and 3 hops; prompts of 16, 512, 2048 tokens
    python benchmarks/pipeline.py --tiny   # 1 hop, a 16-token prompt (what the tests run)

Monolithic: transformers `generate` on the default model at fp32 in this process. Mesh: a
tracker-as-entry-node plus 0, 1 or 2 nodes, each its own process on loopback, all at fp32,
asked through the HTTP API (`/v1/completions`, greedy). Time to first token is a request
with `max_tokens=1`; decode tokens/s is (t(N+1) - t(1)) / N for the same prompt, so prefill
and request overheads cancel. Per-hop overhead is (mesh - monolithic) ms per decoded token,
divided by the number of hops. Medians of `--repeats` runs; every ratio is mesh/monolithic.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch

from harness import free_port, median_s  # benchmarks/harness.py
from meshnet.models.loader import load_tokenizer
from meshnet.models.sizing import layer_bytes
from meshnet.models.source import default_gguf, resolve

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "english.txt"
SPLITS = {1: [30], 2: [15, 15], 3: [10, 10, 10]}  # layers per process, entry first


def monolithic(tokenizer: Any) -> Callable[[str, int], None]:
    """transformers `generate` on the default model at fp32, loaded and ready."""
    from transformers import AutoModelForCausalLM

    path = default_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()

    def generate(text: str, new: int) -> None:
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)

    return generate


def measure(
    generate: Callable[[str, int], None], prompts: dict[int, str], tokens: int, repeats: int
) -> dict[str, float]:
    generate(prompts[16], 2)  # warm-up
    out = {
        f"ttft_{n}": median_s(lambda t=text: generate(t, 1), repeats) for n, text in prompts.items()
    }
    longer = median_s(lambda: generate(prompts[16], tokens + 1), repeats)
    out["decode_tok_s"] = tokens / (longer - out["ttft_16"])
    return out


@contextmanager
def mesh(hops: int, logs: Path, meanwhile: Callable[[], None]) -> Iterator[str]:
    """A tracker-as-entry-node and `hops - 1` nodes at fp32; yields the API's URL."""
    spans = SPLITS[hops]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    per_layer = layer_bytes(resolve("default").spec, "fp32")
    commands = [["tracker", "--port", str(port), "--layers", f"0:{spans[0]}"]]
    for i, count in enumerate(spans[1:]):
        budget = math.floor((count + 0.5) * per_layer / 0.9)  # 10% KV reserve
        commands.append(["node", "--tracker", url, "--port", str(free_port())])
        commands[-1] += ["--budget", str(budget), "--data-dir", str(logs / f"n{hops}-{i}")]
    commands[0] += ["--data-dir", str(logs / f"t{hops}")]
    key = secrets.token_hex(32)  # members sign every call, as in a real mesh
    commands = [[*c, "--quant", "fp32"] for c in commands]
    with running(commands, logs, f"{hops}-", {"MESHNET_SWARM_KEY": key}):
        meanwhile()
        wait_routable(url, hops)
        yield url


@contextmanager
def running(
    commands: list[list[str]], logs: Path, prefix: str, env: dict[str, str]
) -> Iterator[None]:
    """`meshnet` processes, one per command (logs in `logs`), SIGTERMed on the way out."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli", *c],
            stdout=(logs / f"{prefix}{i}.log").open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )
        for i, c in enumerate(commands)
    ]
    try:
        yield
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)


def wait_routable(url: str, hops: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/coverage", timeout=2).json()["models"][0]["routable"]:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the {hops}-hop mesh never covered the model")


def mesh_run(url: str, prompts: dict[int, str], tokens: int, repeats: int) -> dict[str, float]:
    client = httpx.Client(base_url=url, timeout=600)

    def generate(text: str, new: int) -> None:
        body = {"model": "default", "prompt": text, "max_tokens": new, "temperature": 0}
        answer = client.post("/v1/completions", json=body).json()
        if answer["usage"]["completion_tokens"] != new:
            raise RuntimeError(f"stopped early at {answer['usage']['completion_tokens']} tokens")
        hops = len(answer["meshnet"]["route"])
        if hops != expected_hops:
            raise RuntimeError(f"route has {hops} hops")

    expected_hops = len(httpx.get(f"{url}/v1/coverage").json()["nodes"])
    return measure(generate, prompts, tokens, repeats)


def prompts_for(tokenizer: Any, lengths: list[int]) -> dict[int, str]:
    ids = tokenizer.encode(DATA.read_text(), add_special_tokens=False)
    return {n: str(tokenizer.decode(ids[:n])) for n in lengths}


def table(rows: dict[str, dict[str, float]], lengths: list[int]) -> str:
    mono = rows["monolithic"]
    mono_ms = 1000 / mono["decode_tok_s"]
    ttft_heads = " | ".join(f"TTFT {n} (s)" for n in lengths)
    lines = [
        f"| setup | decode tok/s | ratio | {ttft_heads} | TTFT ratios "
        "| per-hop overhead (ms/token) |",
        "|" + "---|" * (5 + len(lengths)),
    ]
    for name, row in rows.items():
        hops = int(name.split()[0]) if name[0].isdigit() else 0
        ttfts = " | ".join(f"{row[f'ttft_{n}']:.3f}" for n in lengths)
        ratios = " / ".join(f"{row[f'ttft_{n}'] / mono[f'ttft_{n}']:.2f}" for n in lengths)
        overhead = (1000 / row["decode_tok_s"] - mono_ms) / hops if hops else 0.0
        speed = row["decode_tok_s"]
        lines.append(
            f"| {name} | {speed:.1f} | {speed / mono['decode_tok_s']:.3f} "
            f"| {ttfts} | {ratios} | {overhead:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="1 hop, 16-token prompt, 4 tokens")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    lengths = [16] if args.tiny else [16, 512, 2048]
    tokens, repeats = (4, 1) if args.tiny else (args.tokens, args.repeats)
    rows: dict[str, dict[str, float]] = {}
    loaded: dict[str, Any] = {}

    def load_monolithic() -> None:  # while the first mesh starts (measured once both idle)
        if not loaded:
            tokenizer = load_tokenizer(resolve("default"))
            loaded["prompts"] = prompts_for(tokenizer, lengths)
            loaded["generate"] = monolithic(tokenizer)

    with tempfile.TemporaryDirectory(prefix="meshnet-bench-") as logs:
        for hops in [1] if args.tiny else [1, 2, 3]:
            with mesh(hops, Path(logs), load_monolithic) as url:
                prompts = loaded["prompts"]
                if "monolithic" not in rows:
                    rows["monolithic"] = measure(loaded["generate"], prompts, tokens, repeats)
                name = f"{hops} hop{'s' if hops > 1 else ''}"
                rows[name] = mesh_run(url, prompts, tokens, repeats)
    print(f"fp32, greedy, {tokens} decoded tokens, medians of {repeats}\n")
    print(table({"monolithic": rows.pop("monolithic"), **rows}, lengths))


if __name__ == "__main__":
    main()
