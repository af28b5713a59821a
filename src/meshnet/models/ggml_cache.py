"""The keys and values of a ggml span's sessions: one F16 pool of cells, shared.

Layout [layers, 2 (keys, values), capacity, kv_heads * head_dim]; a cell holds one token of
one session. A round writes its tokens' cells with `set_rows` and attends over the pool's
first cells (up to the highest one taken, padded) with one mask: a query sees the cells of
its own session at positions up to its own (and within its window). So a round of many
sessions is one attention per layer, and its graph depends only on the round's token count
and the pool's size: decode steps reuse it (ADR-0051). `PoolCache` is a session's view: its
cells in position order; cutting it (rewinds) frees cells, copying it (forks) takes new ones.

A kept prefix (ADR-0058) leaves the pool (`PoolCache.stow`): every round attends over the
pool's taken cells, so prefixes kept there would slow every live session's steps.

The pool grows and keeps its size (a change of size changes the rounds' graphs), but the
pages of free cells past the highest taken one go back to the system (`give_back`, review
K1): the pool's memory is an anonymous mapping, and those pages read as zeros when next taken.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from itertools import count
from typing import Any

import numpy as np

from meshnet.models.ggml_lib import F16, Builder, Tensor, gg

_FIRST_CELLS = 256
GIVE_BACK_BYTES = 1 << 20  # in all: less is not worth the page faults when taken again
_owners = count(1)


def _zeros(shape: tuple[int, ...]) -> tuple[mmap.mmap, np.ndarray]:
    """F16 zeros in an anonymous mapping of their own (page-aligned: ggml's CPU buffers want
    32-byte boundaries), and the mapping, whose pages `give_back` returns."""
    size = int(np.prod(shape)) * 2
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # DONTNEED frees
    return mapping, np.frombuffer(mapping, np.float16).reshape(shape)


class KvPool:
    def __init__(self, layers: int, width: int) -> None:
        self.layers = layers
        self.width = width
        self.mapping, self.data = _zeros((layers, 2, _FIRST_CELLS, width))
        self.owner = np.full(_FIRST_CELLS, -1, np.int64)  # the session of each cell, -1 free
        self.position = np.zeros(_FIRST_CELLS, np.int64)  # its token's position
        self.buffer: Any = None
        self.resident = 0  # cells below which pages may be held (written since given back)

    @property
    def capacity(self) -> int:
        return int(self.owner.shape[0])

    def used_cells(self) -> int:
        """Cells a round must attend over: up to the highest one taken."""
        taken = np.flatnonzero(self.owner >= 0)
        return int(taken[-1]) + 1 if taken.size else 0

    def take(self, owner: int, positions: np.ndarray) -> np.ndarray:
        """Cells for `owner`'s tokens at `positions`, the lowest free first."""
        free = np.flatnonzero(self.owner < 0)
        while free.size < len(positions):
            self._grow()
            free = np.flatnonzero(self.owner < 0)
        cells = free[: len(positions)]
        self.owner[cells], self.position[cells] = owner, positions
        if cells.size:
            self.resident = max(self.resident, int(cells[-1]) + 1)
        return cells

    def release(self, cells: np.ndarray) -> None:
        self.owner[cells] = -1

    def give_back(self) -> int:
        """Return the pages of the free cells past the highest taken one (in each layer's
        keys and values) to the system; bytes given back. On the compute thread only: a
        round's new cells must not be given back under it."""
        used, cell = self.used_cells(), self.width * 2
        if (self.resident - used) * cell * self.layers * 2 < GIVE_BACK_BYTES:
            return 0
        block, page, given = self.capacity * cell, mmap.PAGESIZE, 0
        for b in range(self.layers * 2):
            start = -(-(b * block + used * cell) // page) * page  # whole pages only
            end = (b * block + self.resident * cell) // page * page
            if end > start:
                self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
                given += end - start
        self.resident = used
        return given

    def _grow(self) -> None:
        capacity, used = 2 * self.capacity, self.used_cells()
        mapping, grown = _zeros((self.layers, 2, capacity, self.width))
        grown[:, :, :used] = self.data[:, :, :used]  # free cells' contents never matter
        self.owner = np.concatenate([self.owner, np.full(self.capacity, -1, np.int64)])
        self.position = np.concatenate([self.position, np.zeros(self.capacity, np.int64)])
        self._free_buffer()
        self.mapping, self.data, self.resident = mapping, grown, used

    def tensor(self, build: Builder, layer: int, which: int) -> Tensor:
        """Layer `layer`'s keys (`which` 0) or values (1): a ggml tensor [width, capacity]."""
        if self.buffer is None:
            self.buffer = gg.ggml_backend_cpu_buffer_from_ptr(
                self.data.ctypes.data, self.data.nbytes
            )
        tensor = build.new(F16, self.width, self.capacity)
        offset = (layer * 2 + which) * self.capacity * self.width * 2
        gg.ggml_backend_tensor_alloc(self.buffer, tensor, self.data.ctypes.data + offset)
        return tensor

    def mask(
        self, owners: np.ndarray, positions: np.ndarray, keys: int, window: int | None
    ) -> np.ndarray:
        """[N, keys]: 0 where query i (of session `owners[i]` at `positions[i]`) may see cell
        j, -inf elsewhere."""
        owner, position = self.owner[None, :keys], self.position[None, :keys]
        query = positions[:, None]
        seen = (owner == owners[:, None]) & (position <= query)
        if window:
            seen &= position > query - window
        return np.where(seen, 0.0, -np.inf)

    def _free_buffer(self) -> None:
        if self.buffer is not None:
            gg.ggml_backend_buffer_free(self.buffer)
            self.buffer = None

    def __del__(self) -> None:
        self._free_buffer()


class PoolCache:
    """One session's cells of a `KvPool`, in position order (cell i holds position i)."""

    def __init__(self, pool: KvPool) -> None:
        self.pool = pool
        self.owner = next(_owners)
        self.cells = np.zeros(0, np.int64)

    @property
    def length(self) -> int:
        return int(self.cells.shape[0])

    @property
    def nbytes(self) -> int:
        return self.length * self.pool.layers * 2 * self.pool.width * 2

    def extend(self, position: int, tokens: int) -> np.ndarray:
        """Cells for tokens [position, position + tokens); the session holds `position`."""
        self.truncate(position)
        new = self.pool.take(self.owner, np.arange(position, position + tokens))
        self.cells = np.concatenate([self.cells, new])
        return new

    def truncate(self, length: int) -> None:
        if length < self.length:
            self.pool.release(self.cells[length:])
            self.cells = self.cells[:length]

    def copy(self, length: int) -> PoolCache:
        """A new session holding this one's first `length` tokens (copied cells)."""
        other = PoolCache(self.pool)
        cells = other.extend(0, length)
        self.pool.data[:, :, cells] = self.pool.data[:, :, self.cells[:length]]
        return other

    def stow(self) -> StowedCache:
        """This session's keys and values moved out of the pool (its cells freed)."""
        stowed = StowedCache(self.pool, self.pool.data[:, :, self.cells].copy())
        self.truncate(0)
        return stowed

    def __del__(self) -> None:
        mine = self.cells[self.pool.owner[self.cells] == self.owner]
        self.pool.release(mine)


class StowedCache:
    """A kept prefix's keys and values outside the pool, [layers, 2, length, width] F16:
    forks copy them back in."""

    def __init__(self, pool: KvPool, data: np.ndarray) -> None:
        self.pool = pool
        self.data = data

    @property
    def length(self) -> int:
        return int(self.data.shape[2])

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def copy(self, length: int) -> PoolCache:
        """A new session in the pool holding the first `length` tokens."""
        other = PoolCache(self.pool)
        cells = other.extend(0, length)
        self.pool.data[:, :, cells] = self.data[:, :, :length]
        return other

    def truncate(self, length: int) -> None:
        self.data = self.data[:, :, :length]


@dataclass(frozen=True)
class PoolRound:
    """A round's inputs by name (`ggml_lib.RoundValues`): `x` (activations [N, H]),
    `positions` and `cells` (each token's), `mask:<window>` ([N, keys] F16, per window)."""

    hidden: np.ndarray
    positions: np.ndarray
    cells: np.ndarray
    owners: np.ndarray  # each token's session (`PoolCache.owner`)
    keys: int
    pool: KvPool

    def array(self, name: str) -> np.ndarray:
        if name == "x":
            return self.hidden
        if name in ("positions", "cells"):
            return self.positions if name == "positions" else self.cells
        window = name.split(":")[1]
        return self.pool.mask(
            self.owners, self.positions, self.keys, int(window) if window != "None" else None
        )
