"""GGUF files without torch: a fast index of metadata and tensors over one memory map.

`gguf.GGUFReader` builds numpy views for every part of every field; for a GGUF file with a
49,152-token vocabulary that takes ~5 s per process, paid by every node at start-up. This
reader parses the same layout (little-endian GGUF v2/v3) with `struct` over a memory map in
~0.1 s and gives the same tensor views (`tests/models/test_loader.py` checks both agree).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, overload

import numpy as np

from meshnet.errors import ModelError

# GGUF value types -> struct formats of the scalars (8 = string, 9 = array)
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
# llama.cpp's names for a GGUF's head tensors (every family), and the prefix of layer i's
HEAD_TENSORS = ("token_embd.weight", "output_norm.weight", "output.weight")


def layer_prefix(index: int) -> str:
    return f"blk.{index}."


_PLAIN_DTYPES = {
    0: np.float32,
    1: np.float16,
    24: np.int8,
    25: np.int16,
    26: np.int32,
    27: np.int64,
    28: np.float64,
}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order (innermost first)
    data: np.ndarray  # a view of the file: elements for plain types, bytes per row if quantized
    offset: int = 0  # where its bytes start in the file

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass(frozen=True)
class GgufFile:
    fields: dict[str, Any]  # metadata as plain Python values (arrays as lists)
    tensors: list[GgufTensor]
    mapped: mmap.mmap | None = None  # the read-only map the tensors' data view
    data_start: int = 0  # where tensor data begin: bytes before it are metadata and index

    def release_pages(self) -> None:
        """Drop the file's pages from this process's resident memory (they stay in the page
        cache; a later read maps them again). The map is read-only, so nothing is lost."""
        if self.mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.mapped.madvise(mmap.MADV_DONTNEED)


class StringArray(Sequence[str]):
    """A GGUF array of strings decoded on access: a vocabulary's 49,152 tokens and 48,900
    merges as Python strings hold ~10 MiB in every process that opens the file, and only an
    entry's tokenizer reads them (through its own reader)."""

    def __init__(self, buffer: memoryview, starts: np.ndarray) -> None:
        self.buffer = buffer
        self.starts = starts  # [count + 1] byte offsets; string i is [starts[i] + 8, starts[i+1])

    def __len__(self) -> int:
        return len(self.starts) - 1

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        start, end = self.starts[range(len(self))[index] : None][:2]
        return bytes(self.buffer[start + 8 : end]).decode("utf-8", errors="replace")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


class _Cursor:
    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.offset = 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buffer, self.offset)[0]
        self.offset += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        length = self.take("Q")
        raw = bytes(self.buffer[self.offset : self.offset + length])
        self.offset += length
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> StringArray:
        """Skip `count` strings (u64 length, then bytes), noting where each starts."""
        starts = np.empty(count + 1, dtype=np.int64)
        for i in range(count):
            starts[i] = self.offset
            self.offset += 8 + struct.unpack_from("<Q", self.buffer, self.offset)[0]
        starts[count] = self.offset
        return StringArray(self.buffer, starts)

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in _SCALARS and item != 7:  # numeric arrays in one go
                values = np.frombuffer(
                    self.buffer, np.dtype("<" + _SCALARS[item]), count, self.offset
                )
                self.offset += values.nbytes
                return values.tolist()
            if item == _STRING:
                return self.strings(count)
            return [self.value(item) for _ in range(count)]
        raise ModelError(f"unknown GGUF value type {kind}")


@lru_cache(maxsize=4)
def read_gguf(path: Path) -> GgufFile:
    """The index of a GGUF file; tensor data stay in the (read-only) memory map."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(memoryview(mapped))
    magic, version = cursor.take("4s"), cursor.take("I")
    if magic != b"GGUF" or version not in (2, 3):
        raise ModelError(f"{path.name} is not a little-endian GGUF v2/v3 file")
    tensor_count, kv_count = cursor.take("Q"), cursor.take("Q")
    fields = {}
    for _ in range(kv_count):
        key = cursor.string()
        fields[key] = cursor.value(cursor.take("I"))
    infos = []
    for _ in range(tensor_count):
        name, dims = cursor.string(), cursor.take("I")
        shape = tuple(cursor.take("Q") for _ in range(dims))
        infos.append((name, shape, cursor.take("I"), cursor.take("Q")))
    alignment = int(fields.get("general.alignment", 32))
    start = -(-cursor.offset // alignment) * alignment
    tensors = []
    for name, shape, kind, offset in infos:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise ModelError(
                f"{path.name}: tensor {name!r} has GGML type {kind}, unknown to meshnet's gguf "
                f"reader (a newer llama.cpp format?)"
            ) from None
        count, dims = int(np.prod(shape)), tuple(reversed(shape))
        if kind in _PLAIN_DTYPES:
            dtype = np.dtype(_PLAIN_DTYPES[kind])
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            dtype, count, dims = (
                np.dtype(np.uint8),
                count * size // block,
                quant_shape_to_byte_shape(dims, qtype),
            )
        end = start + offset + count * dtype.itemsize
        if end > len(mapped):
            raise ModelError(
                f"{path.name} is truncated: tensor {name!r} ends at byte {end}, the file has "
                f"{len(mapped)}"
            )
        data = np.frombuffer(mapped, dtype, count, start + offset).reshape(dims)
        tensors.append(GgufTensor(name, qtype, shape, data, start + offset))
    return GgufFile(fields, tensors, mapped, start)


def check_readable(path: Path) -> None:
    """Refuse (ModelError, naming the tensor, its type and the architecture) a GGUF file
    holding a tensor type meshnet cannot dequantize: at start-up, not when a span loads."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    file = read_gguf(path)
    seen: set[Any] = set()
    for tensor in file.tensors:
        if tensor.tensor_type in seen or tensor.tensor_type.value in _PLAIN_DTYPES:
            continue
        seen.add(tensor.tensor_type)
        block_bytes = GGML_QUANT_SIZES[tensor.tensor_type][1]
        try:
            dequantize(np.zeros((1, block_bytes), np.uint8), tensor.tensor_type)
        except (NotImplementedError, KeyError, ValueError):
            arch = file.fields.get("general.architecture", "?")
            raise ModelError(
                f"{path.name} ({arch}): tensor {tensor.name!r} is {tensor.tensor_type.name}, "
                f"a type meshnet cannot read"
            ) from None


def gguf_fields(path: Path) -> dict[str, Any]:
    """All GGUF metadata as plain Python values."""
    return read_gguf(path).fields
