"""Joining without the model file: a span's weights over the mesh (issue 48, ADR-0054).

    python benchmarks/weights.py            # spans of 5, 10, 20 and 30 layers; 3 holders
    python benchmarks/weights.py --tiny     # what the tests run

The default model's GGUF file served by real HTTP servers (uvicorn in threads, swarm-key
signed answers, as the tracker and nodes serve it) to a `Fetcher` in this process, which
writes the span's parts into a fresh cache and checks each hash, as a joining node does.

1. Join time against span size, on loopback and through the delaying proxy
   (`tests/e2e/slowlink.py`) at `--mbit` Mbit/s and `--delay-ms` one-way: fetch time plus
   the local load of the fetched file, as a ratio to (span bytes / link rate) + the local
   load of the original file (the target: at most 1.2).
2. The tracker's share of the bytes when 3 other holders serve the span, each behind its
   own emulated link (target: at most a third).
3. Hashing on a local load: checking a span's parts against the manifest (the first load
   from a file; later loads of it hash nothing) against loading the span (target: at most
   10% added). Loads: ggml from a warm page cache and from a cold one (root drops the page
   cache between runs; hashing first reads the pages the load then finds in memory), and
   torch reading the span into bf16.

A local load: the ggml span made from the file and one token through it (which reads every
weight page). The page cache is warm: the file was just read. Medians of `--repeats`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.e2e.procs import free_port  # noqa: E402
from tests.e2e.slowlink import Link, LinkProxy  # noqa: E402

from meshnet.config import AccessConfig  # noqa: E402
from meshnet.http_errors import install_error_handlers  # noqa: E402
from meshnet.models.ggml_span import GgmlSpan  # noqa: E402
from meshnet.models.source import default_gguf  # noqa: E402
from meshnet.observe.metrics import Metrics  # noqa: E402
from meshnet.security.access import Credentials, Guard  # noqa: E402
from meshnet.security.signing import Signer  # noqa: E402
from meshnet.types import LayerSpan  # noqa: E402
from meshnet.weights.fetch import Fetcher, Holder  # noqa: E402
from meshnet.weights.manifest import Manifest, make_manifest  # noqa: E402
from meshnet.weights.serve import WeightServer, add_weight_routes, weight_rules  # noqa: E402
from meshnet.weights.store import WeightStore  # noqa: E402

KEY = "weights-benchmark-swarm-key-0123456789"


@contextlib.contextmanager
def holder(name: str, manifest: Manifest, root: Path) -> Iterator[int]:
    """A member called `name` serving the whole default file, in its own process (as the
    tracker or a node would); its port."""
    port = free_port()
    command = [sys.executable, __file__, "--serve", name, str(port), str(root / name)]
    process = subprocess.Popen(command)
    try:
        wait_listening(port)
        yield port
    finally:
        process.terminate()
        process.wait(10)


def wait_listening(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"no holder listening on port {port}")


def serve(name: str, port: int, root: Path) -> None:
    """This process: the holder `name` on `port`, until terminated."""
    store = WeightStore(root)
    store.offer_file(default_gguf(), store.manifest_of(default_gguf()))
    credentials = Credentials(AccessConfig(swarm_key=KEY), frozenset({name}))
    app = Starlette(middleware=[Middleware(Guard, rules=weight_rules(), credentials=credentials)])
    install_error_handlers(app)
    add_weight_routes(app, WeightServer(store))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error")


def local_load_s(path: Path, span: LayerSpan) -> float:
    """Seconds to make the ggml span from `path` and run one token through it."""
    started = time.perf_counter()
    layers = GgmlSpan(path, span, threads=2)
    layers.forward(np.zeros((1, layers.config.hidden_size), np.float32), layers.new_cache(), 0)
    elapsed = time.perf_counter() - started
    layers.close()
    return elapsed


def fetch(
    manifest: Manifest, span: LayerSpan, holders: list[Holder], metrics: Metrics | None = None
) -> tuple[float, Path]:
    """Seconds to fetch `span`'s parts into a fresh cache (and the cache's file)."""
    root = Path(tempfile.mkdtemp(prefix="meshnet-weights-"))
    fetcher = Fetcher(WeightStore(root), holders, signer=Signer(KEY), metrics=metrics)
    started = time.perf_counter()
    held = asyncio.run(fetcher.fetch(manifest.digest, lambda m: m.span_parts(span, entry=False)))
    return time.perf_counter() - started, held.path


def median(run: Callable[[], float], repeats: int) -> float:
    return statistics.median(run() for _ in range(repeats))


def span_bytes(manifest: Manifest, span: LayerSpan) -> int:
    return sum(p.nbytes for p in manifest.span_parts(span, entry=False))


def join_table(manifest: Manifest, spans: list[LayerSpan], link: Link, repeats: int) -> str:
    rows = [
        "| span | MB | local load s | loopback fetch s | loopback join / local load |"
        f" {link.rate_bps / 1e6:g} Mbit/s fetch s | join s | ideal s | join / ideal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as root, holder("tracker", manifest, Path(root)) as port:
        proxy = LinkProxy(port, link)
        for span in spans:
            nbytes = span_bytes(manifest, span)
            local = median(lambda s=span: local_load_s(default_gguf(), s), repeats)
            loop_s = median(lambda s=span: fetch(manifest, s, [direct(port)])[0], repeats)
            slow = [fetch(manifest, span, [direct(proxy.port)]) for _ in range(repeats)]
            slow_s = statistics.median(s for s, _ in slow)
            cached = median(lambda s=span, p=slow[0][1]: local_load_s(p, s), repeats)
            ideal = nbytes * 8 / link.rate_bps + local
            rows.append(
                f"| {span} | {nbytes / 1e6:.1f} | {local:.3f} | {loop_s:.3f} |"
                f" {(loop_s + cached) / local:.1f} | {slow_s:.2f} | {slow_s + cached:.2f} |"
                f" {ideal:.2f} | {(slow_s + cached) / ideal:.2f} |"
            )
    return "\n".join(rows)


def direct(port: int) -> Holder:
    return Holder("tracker", f"http://127.0.0.1:{port}")


def share_table(manifest: Manifest, span: LayerSpan, link: Link, others: int) -> str:
    """Who served the bytes of one fetch when `others` holders and the tracker have them."""
    names = [f"node-{i}" for i in range(others)] + ["tracker"]
    metrics = Metrics()
    with tempfile.TemporaryDirectory() as root, contextlib.ExitStack() as stack:
        ports = [stack.enter_context(holder(n, manifest, Path(root))) for n in names]
        proxies = [LinkProxy(p, Link(link.delay_s, link.rate_bps, shared=True)) for p in ports]
        holders = [
            Holder(n, f"http://127.0.0.1:{p.port}") for n, p in zip(names, proxies, strict=True)
        ]
        seconds, _ = fetch(manifest, span, holders, metrics)
    served = {n: metrics.weights_fetched.labels(peer=n)._value.get() for n in names}
    total = sum(served.values())
    rows = ["| holder | MB served | share |", "|---|---|---|"]
    rows += [f"| {n} | {b / 1e6:.1f} | {b / total:.2f} |" for n, b in served.items()]
    rows.append(f"| all ({seconds:.2f} s) | {total / 1e6:.1f} | 1.00 |")
    return "\n".join(rows)


def hashing_table(manifest: Manifest, spans: list[LayerSpan], repeats: int) -> str:
    rows = [
        "| span | ggml load s | hashing s | added | cold ggml load s | cold hashing + load s |"
        " added | torch bf16 load s | added |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for span in spans:
        parts = manifest.span_parts(span, entry=False)
        warm = median(lambda s=span: local_load_s(default_gguf(), s), repeats)
        hashing = median(lambda p=parts: check_s(manifest, p), repeats)
        cold, cold_checked = cold_loads(manifest, span, repeats)
        torch_s = median(lambda s=span: torch_load_s(s), repeats)
        rows.append(
            f"| {span} | {warm:.3f} | {hashing:.3f} | {hashing / warm:.0%} | {cold:.3f} |"
            f" {cold_checked:.3f} | {cold_checked / cold - 1:.0%} | {torch_s:.2f} |"
            f" {hashing / torch_s:.0%} |"
        )
    return "\n".join(rows)


def cold_loads(manifest: Manifest, span: LayerSpan, repeats: int) -> tuple[float, float]:
    """A ggml load from a cold page cache, and hashing then loading from one (root only:
    NaN elsewhere). Hashing reads the pages the load then finds in memory."""
    if not drop_page_cache():
        return float("nan"), float("nan")
    parts = manifest.span_parts(span, entry=False)
    cold = median(lambda: drop_page_cache() and local_load_s(default_gguf(), span), repeats)
    both = median(
        lambda: drop_page_cache() and check_s(manifest, parts) + local_load_s(default_gguf(), span),
        repeats,
    )
    return cold, both


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def torch_load_s(span: LayerSpan) -> float:
    """Seconds for torch to read and convert the span to bf16 (it reads every byte)."""
    import torch

    from meshnet.models.loader import load_shard
    from meshnet.models.source import resolve

    started = time.perf_counter()
    load_shard(
        resolve("default"), span, "bf16", fast=True, compile=False, device=torch.device("cpu")
    )
    return time.perf_counter() - started


def check_s(manifest: Manifest, parts: list) -> float:  # type: ignore[type-arg]
    """Seconds to check `parts` of the default file the first time (a fresh record)."""
    with tempfile.TemporaryDirectory() as root:
        started = time.perf_counter()
        WeightStore(Path(root)).check_local(default_gguf(), manifest, parts)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="spans of 2 and 5 layers, once")
    parser.add_argument("--mbit", type=float, default=100.0, help="the emulated link's rate")
    parser.add_argument("--delay-ms", type=float, default=10.0, help="its one-way delay")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve", nargs=3, metavar=("NAME", "PORT", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]), Path(args.serve[2]))
        return
    sizes = [2, 5] if args.tiny else [5, 10, 20, 30]
    spans = [LayerSpan(0, n) for n in sizes]
    repeats = 1 if args.tiny else args.repeats
    link = Link(args.delay_ms / 1000, args.mbit * 1e6, shared=True)
    manifest = make_manifest(default_gguf())
    print(
        f"default model ({manifest.file_bytes / 1e6:.0f} MB), link {args.mbit:g} Mbit/s, "
        f"{args.delay_ms:g} ms one way; medians of {repeats}\n"
    )
    print("join time against span size\n")
    print(join_table(manifest, spans, link, repeats))
    print("\nthe tracker's share with 3 other holders (each on its own link)\n")
    print(share_table(manifest, spans[-1], link, 3))
    print("\nhashing on a local load (first load of a file; later ones hash nothing)\n")
    print(hashing_table(manifest, spans, repeats))


if __name__ == "__main__":
    main()
