"""The activation plane's binary wire format (ADR-0008). Imports no HTTP framework.

Names are loaded on first use, so `meshnet.wire.headers` (pure Python) can be imported by the
tracker without pulling in numpy. Nothing here imports torch unless a torch tensor is handed
in (`wire.tensors`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshnet.wire.chunking import Chunk as Chunk
    from meshnet.wire.chunking import ChunkState as ChunkState
    from meshnet.wire.chunking import next_chunk_state as next_chunk_state
    from meshnet.wire.chunking import split_prefill as split_prefill
    from meshnet.wire.frame import Encoded as Encoded
    from meshnet.wire.frame import all_finite as all_finite
    from meshnet.wire.frame import decode as decode
    from meshnet.wire.frame import decode_bits as decode_bits
    from meshnet.wire.frame import encode as encode
    from meshnet.wire.frame import require_finite as require_finite
    from meshnet.wire.frame import tensor_bytes as tensor_bytes
    from meshnet.wire.headers import WIRE_VERSION as WIRE_VERSION
    from meshnet.wire.headers import FrameMeta as FrameMeta

_HOME = {
    "Chunk": "chunking",
    "ChunkState": "chunking",
    "next_chunk_state": "chunking",
    "split_prefill": "chunking",
    "Encoded": "frame",
    "all_finite": "frame",
    "decode": "frame",
    "decode_bits": "frame",
    "encode": "frame",
    "require_finite": "frame",
    "tensor_bytes": "frame",
    "WIRE_VERSION": "headers",
    "FrameMeta": "headers",
}
__all__ = [
    "WIRE_VERSION",
    "Chunk",
    "ChunkState",
    "Encoded",
    "FrameMeta",
    "all_finite",
    "decode",
    "decode_bits",
    "encode",
    "next_chunk_state",
    "require_finite",
    "split_prefill",
    "tensor_bytes",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'meshnet.wire' has no attribute {name!r}")
    return getattr(importlib.import_module(f"meshnet.wire.{_HOME[name]}"), name)
