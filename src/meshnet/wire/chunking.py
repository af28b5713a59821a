"""Chunked prefill (ADR-0008): split a prompt's activations on token boundaries.

A sender cuts a `[1, T, H]` prefill into chunks of at most `chunk_tokens` tokens; each chunk
carries its index, the total, and the absolute position of its first token. A receiver checks
each incoming chunk against what it saw earlier in the same session with `next_chunk_state`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from meshnet.errors import WireError
from meshnet.wire import headers as h


class Sliceable(Protocol):
    """Activations `[batch, tokens, hidden]`: bf16 bits (numpy) or a torch tensor."""

    @property
    def shape(self) -> Any: ...

    def __getitem__(self, key: Any) -> Any: ...


H = TypeVar("H", bound=Sliceable)


@dataclass(frozen=True)
class Chunk(Generic[H]):
    """One slice of a prefill: tokens `[position, position + hidden.shape[1])`."""

    hidden: H  # [1, tokens, hidden], a view into the prompt's tensor
    position: int
    index: int
    total: int


def split_prefill(hidden: H, start_position: int, chunk_tokens: int = 128) -> list[Chunk[H]]:
    """Split `[batch, T, H]` into chunks of at most `chunk_tokens` tokens (views, no copies)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    starts = range(0, max(1, hidden.shape[1]), chunk_tokens)
    pieces = [hidden[:, at : at + chunk_tokens] for at in starts]
    return [
        Chunk(piece, start_position + i * chunk_tokens, i, len(pieces))
        for i, piece in enumerate(pieces)
    ]


@dataclass(frozen=True)
class ChunkState:
    """What a receiver remembers of a session's current chunk sequence."""

    total: int
    next_index: int  # == total once the sequence is complete


def next_chunk_state(state: ChunkState | None, index: int, total: int) -> ChunkState:
    """Check that chunk `index` of `total` may come now; return the state after it.

    A new sequence starts at index 0 once the previous one completed (or with no previous);
    within a sequence, chunks come in order and the total never changes.
    """
    if not 0 <= index < total:
        raise WireError(f"chunk index {index} out of range for total {total}", field=h.CHUNK_INDEX)
    in_progress = state is not None and state.next_index < state.total
    if in_progress and state is not None:
        if total != state.total:
            raise WireError(
                f"chunk total {total} differs from {state.total} earlier in this session",
                field=h.CHUNK_TOTAL,
            )
        if index != state.next_index:
            raise WireError(f"expected chunk {state.next_index}, got {index}", field=h.CHUNK_INDEX)
    elif index != 0:
        raise WireError(f"a chunk sequence starts at index 0, got {index}", field=h.CHUNK_INDEX)
    return ChunkState(total=total, next_index=index + 1)
