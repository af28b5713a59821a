"""Read single tensors from checkpoints, by Hugging Face name, one at a time.

`SafetensorsCheckpoint` opens `model.safetensors` or the shards of an index lazily;
`GgufCheckpoint` dequantizes one GGUF tensor at a time and undoes llama.cpp's q/k permutation.
Neither ever materialises the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from meshnet.errors import ModelError
from meshnet.models.gguf_file import read_gguf
from meshnet.models.int4 import Int4Blocks, from_gguf
from meshnet.models.registry import Architecture
from meshnet.models.spec import ModelSpec


class Checkpoint(Protocol):
    """Tensors by Hugging Face name."""

    def has(self, name: str) -> bool: ...

    def read(self, name: str) -> torch.Tensor:
        """The tensor (any float dtype, CPU); raises `ModelError` when absent."""
        ...

    def read_int4(self, name: str) -> Int4Blocks | None:
        """The tensor's 4-bit codes as stored, when it is stored as such (`--quant q4`)."""
        ...

    def release(self) -> None:
        """Done reading for now: give back the memory reading held (mapped file pages)."""
        ...


class SafetensorsCheckpoint:
    """A folder with `model.safetensors` or `model.safetensors.index.json` and its shards."""

    def __init__(self, folder: Path, files: dict[str, str]) -> None:
        self.folder = folder
        self.files = files  # tensor name -> file name in `folder`
        self._open: dict[str, Any] = {}
        self.opened: set[str] = set()  # every file read from, released or not

    @classmethod
    def open(cls, folder: Path) -> SafetensorsCheckpoint:
        return cls(folder, safetensors_index(folder))

    def has(self, name: str) -> bool:
        return name in self.files

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise ModelError(f"tensor {name!r} is missing from the checkpoint in {self.folder}")
        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(str(self.folder / file), framework="pt")
            self.opened.add(file)
        tensor: torch.Tensor = self._open[file].get_tensor(name)
        return tensor

    def read_int4(self, name: str) -> Int4Blocks | None:
        return None  # safetensors hold floats (or other schemes' packing): q4 re-quantizes

    def release(self) -> None:
        self._open.clear()  # closing a file unmaps it; the next read opens it again


def safetensors_index(folder: Path) -> dict[str, str]:
    """Tensor name -> file, from the index or from the single file's header."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return weight_map
    single = folder / "model.safetensors"
    if not single.exists():
        raise ModelError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    with single.open("rb") as f:  # header: 8-byte little-endian length, then JSON
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return {name: single.name for name in header if name != "__metadata__"}


class GgufCheckpoint:
    """A GGUF file read per tensor: dequantized to float32 and renamed to HF names."""

    def __init__(self, path: Path, arch: Architecture, spec: ModelSpec) -> None:
        self.path = path
        self.arch = arch
        self.spec = spec
        self.file = read_gguf(path)
        self.tensors = {t.name: t for t in self.file.tensors}

    def release(self) -> None:
        self.file.release_pages()  # ~2.3 MiB a layer of the default model otherwise stays

    def has(self, name: str) -> bool:
        return self.arch.gguf_name(name, self.spec)[0] in self.tensors

    def read(self, name: str) -> torch.Tensor:
        from gguf.quants import dequantize

        gguf_name, permute = self.arch.gguf_name(name, self.spec)
        if gguf_name not in self.tensors:
            raise ModelError(f"tensor {gguf_name!r} ({name}) is missing from {self.path.name}")
        tensor = self.tensors[gguf_name]
        values = _fast_dequantize(tensor.data, int(tensor.tensor_type))  # a fresh array
        owned = values is not None
        if values is None:  # not quantized (F32, F16...), or no ggml here
            values = dequantize(tensor.data, tensor.tensor_type)  # float32, [out, in] order
        if permute == "plus_one":  # Gemma's norms: llama.cpp keeps 1 + w
            values = values - 1.0
        elif permute is not None:
            heads = self.spec.num_heads if permute == "q" else self.spec.num_kv_heads
            values = unpermute_rope(values, heads)
        if not owned:  # gguf's arrays may view the mapped file: an own, writable copy
            values = np.array(values, dtype=np.float32)
        return torch.from_numpy(values)

    def read_int4(self, name: str) -> Int4Blocks | None:
        """A Q4_0/Q4_1/Q4_K tensor's blocks, rows in Hugging Face order; None for others."""
        gguf_name, permute = self.arch.gguf_name(name, self.spec)
        tensor = self.tensors.get(gguf_name)
        if tensor is None or permute == "plus_one" or len(tensor.shape) != 2:
            return None
        rows, cols = (int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        blocks = from_gguf(tensor.tensor_type.name, tensor.data, (rows, cols))
        if blocks is None or permute is None:
            return blocks
        heads = self.spec.num_heads if permute == "q" else self.spec.num_kv_heads
        return blocks.rows(unpermute_rope(np.arange(rows), heads))


def unpermute_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of rotary halves in q/k rows: [out, ...] -> [out, ...]."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _fast_dequantize(data: np.ndarray, ggml_type: int) -> np.ndarray | None:
    """ggml's C dequantizer where ggml-python is installed (`ggml_lib.dequantize`)."""
    try:
        from meshnet.models.ggml_lib import dequantize
    except ModelError:  # no ggml-python: gguf's numpy reader does it, slower
        return None
    return dequantize(data, ggml_type)
