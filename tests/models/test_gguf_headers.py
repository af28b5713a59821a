"""Crafted GGUF headers are refused with a `ModelError` naming the field, quickly and with
little memory (review G1: most raised struct.error, MemoryError, RecursionError or
ZeroDivisionError, and a 30 MB bool array took 11 s and 381 MiB)."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest

from meshnet.errors import ModelError
from meshnet.models.gguf_file import MAX_ARRAY_ITEMS, read_gguf


def text(value: str, length: int | None = None) -> bytes:
    raw = value.encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def head(tensors: int, kvs: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, kvs)


def tensor(name: str, dims: list[int], kind: int = 0, offset: int = 0) -> bytes:
    packed = b"".join(struct.pack("<Q", d) for d in dims)
    return text(name) + struct.pack("<I", len(dims)) + packed + struct.pack("<IQ", kind, offset)


def padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 32) + b"\0" * 64


ARCH = text("general.architecture") + struct.pack("<I", 8) + text("llama")
NORM = tensor("blk.0.attn_norm.weight", [16])
CASES = {
    "key length 2**62": head(0, 1) + text("general.name", 1 << 62),
    "kv count 2**62": head(0, 1 << 62) + ARCH,
    "2**40 strings": head(0, 1) + text("tokenizer.ggml.tokens")
    + struct.pack("<IIQ", 9, 8, 1 << 40) + text("a") * 4,
    "2**31 strings": head(0, 1) + text("tokenizer.ggml.tokens")
    + struct.pack("<IIQ", 9, 8, 1 << 31) + text("a") * 4,
    "too many numbers": head(0, 1) + text("x.flags")
    + struct.pack("<IIQ", 9, 7, MAX_ARRAY_ITEMS + 1) + b"\1" * (MAX_ARRAY_ITEMS + 1),
    "arrays 5000 deep": head(0, 1) + text("x.nest") + struct.pack("<I", 9)
    + struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0),
    "dims whose product wraps to 0": padded(head(1, 1) + ARCH + tensor("t", [1 << 32, 1 << 32])),
    "dims whose product wraps to 16": padded(head(1, 1) + ARCH + tensor("t", [(1 << 63) + 8, 2])),
    "2**31 dims": padded(head(1, 1) + ARCH) + text("t") + struct.pack("<I", 1 << 31) + b"\1" * 64,
    "alignment 0": head(1, 2) + ARCH + text("general.alignment") + struct.pack("<II", 4, 0) + NORM,
    "offset 2**63": padded(head(1, 1) + ARCH + tensor("t", [16], 0, 1 << 63)),
    "one name twice": padded(head(2, 1) + ARCH + NORM + NORM),
    "cut short": head(1, 1) + ARCH[:10],
    "unknown value type": head(0, 1) + text("x.y") + struct.pack("<I", 99),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_crafted_header_is_refused_naming_the_field(tmp_path: Path, case: str) -> None:
    path = tmp_path / "crafted.gguf"
    path.write_bytes(CASES[case])
    started = time.monotonic()
    with pytest.raises(ModelError) as refused:
        read_gguf(path)
    assert refused.value.field and "crafted.gguf" in refused.value.message, refused.value
    assert time.monotonic() - started < 2.0


def test_a_sane_header_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "sane.gguf"
    path.write_bytes(padded(head(1, 1) + ARCH + NORM))
    index = read_gguf(path)
    assert index.fields["general.architecture"] == "llama"
    assert [t.name for t in index.tensors] == ["blk.0.attn_norm.weight"]
