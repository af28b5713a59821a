"""Wire-format throughput and compression: encode/decode MB/s and ratio per encoding.

    python benchmarks/wire.py            # real hidden states of the default model
    python benchmarks/wire.py --tiny     # seconds; what the test suite runs

MB/s counts raw bf16 bytes (1 MB = 10^6 bytes) on one core. The ceiling is a plain `bytes`
copy of the same size. Medians over `--repeat` runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshnet.config import WireConfig
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import FrameMeta, decode, encode, tensor_bytes
from meshnet.wire.frame import payload_bits
from meshnet.wire.tensors import bits_tensor

ENCODINGS = ["none", "zstd", "zstd-shuffle"]
META = FrameMeta(SessionId("bench"), ModelId("default"), LayerSpan(0, 10), 0)


@dataclass(frozen=True)
class Row:
    source: str
    shape: tuple[int, ...]
    encoding: str
    encode_mb_s: float
    decode_mb_s: float
    ratio: float


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds per call; each sample loops long enough (~20 ms) to dwarf timer noise."""
    start = time.perf_counter()
    fn()
    loops = max(1, int(0.02 / max(time.perf_counter() - start, 1e-7)))
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        samples.append((time.perf_counter() - start) / loops)
    return statistics.median(samples)


def real_activations(tokens: int) -> list[tuple[str, torch.Tensor]]:
    """Hidden states of the default model after layers 10 and 20 on a fixed English text."""
    from meshnet.models.activations import boundary_hidden_states

    states = boundary_hidden_states("default", tokens, boundaries=(10, 20))
    return [(f"real, after layer {k}", v) for k, v in states.items()]


def synthetic(tokens: int, hidden: int, like: torch.Tensor | None) -> torch.Tensor:
    """Normal values; per-channel scales drawn from real activations when given."""
    gen = torch.Generator().manual_seed(0)
    if like is None:
        scales = torch.ones(hidden)
    else:
        per_channel = like.float().std(dim=(0, 1))
        scales = per_channel[torch.randint(0, per_channel.numel(), (hidden,), generator=gen)]
    return (torch.randn(1, tokens, hidden, generator=gen) * scales).to(torch.bfloat16)


def measure(source: str, x: torch.Tensor, repeat: int) -> list[Row]:
    raw = len(tensor_bytes(x))
    rows = []
    for encoding in ENCODINGS:
        config = WireConfig(encoding=encoding)
        frame = encode(x, META, config)
        body = bytes(frame.body)
        enc_s = median_seconds(lambda c=config: bytes(encode(x, META, c).body), repeat)
        dec_s = median_seconds(lambda f=frame, b=body: decode(f.headers, b), repeat)
        rows.append(
            Row(
                source,
                tuple(x.shape),
                encoding,
                raw / enc_s / 1e6,
                raw / dec_s / 1e6,
                raw / len(body),
            )
        )
    return rows


def payload_rates(x: torch.Tensor, repeat: int) -> tuple[float, float]:
    """MB/s of the uncompressed payload path alone (no headers): tensor -> sendable bytes
    view, and received bytes -> tensor owning its memory."""
    raw = len(tensor_bytes(x))
    body = bytes(tensor_bytes(x))
    enc_s = median_seconds(lambda: tensor_bytes(x), repeat)
    dec_s = median_seconds(lambda: bits_tensor(payload_bits(body, tuple(x.shape))), repeat)
    return raw / enc_s / 1e6, raw / dec_s / 1e6


def copy_ceiling(x: torch.Tensor, repeat: int) -> float:
    view = tensor_bytes(x)
    return len(view) / median_seconds(lambda: bytes(view), repeat) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="tiny synthetic run (for tests)")
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.tiny:
        inputs = [("synthetic", synthetic(8, 64, None))]
        repeat = 3
    else:
        real = real_activations(128)
        inputs = [*real, ("synthetic, real channel scales", synthetic(128, 16384, real[0][1]))]
        repeat = args.repeat
    print("| source | shape | encoding | encode MB/s | decode MB/s | ratio | copy MB/s |")
    print("|---|---|---|---:|---:|---:|---:|")
    for source, x in inputs:
        ceiling = copy_ceiling(x, repeat)
        for r in measure(source, x, repeat):
            print(
                f"| {r.source} | {list(r.shape)} | {r.encoding} | {r.encode_mb_s:,.0f} | "
                f"{r.decode_mb_s:,.0f} | {r.ratio:.3f} | {ceiling:,.0f} |"
            )
    print()
    print("| source | shape | payload encode MB/s | payload decode MB/s | copy MB/s |")
    print("|---|---|---:|---:|---:|")
    for source, x in inputs:
        enc, dec = payload_rates(x, repeat)
        print(
            f"| {source} | {list(x.shape)} | {enc:,.0f} | {dec:,.0f} | "
            f"{copy_ceiling(x, repeat):,.0f} |"
        )


if __name__ == "__main__":
    main()
