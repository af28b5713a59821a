"""`meshnet demo`: the README's first command.

Until the mesh can answer chat requests, the demo runs the smallest real thing that works:
it encodes and decodes one activation frame with each encoding and prints the sizes.
"""

from __future__ import annotations

import time

import torch

from meshnet.config import WireConfig
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import FrameMeta, decode, encode


def run_wire_demo(tokens: int = 128) -> int:
    print("meshnet demo: the mesh is not assembled yet; showing the activation wire format.")
    hidden = torch.randn(1, tokens, 576, generator=torch.Generator().manual_seed(0))
    meta = FrameMeta(SessionId("demo"), ModelId("default"), LayerSpan(0, 10), position=0)
    raw = hidden.numel() * 2
    print(f"activation [1, {tokens}, 576] (synthetic), {raw} bytes as bf16")
    for encoding in ("none", "zstd", "zstd-shuffle"):
        start = time.perf_counter()
        frame = encode(hidden, meta, WireConfig(encoding=encoding))
        _, back = decode(frame.headers, bytes(frame.body))
        ms = (time.perf_counter() - start) * 1e3
        exact = torch.equal(back, hidden.to(torch.bfloat16))
        print(
            f"  {encoding:13s} {len(frame.body):8d} bytes  ratio {raw / len(frame.body):.2f}  "
            f"round trip {ms:.2f} ms  bit-exact {exact}"
        )
    return 0
