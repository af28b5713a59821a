"""Activation frames: a `[batch, tokens, hidden]` array <-> HTTP headers and body (ADR-0008).

The body is always little-endian bfloat16, whatever dtype came in. The only copies are the
dtype cast (skipped for bf16 input), compression when chosen, and one copy into the decoded
array's own memory.

The format itself needs only numpy: a frame decodes to bf16 *bits*, a uint16 numpy array
(`decode_bits`), which is what a node without torch computes from (ADR-0052). Torch tensors
are taken and given where torch is already in the process (`wire.tensors`, imported on use).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import numpy as np

from meshnet.config import WireConfig, WireLimits
from meshnet.errors import PayloadTooLargeError, WireError
from meshnet.wire import compression
from meshnet.wire import headers as h

if TYPE_CHECKING:
    import torch

BF16_BYTES = 2
EXPONENT_BITS = 0x7F80  # a bf16 value with all of these set is Inf or NaN
# activations in a process: bf16 bits (uint16) or float numpy arrays, or torch tensors
Hidden = Union[np.ndarray, "torch.Tensor"]

# The wire is little-endian and so is every host torch supports well; we never byte-swap.
if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("meshnet's wire format needs a little-endian host")


@dataclass(frozen=True)
class Encoded:
    """A frame ready to send: its headers and body."""

    headers: dict[str, str]
    body: bytes | memoryview


def bf16_bits(array: np.ndarray) -> np.ndarray:
    """`array` as contiguous bf16 bits (uint16): uint16 input is taken as bits already; float
    input is rounded to nearest, ties to even (as torch's cast does)."""
    if array.dtype == np.uint16:
        return np.ascontiguousarray(array)
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"expected float activations or bf16 bits, got {array.dtype}")
    wide = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = (wide + (0x7FFF + ((wide >> 16) & 1))) >> 16
    return rounded.astype(np.uint16)


def bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> the same values as float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def tensor_bytes(hidden: Hidden) -> memoryview:
    """A view of `hidden` as contiguous little-endian bf16 bytes (no copy for bf16 input)."""
    if isinstance(hidden, np.ndarray):
        return bf16_bits(hidden).data.cast("B")
    from meshnet.wire.tensors import bf16_bytes  # a torch tensor: torch is loaded already

    return bf16_bytes(hidden)


def encode(
    tensor: Hidden,
    meta: h.FrameMeta,
    config: WireConfig = WireConfig(),
    link_bytes_per_s: float | None = None,
) -> Encoded:
    """Encode a `[batch, tokens, hidden]` float tensor and its metadata as one frame;
    `link_bytes_per_s`: the measured rate of the link it goes over (for `auto`)."""
    if len(tensor.shape) != 3 or not _floating(tensor):
        raise ValueError(
            f"expected a float [batch, tokens, hidden] tensor, got "
            f"{tensor.dtype} {tuple(tensor.shape)}"
        )
    payload = tensor_bytes(tensor)
    encoding = compression.choose(
        config.encoding,
        len(payload),
        config.auto_min_bytes,
        link_bytes_per_s,
        config.auto_compress_below_mbit_s * 1e6 / 8,
    )
    headers = {
        h.VERSION: h.WIRE_VERSION,
        h.CONTENT_TYPE: h.OCTET_STREAM,
        h.SHAPE: "{},{},{}".format(*tensor.shape),
        h.DTYPE: h.DTYPE_BF16,
        **meta.to_headers(),
    }
    if encoding != compression.NONE:
        headers[h.ENCODING] = encoding
    return Encoded(headers, compression.compress(payload, encoding))


def _floating(hidden: Hidden) -> bool:
    if isinstance(hidden, np.ndarray):
        return hidden.dtype == np.uint16 or np.issubdtype(hidden.dtype, np.floating)
    return bool(hidden.is_floating_point())


def decode(
    headers: Mapping[str, str], body: bytes, limits: WireLimits = WireLimits()
) -> tuple[h.FrameMeta, torch.Tensor]:
    """`decode_bits` with the activations as a bf16 torch tensor (same memory)."""
    from meshnet.wire.tensors import bits_tensor

    meta, bits = decode_bits(headers, body, limits)
    return meta, bits_tensor(bits)


def decode_bits(
    headers: Mapping[str, str], body: bytes, limits: WireLimits = WireLimits()
) -> tuple[h.FrameMeta, np.ndarray]:
    """Validate a frame and return its metadata and its `[batch, tokens, hidden]` bf16 bits
    (a uint16 array).

    Raises a `WireError` subclass for anything malformed; allocates at most the declared
    tensor size (itself bounded by `limits`) plus one byte.
    """
    lower = h.lower_keys(headers)
    h.check_version(lower)
    if len(body) > limits.max_body_bytes:
        raise PayloadTooLargeError(
            f"body of {len(body)} bytes exceeds the limit of {limits.max_body_bytes}", field="body"
        )
    dtype = h.require(lower, h.DTYPE)
    if dtype != h.DTYPE_BF16:
        raise WireError(f"{h.DTYPE} must be {h.DTYPE_BF16}, got {dtype[:40]!r}", field=h.DTYPE)
    shape = h.parse_shape(h.require(lower, h.SHAPE))
    expected = shape[0] * shape[1] * shape[2] * BF16_BYTES
    if expected > limits.max_tensor_bytes:
        raise PayloadTooLargeError(
            f"declared shape {shape} needs {expected} bytes, over the limit of "
            f"{limits.max_tensor_bytes}",
            field=h.SHAPE,
        )
    if shape[0] * shape[1] > limits.max_frame_tokens:
        raise PayloadTooLargeError(
            f"declared shape {shape} carries {shape[0] * shape[1]} tokens, over the limit of "
            f"{limits.max_frame_tokens} a frame",
            field=h.SHAPE,
        )
    meta = h.parse_meta(lower)
    encoding = lower.get(h.ENCODING.lower(), compression.NONE).strip()
    raw = compression.decompress(body, encoding, expected)
    return meta, payload_bits(raw, shape)


def payload_bits(raw: bytes | bytearray, shape: tuple[int, int, int]) -> np.ndarray:
    """Little-endian bf16 bytes -> `shape` bits that own their (writable) memory (one copy at
    most)."""
    owned = raw if isinstance(raw, bytearray) else bytearray(raw)
    return np.frombuffer(owned, dtype=np.uint16).reshape(shape)


def all_finite(hidden: Hidden) -> bool:
    """Whether `hidden` (bits, a float array or a tensor) holds no NaN or Inf."""
    if isinstance(hidden, np.ndarray):
        if hidden.dtype == np.uint16:
            return not bool(np.any((hidden & EXPONENT_BITS) == EXPONENT_BITS))
        return bool(np.isfinite(hidden).all())
    from meshnet.wire.tensors import tensor_finite

    return tensor_finite(hidden)


def require_finite(hidden: Hidden) -> None:
    """Refuse (`WireError`) activations holding NaN or Inf: a faulty sender, never a value."""
    if not all_finite(hidden):
        raise WireError("the activations hold NaN or Inf values", field="body")
