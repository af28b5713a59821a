"""The ggml span's shared pool of KV cells gives memory back once its sessions end (review
K1: it only grew), keeping the cells still taken where they were."""

from __future__ import annotations

import numpy as np

from meshnet.models.ggml_cache import KvPool, PoolCache


def test_the_pool_shrinks_when_its_sessions_end_and_keeps_what_is_taken() -> None:
    pool = KvPool(layers=2, width=8)
    first = pool.capacity
    small, big = PoolCache(pool), PoolCache(pool)
    small.extend(0, 10)
    pool.data[:, :, small.cells] = 7.0
    big.extend(0, 8 * first)  # a long prompt: the pool grows
    grown = pool.capacity
    assert grown >= 8 * first
    del big  # its session ends: its cells are free
    small.extend(10, 1)  # the next round's take gives memory back
    assert pool.capacity < grown and pool.capacity >= first
    assert np.all(pool.data[:, :, small.cells[:10]] == 7.0)
    assert np.all(pool.owner[small.cells] == small.owner)
    assert pool.data.nbytes == pool.layers * 2 * pool.capacity * pool.width * 2
