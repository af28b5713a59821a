"""`meshnet demo`: the README's first command, a real mesh on this machine.

It starts a tracker that is also the entry node (layers 0:10, the head and the API) and two
more nodes as separate processes on loopback, with budgets that hold ten fp32 layers each,
so the tracker's planner must split the default model's 30 layers three ways. It shows the
coverage filling in, sends one chat request through the HTTP API, prints the answer, the
route and the speed, then stops every process it started, on Ctrl-C too.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from meshnet.models.sizing import layer_bytes
from meshnet.models.source import resolve
from meshnet.observe.progress import progress
from meshnet.security.keys import create_key_file
from meshnet.terminal import ApiError, events

QUESTION = "What is the capital of France?"
ENTRY_LAYERS = 10
KV_RESERVE = 0.1  # NodeConfig.kv_reserve_fraction


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(name: str, args: list[str], workdir: Path) -> Child:
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    print(f"started {name} (pid {process.pid})", flush=True)
    return Child(name, process, log)


def stop_all(children: list[Child], timeout_s: float = 15.0) -> None:
    """SIGTERM each child (nodes leave the tracker), then SIGKILL whatever is still alive."""
    for child in children:
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()
    print(f"stopped {len(children)} processes", flush=True)


def launch(workdir: Path) -> tuple[str, list[Child]]:
    """The tracker-as-entry-node and two nodes; the tracker's URL."""
    spec = resolve("default").spec
    budget = math.floor((ENTRY_LAYERS + 0.5) * layer_bytes(spec, "fp32") / (1 - KV_RESERVE))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    key_file = workdir / "swarm.key"
    create_key_file(key_file)  # every member call is signed with it (ADR-0017)
    print(f"swarm key: {key_file} (mode 0600); only processes holding it can join", flush=True)
    keyed = ["--swarm-key-file", str(key_file)]
    children = [
        start(
            "tracker",
            ["tracker", "--port", str(port), "--layers", f"0:{ENTRY_LAYERS}", "--quant", "fp32"]
            + ["--data-dir", str(workdir / "tracker"), *keyed],
            workdir,
        )
    ]
    for name in ("node-a", "node-b"):
        args = ["node", "--tracker", url, "--port", str(free_port()), "--budget", str(budget)]
        args += ["--quant", "fp32", "--data-dir", str(workdir / name), *keyed]
        children.append(start(name, args, workdir))
    return url, children


def wait_for_coverage(url: str, children: list[Child], timeout_s: float = 300.0) -> None:
    """Show coverage as it fills in (a bar on a terminal, else a line per change); return
    once a full route exists."""
    live = sys.stdout.isatty()
    layers = resolve("default").spec.num_layers
    with progress("layers served", layers, live=live, out=sys.stdout) as bar:
        line = poll_coverage(url, children, timeout_s, bar.update, echo=not live)
    if live:
        print(line, flush=True)  # the final state, below the finished bar


def poll_coverage(
    url: str, children: list[Child], timeout_s: float, served: Callable[[int], None], echo: bool
) -> str:
    """Poll until a full route exists (its coverage line) or a child dies (RuntimeError)."""
    deadline, last = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        for child in children:
            if child.process.poll() is not None:
                tail = child.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{child.name} exited early; its log ends:\n{tail}")
        line, count, ready = coverage_line(url)
        served(count)
        if line != last and echo:
            print(line, flush=True)
        last = line
        if ready:
            return line
        time.sleep(0.5)
    raise RuntimeError(f"coverage incomplete after {timeout_s:.0f} s")


def coverage_line(url: str) -> tuple[str, int, bool]:
    """A line on the coverage, the layers served, and whether a full route exists."""
    try:
        body = httpx.get(f"{url}/v1/coverage", timeout=2.0).json()
    except (httpx.HTTPError, ValueError):
        return "waiting for the tracker to load its layers and start...", 0, False
    model = body["models"][0]
    bar = "".join(
        "#" if layer["serving"] else ("+" if layer["loading"] else ".") for layer in model["layers"]
    )
    served = bar.count("#")
    text = (
        f"coverage [{bar}] {served}/{model['num_layers']} layers served "
        f"({bar.count('+')} loading, {len(body['nodes'])} nodes)"
    )
    return text, served, bool(model["routable"])


def ask(url: str, max_tokens: int) -> dict[str, Any]:
    """Stream the answer to QUESTION to stdout; the final event (usage, route)."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
    }
    print(f"\nQ: {QUESTION}\nA: ", end="", flush=True)
    final: dict[str, Any] = {}
    started = time.perf_counter()
    with httpx.Client(base_url=url, timeout=300.0) as client:
        for event in events(client, "/v1/chat/completions", body):
            for choice in event["choices"]:
                print(choice["delta"].get("content", ""), end="", flush=True)
            final = event if "usage" in event else final
    final["wall_s"] = time.perf_counter() - started
    print()
    return final


def report(final: dict[str, Any]) -> None:
    mesh = final["meshnet"]
    print("route:")
    for hop in mesh["route"]:
        where = "the tracker's own process" if hop["address"] == "local" else hop["address"]
        print(f"  layers {hop['span']:>6}  {hop['node_id']}  ({where})")
    tokens = final["usage"]["completion_tokens"]
    print(
        f"{tokens} tokens; first token after {mesh['time_to_first_token_s']:.2f} s; "
        f"decode {mesh['decode_tokens_per_s']:.1f} tokens/s; "
        f"{tokens / final['wall_s']:.1f} tokens/s over the whole request"
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(max_tokens: int = 32, keep_running: bool = False) -> int:
    # Ctrl-C and SIGTERM both stop the mesh, even where a parent started us with SIGINT
    # ignored (background jobs of a non-interactive shell are).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    print("meshnet demo: the default model split across 3 processes on this machine", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="meshnet-demo-"))
    children: list[Child] = []
    try:
        url, children = launch(workdir)
        print(f"tracker and API: {url}", flush=True)
        print(f"dashboard: {url}/ (open it in a browser while the demo runs)", flush=True)
        wait_for_coverage(url, children)
        report(ask(url, max_tokens))
        if keep_running:
            print(f"\nthe mesh keeps running: dashboard {url}/ , `meshnet status --tracker {url}`,")
            print(f"`meshnet chat --tracker {url}`; Ctrl-C stops it", flush=True)
            signal.pause()
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the mesh", flush=True)
        return 130
    except (RuntimeError, ApiError, httpx.HTTPError, json.JSONDecodeError) as exc:
        print(f"\ndemo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_all(children)
        shutil.rmtree(workdir, ignore_errors=True)
