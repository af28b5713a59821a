"""ggml through `ggml-python`'s ctypes bindings: one graph a round, inputs and output as numpy.

A `Graph` owns the CPU backend (its thread count) and the graph allocator, whose one buffer
is reused and grown round after round. `Graph.round()` gives a `Builder`: tensors are made in
a fresh no-alloc context, inputs are copied in after allocation, and `run` computes the graph
and copies the output out. Imports no torch.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshnet.errors import ComputeError, ModelError

try:
    from ggml import ggml as gg
except ImportError as exc:  # pragma: no cover - ggml-python is installed by ./run setup
    raise ModelError(f"the ggml backend needs ggml-python ({exc}); use --backend torch") from exc

__all__ = [
    "F16", "F32", "I32", "I64", "PAD", "Builder", "FrameRef", "Graph", "RoundData", "Tensor",
    "gg", "padded", "tensor_bytes",
]  # fmt: skip

Tensor = Any  # a ctypes pointer to a ggml_tensor


def _fix_pointer_results() -> None:
    """A few of ggml-python's bindings declare a handle's result as a `NewType` of int, which
    ctypes reads as a C int (a truncated pointer: a crash at first use); they return
    pointers."""
    for value in vars(gg).values():
        restype = getattr(value, "restype", None)
        if callable(restype) and hasattr(restype, "__supertype__"):
            value.restype = ctypes.c_void_p


_fix_pointer_results()

F32, F16, I32, I64 = gg.GGML_TYPE_F32, gg.GGML_TYPE_F16, gg.GGML_TYPE_I32, gg.GGML_TYPE_I64
_NUMPY = {F32: np.float32, F16: np.float16, I32: np.int32, I64: np.int64}
NODES_PER_LAYER = 48  # graph nodes one layer takes besides its frames' attention
NODES_PER_FRAME = 24  # a frame's attention in one layer


def _nodes(layers: int, frames: int) -> int:
    return 64 + layers * (NODES_PER_LAYER + NODES_PER_FRAME * frames)


def tensor_bytes(tensor: Tensor) -> int:
    return int(gg.ggml_nbytes(tensor))


def data_address(tensor: Tensor) -> int:
    return int(tensor.contents.data)


PAD = 64  # a frame attends over its cache rows padded to this many (masked): shapes, and so
# a decode step's graph, stay the same for PAD tokens and the graph is reused


def padded(tokens: int) -> int:
    return -(-tokens // PAD) * PAD


@dataclass
class FrameRef:
    """One frame of a round: its tokens' columns [start, start + length) of the round's
    activations, its cache and the cache rows it attends over ([0, keys), padded)."""

    index: int
    start: int
    length: int
    keys: int
    cache: Any  # GgmlCache
    rows: Tensor  # I64 [length]: the cache rows its new keys and values go to


@dataclass(frozen=True)
class RoundData:
    """The values of a round's inputs, by name: `x` (the activations [N, H]), `positions`
    (every token's), `rows:i` (frame i's new cache rows) and `mask:i:window` (frame i's
    attention mask [keys, T] in F16: 0 where its query may see a key, -inf elsewhere)."""

    hidden: np.ndarray
    positions: tuple[int, ...]
    lengths: tuple[int, ...]
    keys: tuple[int, ...]

    def array(self, name: str) -> np.ndarray:
        if name == "x":
            return self.hidden
        if name == "positions":
            return np.concatenate([self._rows(i) for i in range(len(self.lengths))])
        kind, index, window = (name.split(":") + [""])[:3]
        if kind == "rows":
            return self._rows(int(index))
        return self._mask(int(index), int(window) if window != "None" else None)

    def _rows(self, index: int) -> np.ndarray:
        start = self.positions[index]
        return np.arange(start, start + self.lengths[index])

    def _mask(self, index: int, window: int | None) -> np.ndarray:
        query = self._rows(index)[:, None]
        keys = np.arange(self.keys[index])[None, :]
        seen = keys <= query
        if window:
            seen &= keys > query - window
        return np.where(seen, 0.0, -np.inf)


class Builder:
    """One round's graph, in a context that holds no data (ggml allocates): inputs are named
    (`RoundData`), so a kept graph runs again on another round of the same shape."""

    def __init__(self, graph: Graph, nodes: int, data: RoundData | None = None) -> None:
        self.graph = graph
        size = gg.ggml_tensor_overhead() * nodes * 2 + gg.ggml_graph_overhead_custom(nodes, False)
        self.ctx = gg.ggml_init(gg.ggml_init_params(size, None, True))
        self.nodes = nodes
        self.data = data
        self.inputs: dict[str, tuple[Tensor, int]] = {}  # name -> (tensor, kind)
        self.positions: Tensor | None = None
        self.cgraph: Any = None
        self.out: Tensor | None = None

    def new(self, kind: int, *ne: int) -> Tensor:
        dims = (ctypes.c_int64 * 4)(*ne, *[1] * (4 - len(ne)))
        return gg.ggml_new_tensor(self.ctx, kind, len(ne), dims)

    def input(self, name: str, kind: int, shape: Sequence[int] | None = None) -> Tensor:
        """Input `name`, of `shape` (C order; ggml's ne is it reversed), or of the shape of
        its value in the round's data."""
        if name in self.inputs:
            return self.inputs[name][0]
        if shape is None:
            assert self.data is not None  # noqa: S101 - rounds without data give shapes
            shape = self.data.array(name).shape
        tensor = self.new(kind, *reversed(shape))
        gg.ggml_set_input(tensor)
        self.inputs[name] = (tensor, kind)
        return tensor

    def frames(self, caches: Sequence[Any]) -> list[FrameRef]:
        """The round's frames, and the positions of all its tokens (`self.positions`)."""
        assert self.data is not None  # noqa: S101
        refs, start = [], 0
        for i, (cache, length) in enumerate(zip(caches, self.data.lengths, strict=True)):
            rows = self.input(f"rows:{i}", I64)
            refs.append(FrameRef(i, start, length, self.data.keys[i], cache, rows))
            start += length
        self.positions = self.input("positions", I32)
        return refs

    def finish(self, out: Tensor) -> None:
        """Build the graph ending at `out` and allocate it."""
        gg.ggml_set_output(out)
        self.out, self.cgraph = out, gg.ggml_new_graph_custom(self.ctx, self.nodes, False)
        gg.ggml_build_forward_expand(self.cgraph, out)
        if not gg.ggml_gallocr_alloc_graph(self.graph.allocator, self.cgraph):
            raise ComputeError("ggml could not allocate the round's graph")

    def compute(self, values: Callable[[str], np.ndarray]) -> np.ndarray:
        """Fill the inputs from `values`, compute; the output [.., ne0] as a new array."""
        for name, (tensor, kind) in self.inputs.items():
            array = np.ascontiguousarray(values(name), dtype=_NUMPY[kind])
            if array.nbytes != tensor_bytes(tensor):
                raise ComputeError(f"input {name} holds {array.nbytes} bytes, not the graph's")
            ctypes.memmove(data_address(tensor), array.ctypes.data, array.nbytes)
        status = gg.ggml_backend_graph_compute(self.graph.backend, self.cgraph)
        if status != gg.GGML_STATUS_SUCCESS:
            raise ComputeError(f"ggml's graph computation failed (status {status})")
        out = self.out
        if out is None:
            raise ComputeError("a round computed before its graph was finished")
        count = tensor_bytes(out) // 4
        values_out = (ctypes.c_float * count).from_address(data_address(out))
        return np.ctypeslib.as_array(values_out).reshape(-1, out.contents.ne[0]).copy()

    def close(self) -> None:
        gg.ggml_free(self.ctx)


class Graph:
    """The CPU backend and the graph allocator a span's rounds share."""

    def __init__(self, threads: int | None = None) -> None:
        """`threads`: None for the cores this process may use (its affinity): more threads
        than cores spin at ggml's barriers for a descheduled one (100x slower rounds)."""
        self.backend = gg.ggml_backend_cpu_init()
        self.allocator = gg.ggml_gallocr_new(gg.ggml_backend_cpu_buffer_type())
        self.pool = None
        self._kept: tuple[Hashable, Builder] | None = None
        self.set_threads(threads or len(os.sched_getaffinity(0)))

    def set_threads(self, threads: int) -> None:
        """Compute with `threads` threads, kept in a pool between rounds (a pool made for
        each round costs its threads' start-up every token)."""
        self.threads = max(1, threads)
        params = gg.ggml_threadpool_params_default(self.threads)
        pool = gg.ggml_threadpool_new(ctypes.byref(params))
        gg.ggml_backend_cpu_set_n_threads(self.backend, self.threads)
        gg.ggml_backend_cpu_set_threadpool(self.backend, pool)
        if self.pool is not None:
            gg.ggml_threadpool_free(self.pool)
        self.pool = pool

    @contextmanager
    def round(self, layers: int = 0, frames: int = 0) -> Iterator[Builder]:
        """A one-off round (closed after its block)."""
        build = Builder(self, _nodes(layers, frames))
        try:
            yield build
        finally:
            build.close()

    def kept(self, key: Hashable) -> Builder | None:
        """The last round's graph when `key` (its shape) is the same: still allocated."""
        return self._kept[1] if self._kept is not None and self._kept[0] == key else None

    def keep(self, key: Hashable, layers: int, data: RoundData | None = None) -> Builder:
        """A new graph for rounds of shape `key`, replacing the kept one."""
        self.drop_kept()
        build = Builder(self, _nodes(layers, len(data.lengths) if data else 0), data)
        self._kept = (key, build)
        return build

    def kept_builder(self) -> Builder | None:
        return self._kept[1] if self._kept is not None else None

    def drop_kept(self) -> None:
        if self._kept is not None:
            self._kept[1].close()
            self._kept = None

    def held_bytes(self) -> int:
        """Bytes of the allocator's compute buffer (intermediate activations)."""
        return int(gg.ggml_gallocr_get_buffer_size(self.allocator, 0))

    def close(self) -> None:
        if self.backend is not None:
            self.drop_kept()
            gg.ggml_gallocr_free(self.allocator)
            gg.ggml_backend_free(self.backend)
            gg.ggml_threadpool_free(self.pool)
            self.backend = None
