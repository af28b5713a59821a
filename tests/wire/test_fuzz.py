"""Property-based: arbitrary headers and bodies give a tensor or a WireError, nothing else."""

from __future__ import annotations

import tracemalloc

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet.config import WireLimits
from meshnet.errors import WireError
from meshnet.wire import decode, encode
from meshnet.wire import headers as h
from meshnet.wire.headers import FrameMeta

NAMES = [
    h.VERSION,
    h.SHAPE,
    h.DTYPE,
    h.ENCODING,
    h.SESSION,
    h.CHUNK_INDEX,
    h.CHUNK_TOTAL,
    h.MODEL,
    h.LAYERS,
    h.POSITION,
    "X-Other",
]
LIMITS = WireLimits(max_body_bytes=1 << 16, max_tensor_bytes=1 << 16)

numbers = st.one_of(st.integers(-5, 70000).map(str), st.text(max_size=12))
shapes = st.one_of(
    st.lists(st.integers(-2, 300), min_size=0, max_size=5).map(lambda d: ",".join(map(str, d))),
    st.text(max_size=20),
)
values = {
    h.VERSION: st.sampled_from(["1", "2", "", "1.0"]),
    h.SHAPE: shapes,
    h.DTYPE: st.sampled_from(["bfloat16", "float16", "", "BFLOAT16"]),
    h.ENCODING: st.sampled_from(["zstd", "zstd-shuffle", "none", "gzip", ""]),
    h.SESSION: st.one_of(st.text(max_size=10), st.just("s")),
    h.CHUNK_INDEX: numbers,
    h.CHUNK_TOTAL: numbers,
    h.MODEL: st.one_of(st.text(max_size=10), st.just("m")),
    h.LAYERS: st.one_of(st.text(max_size=10), st.just("0:3")),
    h.POSITION: numbers,
    "X-Other": st.text(max_size=10),
}
header_sets = st.fixed_dictionaries({}, optional=values)


@settings(max_examples=400, deadline=None)
@given(headers=header_sets, body=st.binary(max_size=2048))
def test_decoder_returns_a_tensor_or_wire_error(headers: dict[str, str], body: bytes) -> None:
    tracemalloc.start()
    try:
        meta, tensor = decode(headers, body, LIMITS)
    except WireError:
        return
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 4 * LIMITS.max_tensor_bytes + (1 << 20)  # never beyond the declared bound
    assert isinstance(meta, FrameMeta)
    assert tensor.dtype == torch.bfloat16 and tensor.dim() == 3
    assert tensor.numel() * 2 <= LIMITS.max_tensor_bytes


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.integers(1, 40),
    hidden=st.integers(1, 40),
    encoding=st.sampled_from(["none", "zstd", "zstd-shuffle"]),
    flip=st.integers(0, 10_000),
)
def test_corrupted_valid_frames_never_escape_as_other_errors(
    tokens: int, hidden: int, encoding: str, flip: int
) -> None:
    from meshnet.config import WireConfig
    from meshnet.types import LayerSpan, ModelId, SessionId

    meta = FrameMeta(SessionId("s"), ModelId("m"), LayerSpan(0, 3), 0)
    enc = encode(torch.randn(1, tokens, hidden), meta, WireConfig(encoding=encoding))
    body = bytearray(enc.body)
    body[flip % len(body)] ^= 0xFF
    try:
        _, out = decode(enc.headers, bytes(body), LIMITS)
    except WireError:
        return
    assert out.shape == (1, tokens, hidden)
