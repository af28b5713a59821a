"""Activation frames: a `[batch, tokens, hidden]` tensor <-> HTTP headers and body (ADR-0008).

The body is always little-endian bfloat16, whatever dtype came in. The only copies are the
dtype cast (skipped for bf16 input), compression when chosen, and one copy into the decoded
tensor's own memory.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from meshnet.config import WireConfig, WireLimits
from meshnet.errors import PayloadTooLargeError, WireError
from meshnet.wire import compression
from meshnet.wire import headers as h

BF16_BYTES = 2

# The wire is little-endian and so is every host torch supports well; we never byte-swap.
if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("meshnet's wire format needs a little-endian host")


@dataclass(frozen=True)
class Encoded:
    """A frame ready to send: its headers and body."""

    headers: dict[str, str]
    body: bytes | memoryview


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A view of `tensor` as contiguous little-endian bf16 bytes (no copy for bf16 CPU input)."""
    bf16 = tensor.detach()
    if bf16.dtype != torch.bfloat16 or bf16.device.type != "cpu" or not bf16.is_contiguous():
        bf16 = bf16.to(device="cpu", dtype=torch.bfloat16).contiguous()
    return memoryview(bf16.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def encode(
    tensor: torch.Tensor,
    meta: h.FrameMeta,
    config: WireConfig = WireConfig(),
    link_bytes_per_s: float | None = None,
) -> Encoded:
    """Encode a `[batch, tokens, hidden]` float tensor and its metadata as one frame;
    `link_bytes_per_s`: the measured rate of the link it goes over (for `auto`)."""
    if tensor.dim() != 3 or not tensor.is_floating_point():
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


def decode(
    headers: Mapping[str, str], body: bytes, limits: WireLimits = WireLimits()
) -> tuple[h.FrameMeta, torch.Tensor]:
    """Validate a frame and return its metadata and a bf16 `[batch, tokens, hidden]` tensor.

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
    return meta, payload_to_tensor(raw, shape)


def payload_to_tensor(raw: bytes | bytearray, shape: tuple[int, int, int]) -> torch.Tensor:
    """Little-endian bf16 bytes -> a `shape` tensor that owns its memory (one copy at most)."""
    owned = raw if isinstance(raw, bytearray) else bytearray(raw)  # torch needs a writable buffer
    return torch.frombuffer(owned, dtype=torch.bfloat16).view(shape)


def require_finite(hidden: torch.Tensor) -> None:
    """Refuse (`WireError`) activations holding NaN or Inf: a faulty sender, never a value."""
    if not bool(torch.isfinite(hidden).all()):
        raise WireError("the activations hold NaN or Inf values", field="body")
