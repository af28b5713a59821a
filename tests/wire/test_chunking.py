"""Chunked prefill: token-boundary splits and the receiver's sequence checks."""

from __future__ import annotations

import pytest
import torch

from meshnet.errors import WireError
from meshnet.wire import ChunkState, next_chunk_state, split_prefill


@pytest.mark.parametrize(
    ("tokens", "chunk", "lengths"),
    [
        (1, 128, [1]),
        (128, 128, [128]),
        (129, 128, [128, 1]),
        (300, 128, [128, 128, 44]),
        (10, 3, [3, 3, 3, 1]),
    ],
)
def test_split_on_token_boundaries(tokens: int, chunk: int, lengths: list[int]) -> None:
    hidden = torch.randn(1, tokens, 8)
    chunks = split_prefill(hidden, start_position=5, chunk_tokens=chunk)
    assert [c.hidden.shape[1] for c in chunks] == lengths
    assert [c.index for c in chunks] == list(range(len(lengths)))
    assert all(c.total == len(lengths) for c in chunks)
    assert [c.position for c in chunks] == [5 + i * chunk for i in range(len(lengths))]
    assert torch.equal(torch.cat([c.hidden for c in chunks], dim=1), hidden)


def test_split_refuses_zero_chunk() -> None:
    with pytest.raises(ValueError):
        split_prefill(torch.randn(1, 4, 2), 0, chunk_tokens=0)


GOOD = [
    (None, 0, 1, ChunkState(1, 1)),
    (None, 0, 3, ChunkState(3, 1)),
    (ChunkState(3, 1), 1, 3, ChunkState(3, 2)),
    (ChunkState(3, 2), 2, 3, ChunkState(3, 3)),
    (ChunkState(3, 3), 0, 1, ChunkState(1, 1)),  # a decode step after a complete prefill
    (ChunkState(1, 1), 0, 5, ChunkState(5, 1)),
]

BAD = [
    (None, 1, 3, "starts at index 0"),
    (None, 3, 3, "out of range"),
    (None, 0, 0, "out of range"),
    (ChunkState(3, 1), 1, 4, "differs"),
    (ChunkState(3, 1), 2, 3, "expected chunk 1"),
    (ChunkState(3, 1), 0, 3, "expected chunk 1"),
    (ChunkState(3, 3), 1, 3, "starts at index 0"),
]


@pytest.mark.parametrize(("state", "index", "total", "after"), GOOD)
def test_chunk_sequence_accepts(
    state: ChunkState | None, index: int, total: int, after: ChunkState
) -> None:
    assert next_chunk_state(state, index, total) == after


@pytest.mark.parametrize(("state", "index", "total", "words"), BAD)
def test_chunk_sequence_refuses(
    state: ChunkState | None, index: int, total: int, words: str
) -> None:
    with pytest.raises(WireError, match=words):
        next_chunk_state(state, index, total)
