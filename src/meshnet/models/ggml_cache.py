"""`GgmlCache`: one session's keys and values for a ggml span, F16, in one numpy block.

Layout [layers, 2 (keys, values), capacity, kv_heads * head_dim]; a graph sees each layer's
keys (or values) as a ggml tensor [width, capacity] over this memory (a CPU backend buffer
made from its pointer), writes a round's new rows with `set_rows` and reads rows
[0, position + tokens). Capacity grows by doubling; `length` counts the tokens kept.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from meshnet.models.ggml_lib import F16, Builder, Tensor, gg

_STEP = 64  # capacity grows in multiples of this many tokens
_ALIGN = 64  # bytes: ggml's CPU buffers start on 32-byte boundaries


def _zeros(shape: tuple[int, ...]) -> np.ndarray:
    """F16 zeros whose first byte is `_ALIGN`-aligned."""
    count = int(np.prod(shape))
    raw = np.zeros(count * 2 + _ALIGN, np.uint8)
    skip = -raw.ctypes.data % _ALIGN
    return raw[skip : skip + count * 2].view(np.float16).reshape(shape)


class GgmlCache:
    def __init__(self, layers: int, width: int) -> None:
        self.layers = layers
        self.width = width
        self.length = 0
        self.data = _zeros((layers, 2, 0, width))
        self.buffer: Any = None

    @property
    def capacity(self) -> int:
        return int(self.data.shape[2])

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` tokens; the first `length` are kept."""
        if tokens <= self.capacity:
            return
        capacity = max(tokens, 2 * self.capacity)
        capacity = -(-capacity // _STEP) * _STEP
        grown = _zeros((self.layers, 2, capacity, self.width))
        grown[:, :, : self.length] = self.data[:, :, : self.length]
        self._free_buffer()
        self.data = grown

    def tensor(self, build: Builder, layer: int, which: int) -> Tensor:
        """Layer `layer`'s keys (`which` 0) or values (1): a ggml tensor [width, capacity]."""
        if self.buffer is None:
            self.buffer = gg.ggml_backend_cpu_buffer_from_ptr(self.data.ctypes.data, self.nbytes)
        tensor = build.new(F16, self.width, self.capacity)
        offset = (layer * 2 + which) * self.capacity * self.width * 2
        gg.ggml_backend_tensor_alloc(self.buffer, tensor, self.data.ctypes.data + offset)
        return tensor

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def copy(self, length: int) -> GgmlCache:
        """A new cache holding this one's first `length` tokens."""
        other = GgmlCache(self.layers, self.width)
        other.reserve(length)
        other.data[:, :, :length] = self.data[:, :, :length]
        other.length = length
        return other

    def _free_buffer(self) -> None:
        if self.buffer is not None:
            gg.ggml_backend_buffer_free(self.buffer)
            self.buffer = None

    def __del__(self) -> None:
        self._free_buffer()
