"""The activation plane's binary wire format (ADR-0008). Imports no HTTP framework."""

from meshnet.wire.chunking import Chunk, ChunkState, next_chunk_state, split_prefill
from meshnet.wire.frame import Encoded, decode, encode, tensor_bytes
from meshnet.wire.headers import WIRE_VERSION, FrameMeta

__all__ = [
    "WIRE_VERSION",
    "Chunk",
    "ChunkState",
    "Encoded",
    "FrameMeta",
    "decode",
    "encode",
    "next_chunk_state",
    "split_prefill",
    "tensor_bytes",
]
