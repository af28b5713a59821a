"""Golden vectors: the exact bytes of a fixed tensor under each encoding.

An incompatible change to the format fails here. Regenerate only on purpose, together with a
wire-version bump: `python tests/wire/test_golden.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshnet.config import WireConfig
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import FrameMeta, decode, encode
from meshnet.wire.compression import unshuffle

GOLDEN = Path(__file__).parent / "golden"
ENCODINGS = ["none", "zstd", "zstd-shuffle"]
META = FrameMeta(
    SessionId("golden"),
    ModelId("default"),
    LayerSpan(3, 7),
    position=128,
    chunk_index=1,
    chunk_total=3,
)


def fixed_tensor() -> torch.Tensor:
    values = torch.linspace(-4.0, 4.0, 2 * 3 * 8, dtype=torch.float32).reshape(2, 3, 8)
    values[0, 0, 0] = float("nan")
    values[1, 2, 7] = float("-inf")
    return values.to(torch.bfloat16)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_golden_frames_decode_to_the_fixed_tensor(encoding: str) -> None:
    headers = json.loads((GOLDEN / f"{encoding}.json").read_text())
    body = (GOLDEN / f"{encoding}.bin").read_bytes()
    meta, tensor = decode(headers, body)
    assert meta == META
    assert torch.equal(tensor.view(torch.int16), fixed_tensor().view(torch.int16))


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_encoder_still_writes_the_golden_frames(encoding: str) -> None:
    enc = encode(fixed_tensor(), META, WireConfig(encoding=encoding))
    assert enc.headers == json.loads((GOLDEN / f"{encoding}.json").read_text())
    assert bytes(enc.body) == (GOLDEN / f"{encoding}.bin").read_bytes()


def test_raw_golden_is_little_endian_and_shuffle_is_high_plane_first() -> None:
    raw = (GOLDEN / "none.bin").read_bytes()
    assert (
        raw[2:4]
        == torch.tensor([-3.828125], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    )  # linspace's 2nd value, low byte first
    import zstandard

    body = (GOLDEN / "zstd-shuffle.bin").read_bytes()
    reader = zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=True)
    planes = reader.read(1 << 20)
    n = len(raw) // 2
    assert planes[:n] == raw[1::2] and planes[n:] == raw[0::2]
    assert bytes(unshuffle(planes)) == raw


if __name__ == "__main__":
    GOLDEN.mkdir(exist_ok=True)
    for name in ENCODINGS:
        frame = encode(fixed_tensor(), META, WireConfig(encoding=name))
        (GOLDEN / f"{name}.json").write_text(json.dumps(frame.headers, indent=1) + "\n")
        (GOLDEN / f"{name}.bin").write_bytes(bytes(frame.body))
