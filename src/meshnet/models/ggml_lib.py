"""ggml through `ggml-python`'s ctypes bindings: one graph a round, inputs and output as numpy.

A `Graph` owns the CPU backend (its thread count) and the graph allocator, whose one buffer
is reused and grown round after round. `Graph.round()` gives a `Builder`: tensors are made in
a fresh no-alloc context, inputs are copied in after allocation, and `run` computes the graph
and copies the output out. Imports no torch.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np

from meshnet.errors import ComputeError, ModelError

try:
    from ggml import ggml as gg
except ImportError as exc:  # pragma: no cover - ggml-python is installed by ./run setup
    raise ModelError(f"the ggml backend needs ggml-python ({exc}); use --backend torch") from exc

__all__ = [
    "F16", "F32", "I32", "I64", "PAD", "Builder", "Graph", "RoundValues", "Tensor", "dequantize",
    "gg", "padded", "set_all_threads", "tensor_bytes",
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
NODES_PER_LAYER = 64  # graph nodes one layer takes, at most


def dequantize(data: np.ndarray, ggml_type: int) -> np.ndarray | None:
    """A quantized tensor's blocks (uint8 [..., bytes a row]) as float32 [..., values a row],
    by ggml's own `to_float` (equal to gguf's numpy reader, ~20x faster: 0.38 s against 8.0 s
    for Gemma 3 270M's quantized tensors here); None for a type that is not quantized."""
    traits = gg.ggml_get_type_traits(ggml_type).contents
    if not traits.is_quantized or not traits.to_float:
        return None
    blocks = np.ascontiguousarray(data, dtype=np.uint8)
    per_row = blocks.shape[-1] // traits.type_size * traits.blck_size
    out = np.empty((*blocks.shape[:-1], per_row), np.float32)
    target = out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    traits.to_float(blocks.ctypes.data_as(ctypes.c_void_p), target, out.size)
    return out


def _nodes(layers: int) -> int:
    return 64 + layers * NODES_PER_LAYER


def tensor_bytes(tensor: Tensor) -> int:
    return int(gg.ggml_nbytes(tensor))


def data_address(tensor: Tensor) -> int:
    return int(tensor.contents.data)


PAD = 256  # a round attends over the pool's cells up to the highest taken, padded to this:
# shapes, and so a round's graph, stay the same while the pool grows within it


def padded(cells: int) -> int:
    return max(PAD, -(-cells // PAD) * PAD)


class RoundValues(Protocol):
    """A round's inputs by name (`models.ggml_cache.PoolRound`)."""

    @property
    def keys(self) -> int:
        """The pool cells the round attends over."""
        ...

    def array(self, name: str) -> np.ndarray: ...


class Builder:
    """One round's graph, in a context that holds no data (ggml allocates): inputs are named
    (`RoundValues`), so a kept graph runs again on another round of the same shape.
    `pool` (a span's `KvPool`) and `positions` / `cells` (every token's position and cache
    cell, I32 / I64 [N]) are set by the span that builds it."""

    def __init__(self, graph: Graph, nodes: int, data: RoundValues | None = None) -> None:
        self.graph = graph
        size = gg.ggml_tensor_overhead() * nodes * 2 + gg.ggml_graph_overhead_custom(nodes, False)
        self.ctx = gg.ggml_init(gg.ggml_init_params(size, None, True))
        self.nodes = nodes
        self.data = data
        self.inputs: dict[str, tuple[Tensor, int]] = {}  # name -> (tensor, kind)
        self.positions: Tensor | None = None
        self.cells: Tensor | None = None
        self.pool: Any = None
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

    def token_inputs(self, pool: Any) -> None:
        """The round's token positions and cells, over `pool`'s keys and values."""
        self.pool = pool
        self.positions = self.input("positions", I32)
        self.cells = self.input("cells", I64)

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


_GRAPHS: weakref.WeakSet[Graph] = weakref.WeakSet()  # every live graph of this process
_chosen: list[int] = []  # the process's thread count once `set_all_threads` set one


def set_all_threads(threads: int) -> None:
    """Every graph of this process, and those made later, computes with `threads` threads
    from its next round (the node's choice, `node/threads.py`)."""
    _chosen[:] = [threads]
    for graph in list(_GRAPHS):
        if graph.backend is not None and graph.threads != threads:
            graph.set_threads(threads)


class Graph:
    """The CPU backend and the graph allocator a span's rounds share."""

    def __init__(self, threads: int | None = None) -> None:
        """`threads`: None for the cores this process may use (its affinity): more threads
        than cores spin at ggml's barriers for a descheduled one (100x slower rounds). A
        count the process chose (`set_all_threads`) comes first."""
        self.backend = gg.ggml_backend_cpu_init()
        self.allocator = gg.ggml_gallocr_new(gg.ggml_backend_cpu_buffer_type())
        self.pool = None
        self._kept: tuple[Hashable, Builder] | None = None
        self.set_threads((_chosen or [threads or len(os.sched_getaffinity(0))])[0])
        _GRAPHS.add(self)

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
    def round(self, layers: int = 0) -> Iterator[Builder]:
        """A one-off round (closed after its block)."""
        build = Builder(self, _nodes(layers))
        try:
            yield build
        finally:
            build.close()

    def kept(self, key: Hashable) -> Builder | None:
        """The last round's graph when `key` (its shape) is the same: still allocated."""
        return self._kept[1] if self._kept is not None and self._kept[0] == key else None

    def keep(self, key: Hashable, layers: int, data: RoundValues | None = None) -> Builder:
        """A new graph for rounds of shape `key`, replacing the kept one."""
        self.drop_kept()
        build = Builder(self, _nodes(layers), data)
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
