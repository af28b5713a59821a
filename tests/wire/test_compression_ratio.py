"""What docs/wire.md states about compression, asserted on real activations (shipped in
tests/data): zstd 1.27x and zstd-shuffle 1.43x on a 128-token chunk after layer 20, and
`auto` shrinking prefill frames while sending decode steps raw."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from meshnet.config import WireConfig
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import decode, encode
from meshnet.wire.headers import ENCODING, FrameMeta

ACTIVATIONS = Path(__file__).resolve().parents[1] / "data" / "activations-layer20.bf16"
META = FrameMeta(SessionId("s"), ModelId("default"), LayerSpan(20, 30), 0)


def real_chunk() -> torch.Tensor:
    """bf16 [1, 128, 576]: the default model after layer 20."""
    raw = np.frombuffer(ACTIVATIONS.read_bytes(), dtype=np.uint16).copy()
    return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).reshape(1, 128, 576)


@pytest.mark.parametrize(("encoding", "at_least"), [("zstd", 1.2), ("zstd-shuffle", 1.35)])
def test_real_activations_compress_as_documented(encoding: str, at_least: float) -> None:
    hidden = real_chunk()
    frame = encode(hidden, META, WireConfig(encoding=encoding))
    ratio = hidden.numel() * 2 / len(frame.body)
    assert ratio >= at_least, f"{encoding}: {ratio:.3f}x"
    _, back = decode(frame.headers, bytes(frame.body))
    assert torch.equal(back, hidden)


def test_auto_shrinks_a_prefill_chunk_and_sends_a_decode_step_raw() -> None:
    hidden = real_chunk()
    chunk = encode(hidden, META, WireConfig(encoding="auto"))
    assert chunk.headers[ENCODING] == "zstd-shuffle"
    assert len(chunk.body) < 0.75 * hidden.numel() * 2  # measured 0.70 of the raw bytes
    step = encode(hidden[:, :1], META, WireConfig(encoding="auto"))
    assert ENCODING not in step.headers and len(step.body) == 576 * 2
