"""Frozen configuration records; units are part of every field name."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class WireLimits:
    """What a receiver of activation frames accepts before it reads a byte of payload."""

    max_body_bytes: int = 64 * MiB  # the HTTP body as sent (compressed or not); 413 above it
    max_tensor_bytes: int = 64 * MiB  # the decoded bf16 tensor; a 2048x16384 chunk is 64 MiB


@dataclass(frozen=True)
class WireConfig:
    """How a sender encodes activation frames."""

    encoding: str = "auto"  # none | zstd | zstd-shuffle | auto
    chunk_tokens: int = 128  # prefill chunk length in tokens (ADR-0008)
    auto_min_bytes: int = 64 * 1024  # `auto` compresses only payloads at least this large
