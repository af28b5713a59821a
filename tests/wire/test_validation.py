"""The decoder refuses every malformed frame with a typed error naming the header."""

from __future__ import annotations

import tracemalloc

import pytest
import torch
import zstandard

from meshnet.config import WireLimits
from meshnet.errors import (
    PayloadTooLargeError,
    UnsupportedEncodingError,
    WireError,
    WireVersionError,
)
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import FrameMeta, decode, encode
from meshnet.wire import headers as h

META = FrameMeta(SessionId("s"), ModelId("m"), LayerSpan(2, 4), position=0)
GOOD = encode(torch.randn(1, 4, 8), META)
BODY = bytes(GOOD.body)


def frame(**changes: str | None) -> dict[str, str]:
    headers = dict(GOOD.headers)
    for name, value in changes.items():
        key = getattr(h, name)
        if value is None:
            headers.pop(key, None)
        else:
            headers[key] = value
    return headers


CASES = [
    ({"SHAPE": None}, WireError, h.SHAPE),
    ({"SHAPE": "1,4"}, WireError, h.SHAPE),
    ({"SHAPE": "1,4,8,1"}, WireError, h.SHAPE),
    ({"SHAPE": "1,-4,8"}, WireError, h.SHAPE),
    ({"SHAPE": "1,0,8"}, WireError, h.SHAPE),
    ({"SHAPE": "1,4,x"}, WireError, h.SHAPE),
    ({"SHAPE": "1,4,１"}, WireError, h.SHAPE),  # full-width digit
    ({"SHAPE": "1,8,8"}, WireError, "body"),  # body too short for the shape
    ({"SHAPE": "1,2,8"}, WireError, "body"),  # body too long for the shape
    ({"DTYPE": "float32"}, WireError, h.DTYPE),
    ({"DTYPE": None}, WireError, h.DTYPE),
    ({"ENCODING": "gzip"}, UnsupportedEncodingError, h.ENCODING),
    ({"ENCODING": "zstd"}, WireError, "body"),  # not zstd data
    ({"VERSION": "2"}, WireVersionError, h.VERSION),
    ({"VERSION": None}, WireError, h.VERSION),
    ({"CHUNK_INDEX": "3", "CHUNK_TOTAL": "3"}, WireError, h.CHUNK_INDEX),
    ({"CHUNK_TOTAL": "0"}, WireError, h.CHUNK_TOTAL),
    ({"SESSION": "../etc"}, WireError, h.SESSION),
    ({"SESSION": None}, WireError, h.SESSION),
    ({"MODEL": ""}, WireError, h.MODEL),
    ({"LAYERS": "4:2"}, WireError, h.LAYERS),
    ({"LAYERS": "a:b"}, WireError, h.LAYERS),
    ({"POSITION": "-1"}, WireError, h.POSITION),
    ({"POSITION": "9" * 40}, WireError, h.POSITION),
    ({"SHAPE": "1,100000,100000"}, PayloadTooLargeError, h.SHAPE),
]


@pytest.mark.parametrize(("changes", "error", "field"), CASES)
def test_malformed_frames_are_refused(
    changes: dict[str, str | None], error: type[Exception], field: str
) -> None:
    with pytest.raises(error) as info:
        decode(frame(**changes), BODY)
    assert isinstance(info.value, WireError)
    assert info.value.field == field
    assert info.value.message  # says what is wrong in words


def test_body_over_the_limit_is_413() -> None:
    with pytest.raises(PayloadTooLargeError):
        decode(GOOD.headers, BODY, WireLimits(max_body_bytes=len(BODY) - 1))


def test_version_error_names_both_versions() -> None:
    with pytest.raises(WireVersionError, match="speaks 1"):
        decode(frame(VERSION="0"), BODY)


def zstd_bomb(expanded_bytes: int) -> bytes:
    """A small zstd frame that expands to `expanded_bytes` zeros."""
    return zstandard.ZstdCompressor(level=19).compress(bytes(expanded_bytes))


@pytest.mark.parametrize("encoding", ["zstd", "zstd-shuffle"])
def test_zstd_bomb_is_refused_without_allocating_it(encoding: str) -> None:
    bomb = zstd_bomb(1 << 30)  # 1 GiB of zeros in ~40 KB; streamed so the test stays small
    assert len(bomb) < 64 * 1024
    headers = frame(ENCODING=encoding, SHAPE="1,16,64")  # declares 2 KiB
    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLargeError, match="expands beyond"):
            decode(headers, bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024 * 1024  # far below the gigabyte the frame claims


def test_zstd_frame_that_declares_a_huge_content_size_is_refused() -> None:
    small = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(1 << 24))
    with pytest.raises(PayloadTooLargeError):
        decode(frame(ENCODING="zstd", SHAPE="1,1,8"), small)


def test_truncated_zstd_is_refused() -> None:
    enc = encode(torch.randn(1, 128, 64), META, config=_cfg("zstd"))
    with pytest.raises(WireError):
        decode(enc.headers, bytes(enc.body)[:-10])


def _cfg(encoding: str):  # type: ignore[no-untyped-def]
    from meshnet.config import WireConfig

    return WireConfig(encoding=encoding)
