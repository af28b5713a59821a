"""GGUF files without torch: a fast index of metadata and tensors over one memory map.

`gguf.GGUFReader` builds numpy views for every part of every field; for a GGUF file with a
49,152-token vocabulary that takes ~5 s per process, paid by every node at start-up. This
reader parses the same layout (little-endian GGUF v2/v3) with `struct` over a memory map in
~0.1 s and gives the same tensor views (`tests/models/test_loader.py` checks both agree).
"""

from __future__ import annotations

import math
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


MAX_ARRAY_ITEMS = 4 << 20  # numbers in one array field (a vocabulary has ~262,144 at most)
MAX_DEPTH = 4  # arrays of arrays, at most this deep
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


class _Cursor:
    """Reads a GGUF header front to back; anything that does not fit the file (a length,
    a count, a nesting) is a `ModelError` naming the field being read (review G1)."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.offset = 0
        self.at = "the header"  # the field being read, for refusals

    def need(self, nbytes: int) -> None:
        if nbytes < 0 or self.offset + nbytes > len(self.buffer):
            raise ModelError(
                f"{self.at} needs {nbytes} bytes at byte {self.offset}; the file has "
                f"{len(self.buffer)}",
                field=self.at,
            )

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        self.need(size)
        value = struct.unpack_from("<" + fmt, self.buffer, self.offset)[0]
        self.offset += size
        return value

    def count(self, what: str, item_bytes: int) -> int:
        """A u64 count of items of at least `item_bytes` each, refused when the rest of the
        file cannot hold them (no huge allocation on a header's word)."""
        n = self.take("Q")
        if n * item_bytes > len(self.buffer) - self.offset:
            raise ModelError(f"{self.at}: {n} {what} cannot fit in the file", field=self.at)
        return int(n)

    def string(self) -> str:
        length = self.count("string bytes", 1)
        raw = bytes(self.buffer[self.offset : self.offset + length])
        self.offset += length
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> StringArray:
        """Skip `count` strings (u64 length, then bytes), noting where each starts."""
        starts = np.empty(count + 1, dtype=np.int64)
        for i in range(count):
            starts[i] = self.offset
            length = self.count("string bytes", 1)  # (moves past the length first)
            self.offset += length
        starts[count] = self.offset
        return StringArray(self.buffer, starts)

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array(depth)
        raise ModelError(f"{self.at}: unknown GGUF value type {kind}", field=self.at)

    def array(self, depth: int) -> Any:
        if depth >= MAX_DEPTH:
            raise ModelError(f"{self.at}: arrays nested over {MAX_DEPTH} deep", field=self.at)
        item = self.take("I")
        if item in _SCALARS:  # numbers in one go
            dtype = np.dtype("<" + _SCALARS[item])
            count = self.count("numbers", dtype.itemsize)
            if count > MAX_ARRAY_ITEMS:
                raise ModelError(
                    f"{self.at}: {count} numbers, more than {MAX_ARRAY_ITEMS}", field=self.at
                )
            values = np.frombuffer(self.buffer, dtype, count, self.offset)
            self.offset += values.nbytes
            return values.tolist()
        if item == _STRING:
            return self.strings(self.count("strings", 8))
        return [self.value(item, depth + 1) for _ in range(self.count("values", 4))]


@lru_cache(maxsize=4)
def read_gguf(path: Path) -> GgufFile:
    """The index of a GGUF file; tensor data stay in the (read-only) memory map."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(memoryview(mapped))
    try:
        fields, infos = _header(cursor, path)
    except ModelError as exc:
        raise ModelError(f"{path.name}: {exc.message}", field=exc.field) from None
    alignment = fields.get("general.alignment", 32)
    if not isinstance(alignment, int) or not 0 < alignment <= 1 << 20:
        raise ModelError(
            f"{path.name}: general.alignment {alignment!r} is not 1 to 1 MiB",
            field="general.alignment",
        )
    start = -(-cursor.offset // alignment) * alignment
    tensors = []
    for name, shape, kind, offset in infos:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise ModelError(
                f"{path.name}: tensor {name!r} has GGML type {kind}, unknown to meshnet's gguf "
                f"reader (a newer llama.cpp format?)",
                field=name[:80],
            ) from None
        count, dims = math.prod(shape), tuple(reversed(shape))  # Python ints: no wrap
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
        if end > len(mapped) or count == 0:
            raise ModelError(
                f"{path.name} is truncated: tensor {name[:80]!r} ends at byte {end}, the file "
                f"has {len(mapped)}",
                field=name[:80],
            )
        data = np.frombuffer(mapped, dtype, count, start + offset).reshape(dims)
        tensors.append(GgufTensor(name, qtype, shape, data, start + offset))
    return GgufFile(fields, tensors, mapped, start)


def _header(cursor: _Cursor, path: Path) -> tuple[dict[str, Any], list[Any]]:
    """The fields and the tensor infos (name, shape, type, offset) of a GGUF header."""
    magic, version = cursor.take("4s"), cursor.take("I")
    if magic != b"GGUF" or version not in (2, 3):
        raise ModelError("not a little-endian GGUF v2/v3 file", field="magic")
    cursor.at = "tensor_count"
    tensor_count = cursor.count("tensors", 24)
    cursor.at = "kv_count"
    kv_count = cursor.count("fields", 12)
    fields: dict[str, Any] = {}
    for i in range(kv_count):
        cursor.at = f"field {i}'s key"
        key = cursor.string()
        cursor.at = key[:80]
        fields[key] = cursor.value(cursor.take("I"))
    infos, names = [], set()
    for i in range(tensor_count):
        cursor.at = f"tensor {i}'s name"
        name = cursor.string()
        cursor.at = f"tensor {name[:80]!r}"
        dims = cursor.take("I")
        if not 1 <= dims <= MAX_DIMS or name in names:
            why = "a second time" if name in names else f"with {dims} dimensions"
            raise ModelError(f"{cursor.at} is listed {why}", field=cursor.at)
        names.add(name)
        shape = tuple(cursor.take("Q") for _ in range(dims))
        infos.append((name, shape, cursor.take("I"), cursor.take("Q")))
    return fields, infos


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
