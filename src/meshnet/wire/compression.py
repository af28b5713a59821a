"""Body encodings of the activation plane: none, zstd and zstd-shuffle.

`zstd-shuffle` splits the bf16 payload into two byte planes (all high bytes, then all low
bytes) before zstd level 1, each plane in its own zstd frame (the body is the two frames
back to back, which any zstd decoder reads as the planes' concatenation). The high byte
(sign, exponent, top of mantissa) of neighbouring
activations repeats a lot; the low byte is close to noise. Apart, zstd finds the first plane's
redundancy; interleaved it mostly does not. See docs/wire.md for measured ratios.

Decompression always runs with a hard output bound, so a small zstd bomb is refused after
allocating at most `bound + 1` bytes.
"""

from __future__ import annotations

import io

import numpy as np
import zstandard

from meshnet.errors import PayloadTooLargeError, UnsupportedEncodingError, WireError
from meshnet.wire.headers import ENCODING

NONE = "none"
ZSTD = "zstd"
ZSTD_SHUFFLE = "zstd-shuffle"
AUTO = "auto"
ENCODINGS = (NONE, ZSTD, ZSTD_SHUFFLE)  # what may appear in X-Meshnet-Encoding (none = absent)
SENDER_CHOICES = (*ENCODINGS, AUTO)

ZSTD_LEVEL = 1  # ADR-0008: near-lz4 speed; higher levels buy ~2% ratio at 3x the CPU time

_compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
_decompressor = zstandard.ZstdDecompressor()


def choose(
    encoding: str,
    payload_bytes: int,
    auto_min_bytes: int,
    link_bytes_per_s: float | None = None,
    compress_below_bytes_per_s: float = 75e6,
) -> str:
    """Resolve a sender's choice (`auto` included) to a wire encoding for this payload.

    `auto` (ADR-0037): a decode step (2 x hidden bytes, under `auto_min_bytes`) costs more
    to compress than to send; a larger payload is compressed unless the link to its
    receiver was measured at `compress_below_bytes_per_s` or faster, where compressing and
    decompressing cost more time than the bytes saved. Not measured yet: compressed.
    """
    if encoding not in SENDER_CHOICES:
        raise ValueError(f"unknown encoding {encoding!r}; choose one of {SENDER_CHOICES}")
    if encoding != AUTO:
        return encoding
    if payload_bytes < auto_min_bytes:
        return NONE
    fast = link_bytes_per_s is not None and link_bytes_per_s >= compress_below_bytes_per_s
    return NONE if fast else ZSTD_SHUFFLE


def answering(choice: str, request_encoding: str) -> str:
    """A receiver's choice for its answer: under `auto`, the request's own encoding (the
    same shape over the same link, judged by the sender, who measures that link)."""
    return request_encoding if choice == AUTO else choice


def shuffle(payload: memoryview) -> np.ndarray:
    """Little-endian bf16 bytes -> high-byte plane followed by low-byte plane."""
    values = np.frombuffer(payload, dtype="<u2")
    n = values.size
    planes = np.empty(2 * n, dtype=np.uint8)
    np.right_shift(values, 8, out=planes[:n], casting="unsafe")  # high bytes
    np.bitwise_and(values, 0xFF, out=planes[n:], casting="unsafe")  # low bytes
    return planes


def unshuffle(planes: bytes | bytearray) -> bytearray:
    """Inverse of `shuffle`: two planes -> interleaved little-endian bf16 bytes."""
    n = len(planes) // 2
    src = np.frombuffer(planes, dtype=np.uint8)
    out = bytearray(2 * n)
    values = np.frombuffer(out, dtype="<u2")
    np.left_shift(src[:n], 8, out=values, dtype="<u2")
    np.bitwise_or(values, src[n:], out=values)
    return out


def compress(payload: memoryview, encoding: str) -> bytes | memoryview:
    """Encode little-endian bf16 bytes for the wire (no copy for `none`)."""
    if encoding == NONE:
        return payload
    if encoding == ZSTD:
        return _compressor.compress(payload)
    if encoding == ZSTD_SHUFFLE:
        # One zstd frame per plane: a frame's entropy tables then fit one plane's statistics
        # (1.43x on real activations, against 1.30x for one frame over both planes).
        planes = shuffle(payload)
        half = len(planes) // 2
        return b"".join(
            _compressor.compress(memoryview(p))  # type: ignore[arg-type]
            for p in (planes[:half], planes[half:])
        )
    raise UnsupportedEncodingError(f"unknown encoding {encoding!r}", field=ENCODING)


def decompress(body: bytes, encoding: str, expected_bytes: int) -> bytes | bytearray:
    """Decode a body to exactly `expected_bytes` of little-endian bf16, or raise."""
    if encoding == NONE:
        raw: bytes | bytearray = body
    elif encoding in (ZSTD, ZSTD_SHUFFLE):
        raw = _bounded_zstd(body, expected_bytes)
        if encoding == ZSTD_SHUFFLE and len(raw) == expected_bytes:  # even: bf16 shapes
            raw = unshuffle(raw)
    else:
        raise UnsupportedEncodingError(
            f"unknown encoding {encoding[:40]!r}; this receiver knows {ENCODINGS}", field=ENCODING
        )
    if len(raw) != expected_bytes:
        raise WireError(
            f"body holds {len(raw)} bytes after decoding; the shape needs {expected_bytes}",
            field="body",
        )
    return raw


def _bounded_zstd(body: bytes, expected_bytes: int) -> bytes:
    """Decompress at most `expected_bytes + 1` bytes whatever the frame header claims."""
    try:
        with _decompressor.stream_reader(io.BytesIO(body), read_across_frames=True) as reader:
            raw = reader.read(expected_bytes + 1)
    except zstandard.ZstdError as exc:
        raise WireError(f"body is not valid zstd: {exc}", field="body") from None
    if len(raw) > expected_bytes:
        raise PayloadTooLargeError(
            f"zstd body expands beyond the {expected_bytes} bytes its shape declares", field="body"
        )
    return raw
