"""ggml through `ggml-python`'s ctypes bindings: one graph a round, inputs and output as numpy.

A `Graph` owns the CPU backend (its thread count) and the graph allocator, whose one buffer
is reused and grown round after round. `Graph.round()` gives a `Builder`: tensors are made in
a fresh no-alloc context, inputs are copied in after allocation, and `run` computes the graph
and copies the output out. Imports no torch.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
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
    "F16",
    "F32",
    "I32",
    "I64",
    "Builder",
    "FrameRef",
    "Graph",
    "Tensor",
    "gg",
    "tensor_bytes",
]

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


def tensor_bytes(tensor: Tensor) -> int:
    return int(gg.ggml_nbytes(tensor))


def data_address(tensor: Tensor) -> int:
    return int(tensor.contents.data)


@dataclass
class FrameRef:
    """One frame of a round: its tokens' columns [start, start + length) of the round's
    activations, its cache, and the cache length it continues."""

    start: int
    length: int
    position: int
    cache: Any  # GgmlCache
    rows: Tensor  # I64 [length]: the cache rows its new keys and values go to


class Builder:
    """Tensors of one round's graph, in a context that holds no data (ggml allocates)."""

    def __init__(self, graph: Graph, nodes: int) -> None:
        self.graph = graph
        size = gg.ggml_tensor_overhead() * nodes * 2 + gg.ggml_graph_overhead_custom(nodes, False)
        self.ctx = gg.ggml_init(gg.ggml_init_params(size, None, True))
        self.nodes = nodes
        self.inputs: list[tuple[Tensor, np.ndarray]] = []
        self.positions: Tensor | None = None
        self.masks: dict[tuple[int, int | None], Tensor] = {}  # attention masks, by frame

    def new(self, kind: int, *ne: int) -> Tensor:
        dims = (ctypes.c_int64 * 4)(*ne, *[1] * (4 - len(ne)))
        return gg.ggml_new_tensor(self.ctx, kind, len(ne), dims)

    def input(self, array: np.ndarray, kind: int) -> Tensor:
        """A tensor filled from `array` (C order, so ggml's ne is its shape reversed)."""
        array = np.ascontiguousarray(array, dtype=_NUMPY[kind])
        tensor = self.new(kind, *reversed(array.shape))
        gg.ggml_set_input(tensor)
        self.inputs.append((tensor, array))
        return tensor

    def input_f32(self, array: np.ndarray) -> Tensor:
        return self.input(array, F32)

    def frames(
        self, caches: Sequence[Any], positions: Sequence[int], lengths: Sequence[int]
    ) -> list[FrameRef]:
        """The round's frames, and the positions of all its tokens (`self.positions`)."""
        refs: list[FrameRef] = []
        start, pos = 0, list[int]()
        for cache, position, length in zip(caches, positions, lengths, strict=True):
            rows = self.input(np.arange(position, position + length), I64)
            refs.append(FrameRef(start, length, position, cache, rows))
            pos.extend(range(position, position + length))
            start += length
        self.positions = self.input(np.asarray(pos), I32)
        return refs

    def run(self, out: Tensor) -> np.ndarray:
        """Compute the graph ending at `out` [H, N] f32; its values as a new array [N, H]."""
        gg.ggml_set_output(out)
        graph = gg.ggml_new_graph_custom(self.ctx, self.nodes, False)
        gg.ggml_build_forward_expand(graph, out)
        if not gg.ggml_gallocr_alloc_graph(self.graph.allocator, graph):
            raise ComputeError("ggml could not allocate the round's graph")
        for tensor, array in self.inputs:
            ctypes.memmove(data_address(tensor), array.ctypes.data, array.nbytes)
        status = gg.ggml_backend_graph_compute(self.graph.backend, graph)
        if status != gg.GGML_STATUS_SUCCESS:
            raise ComputeError(f"ggml's graph computation failed (status {status})")
        count = tensor_bytes(out) // 4
        values = (ctypes.c_float * count).from_address(data_address(out))
        return np.ctypeslib.as_array(values).reshape(-1, out.contents.ne[0]).copy()

    def close(self) -> None:
        gg.ggml_free(self.ctx)


class Graph:
    """The CPU backend and the graph allocator a span's rounds share."""

    def __init__(self, threads: int = 1) -> None:
        self.backend = gg.ggml_backend_cpu_init()
        self.allocator = gg.ggml_gallocr_new(gg.ggml_backend_cpu_buffer_type())
        self.pool = None
        self.set_threads(threads)

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
    def round(self, layers: int, frames: int) -> Iterator[Builder]:
        build = Builder(self, 64 + layers * (NODES_PER_LAYER + NODES_PER_FRAME * frames))
        try:
            yield build
        finally:
            build.close()

    def held_bytes(self) -> int:
        """Bytes of the allocator's compute buffer (intermediate activations)."""
        return int(gg.ggml_gallocr_get_buffer_size(self.allocator, 0))

    def close(self) -> None:
        if self.backend is not None:
            gg.ggml_gallocr_free(self.allocator)
            gg.ggml_backend_free(self.backend)
            gg.ggml_threadpool_free(self.pool)
            self.backend = None
