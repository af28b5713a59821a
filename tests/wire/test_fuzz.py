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


# Near misses per header: each is wrong only in its own way, so the other checks pass.
NEAR_MISSES = {
    h.SESSION: ["", "-s", "s" * 129, "s/../x", "s\u00e9"],
    h.MODEL: ["", "m m", "m" * 129, "/m"],
    h.LAYERS: ["3:0", "0:0", "0-3", "a:b", "0:3:6", "-1:3"],
    h.POSITION: ["-1", "x", "1.5", "", "99999999999999999999999"],
    h.CHUNK_INDEX: ["-1", "3", "x", "2"],
    h.CHUNK_TOTAL: ["0", "-2", "x", "1.0"],
    h.ENCODING: ["gzip", "ZSTD-SHUFFLE-2", "zstd", "zstd-shuffle"],
}


@st.composite
def mostly_valid_frames(draw: st.DrawFn) -> tuple[dict[str, str], bytes]:
    """A valid frame with at most two headers replaced by near misses, and sometimes its
    body's encoding claimed wrong or its body cut: these reach the checks after the first
    three headers (session, model, layers, position, chunks, decompression)."""
    from meshnet.config import WireConfig
    from meshnet.types import LayerSpan, ModelId, SessionId

    tokens, encoding = draw(st.integers(1, 8)), draw(st.sampled_from(["none", "zstd"]))
    meta = FrameMeta(SessionId("s-1"), ModelId("m"), LayerSpan(0, 3), draw(st.integers(0, 9)))
    frame = encode(torch.ones(1, tokens, 16), meta, WireConfig(encoding=encoding))
    headers, body = dict(frame.headers), bytes(frame.body)
    for name in draw(st.lists(st.sampled_from(sorted(NEAR_MISSES)), max_size=2, unique=True)):
        headers[name] = draw(st.sampled_from(NEAR_MISSES[name]))
    if draw(st.booleans()) and len(body) > 1:
        body = body[: draw(st.integers(1, len(body) - 1))]
    return headers, body


def test_mostly_valid_frames_reach_every_check() -> None:
    """Every example decodes or raises a WireError naming the part at fault; across the run
    each later check is reached, and some frames decode (the fuzz is not stopped early)."""
    reached: dict[str, int] = {}

    # derandomized: which checks 400 random examples reach varied, and once (a suite run of
    # 2026-12-06) none had a near-miss encoding; the same examples each run reach them all
    @settings(max_examples=400, deadline=None, database=None, derandomize=True)
    @given(frame=mostly_valid_frames())
    def check(frame: tuple[dict[str, str], bytes]) -> None:
        headers, body = frame
        try:
            _, tensor = decode(headers, body, LIMITS)
        except WireError as exc:
            reached[exc.field or "?"] = reached.get(exc.field or "?", 0) + 1
            return
        reached["decoded"] = reached.get("decoded", 0) + 1
        assert tensor.shape[0] == 1 and tensor.shape[2] == 16

    check()
    later = {h.SESSION, h.MODEL, h.LAYERS, h.POSITION, h.CHUNK_INDEX, h.ENCODING, "body"}
    print(f"reached: {reached}")
    assert later | {"decoded"} <= set(reached), reached
