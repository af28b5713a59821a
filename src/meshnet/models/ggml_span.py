"""A GGUF span computed by ggml: the file's weights as it stores them, one graph a round.

The weights are ggml tensors whose data are the file's mapped pages (never widened, copied or
re-quantized); a round (one frame, or many sessions' frames batched) is one ggml graph over
every layer of the span, allocated by ggml's graph allocator and run by its CPU backend. The
family's layer graph comes from the `ggml_graphs` registry. Imports no torch (ADR-0051).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshnet.errors import ModelError
from meshnet.models import ggml_graphs
from meshnet.models.ggml_cache import KvPool, PoolCache, PoolRound
from meshnet.models.ggml_lib import (
    F32,
    Builder,
    Graph,
    Tensor,
    gg,
    padded,
    tensor_bytes,
)
from meshnet.models.gguf_file import GgufFile, read_gguf
from meshnet.types import LayerSpan

log = logging.getLogger(__name__)

# GGML types ggml's CPU backend multiplies by (GGUF's numbering), by name
COMPUTABLE = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16",
}  # fmt: skip


@dataclass(frozen=True)
class SpanShape:
    """What the runner checks frames against, read from the file."""

    hidden_size: int
    max_position_embeddings: int


class MappedWeights:
    """The span's tensors as ggml tensors over the file's read-only map (no copy)."""

    def __init__(self, file: GgufFile, names: Sequence[str], path: Path) -> None:
        self.file = file
        by_name = {t.name: t for t in file.tensors}
        self.ctx = gg.ggml_init(
            gg.ggml_init_params(gg.ggml_tensor_overhead() * len(names) + 1024, None, True)
        )
        base = np.frombuffer(file.mapped, np.uint8) if file.mapped is not None else None
        if base is None:
            raise ModelError(f"{path.name} is not memory-mapped")
        self._base = base
        self.buffer = gg.ggml_backend_cpu_buffer_from_ptr(base.ctypes.data, base.nbytes)
        self.tensors: dict[str, Tensor] = {}
        for name in names:
            if name not in by_name:
                continue
            self.tensors[name] = self._map(by_name[name], path)
        self.bytes = sum(by_name[n].data.nbytes for n in self.tensors)

    def _map(self, tensor: object, path: Path) -> Tensor:
        kind = int(tensor.tensor_type)  # type: ignore[attr-defined]
        name = tensor.name  # type: ignore[attr-defined]
        if kind not in COMPUTABLE:
            raise ModelError(
                f"{path.name}: tensor {name!r} is GGML type {kind}, which meshnet's ggml build "
                f"cannot compute (use --backend torch)"
            )
        shape = tensor.shape  # type: ignore[attr-defined]
        ne = (ctypes.c_int64 * 4)(*shape, *[1] * (4 - len(shape)))
        made = gg.ggml_new_tensor(self.ctx, kind, len(shape), ne)
        data = tensor.data  # type: ignore[attr-defined]
        if tensor_bytes(made) != data.nbytes:
            raise ModelError(
                f"{path.name}: tensor {name!r} holds {data.nbytes} bytes; its type "
                f"{COMPUTABLE[kind]} and shape {shape} need {tensor_bytes(made)}"
            )
        gg.ggml_backend_tensor_alloc(self.buffer, made, data.ctypes.data)
        return made

    def get(self, name: str) -> Tensor | None:
        return self.tensors.get(name)

    def __getitem__(self, name: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelError(f"the file has no tensor {name!r}") from None

    def close(self) -> None:
        if self.buffer is not None:
            gg.ggml_backend_buffer_free(self.buffer)
            gg.ggml_free(self.ctx)
            self.buffer = None


class GgmlSpan:
    """Layers `span` of a GGUF file, computed by ggml over the file's own weights.

    `forward_many` takes each frame's hidden states as float32 [T, H] with its cache and first
    position and returns float32 [T, H] each. The sessions' keys and values share one pool
    (`models/ggml_cache.py`).
    """

    batches = True

    def __init__(self, path: Path, span: LayerSpan, threads: int | None = None) -> None:
        file = read_gguf(path)
        self.arch = str(file.fields.get("general.architecture"))
        self.family = ggml_graphs.get(self.arch)
        self.params = self.family.params(file.fields, self.arch)
        if span.end > self.params.layers:
            raise ModelError(f"layers {span} are outside the model's {self.params.layers} layers")
        self.span = span
        names = [n for i in span for n in self.family.tensor_names(i)]
        self.weights = MappedWeights(file, names, path)
        self.config = SpanShape(self.params.hidden, self.params.context)
        self.graph = Graph(threads)
        self.kv_width = self.params.kv_heads * self.params.head_dim
        self.pool = KvPool(len(span), self.kv_width)  # every session's keys and values
        self.cache_bytes_per_token = 2 * len(span) * self.kv_width * 2  # K and V, f16

    @property
    def weight_bytes(self) -> int:
        return self.weights.bytes

    def new_cache(self) -> PoolCache:
        return PoolCache(self.pool)

    def forward(self, hidden: np.ndarray, cache: PoolCache, position: int) -> np.ndarray:
        """`hidden` float32 [T, H] at `position` -> float32 [T, H]."""
        return self.forward_many([hidden], [cache], [position])[0]

    def forward_many(
        self, hiddens: Sequence[np.ndarray], caches: Sequence[PoolCache], positions: Sequence[int]
    ) -> list[np.ndarray]:
        """Frames of different sessions as one round; on failure every cache is cut back
        to where its frame started."""
        lengths = [h.shape[0] for h in hiddens]
        self.pool.give_back()  # what closed sessions freed (on this, the compute thread)
        try:
            cells = [c.extend(p, n) for c, p, n in zip(caches, positions, lengths, strict=True)]
            out = self._round(hiddens, caches, positions, cells)
        except BaseException:
            for cache, position in zip(caches, positions, strict=True):
                cache.truncate(position)
            raise
        starts = np.cumsum([0, *lengths])
        return [out[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]

    def _round(
        self,
        hiddens: Sequence[np.ndarray],
        caches: Sequence[PoolCache],
        positions: Sequence[int],
        cells: Sequence[np.ndarray],
    ) -> np.ndarray:
        ranges = [np.arange(p, p + len(c)) for p, c in zip(positions, cells, strict=True)]
        owners = [np.full(len(c), cache.owner) for c, cache in zip(cells, caches, strict=True)]
        data = PoolRound(
            np.concatenate(hiddens, axis=0),
            np.concatenate(ranges),
            np.concatenate(cells),
            np.concatenate(owners),
            padded(self.pool.used_cells()),
            self.pool,
        )
        # what the graph's tensors depend on: the round's token count and the pool's size
        shape = (self.pool.data.ctypes.data, self.pool.capacity, len(data.cells), data.keys)
        build = self.graph.kept(shape) or self._build(shape, data)
        try:
            return build.compute(data.array)  # [N, H]
        except Exception:
            self.graph.drop_kept()
            raise

    def _build(self, shape: Hashable, data: PoolRound) -> Builder:
        build = self.graph.keep(shape, len(self.span), data)
        x = build.input("x", F32)  # [H, N]
        build.token_inputs(self.pool)
        for local, index in enumerate(self.span):
            x = self.family.layer(build, self.weights, self.params, index, local, x)
        build.finish(x)
        return build

    def close(self) -> None:
        self.graph.close()
        self.weights.close()
