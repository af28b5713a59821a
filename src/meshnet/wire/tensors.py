"""Frames' activations as torch tensors, for processes that compute with torch.

The wire format itself needs only numpy (`wire.frame`); a node whose spans are all ggml never
imports this module, so it never imports torch (ADR-0052). Every conversion here shares
memory: bf16 bits and a bf16 tensor are the same bytes.
"""

from __future__ import annotations

import numpy as np
import torch

from meshnet.wire.chunking import Chunk

TensorChunk = Chunk[torch.Tensor]  # what an entry's pipeline cuts and sends


def bits_tensor(bits: np.ndarray) -> torch.Tensor:
    """bf16 bits (uint16, any shape) -> a bf16 tensor over the same memory."""
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def as_tensor(hidden: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Activations as a tensor: bits as bf16 (same memory), float arrays as they are."""
    if isinstance(hidden, torch.Tensor):
        return hidden
    if hidden.dtype == np.uint16:
        return bits_tensor(hidden)
    return torch.from_numpy(hidden)


def bf16_bytes(tensor: torch.Tensor) -> memoryview:
    """A view of `tensor` as contiguous little-endian bf16 bytes (no copy for bf16 CPU input)."""
    bf16 = tensor.detach()
    if bf16.dtype != torch.bfloat16 or bf16.device.type != "cpu" or not bf16.is_contiguous():
        bf16 = bf16.to(device="cpu", dtype=torch.bfloat16).contiguous()
    return memoryview(bf16.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def tensor_finite(tensor: torch.Tensor) -> bool:
    return bool(torch.isfinite(tensor).all())
