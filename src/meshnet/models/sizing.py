"""Bytes a layer needs at each quantization, from the config alone (no torch, no weights).

The tracker's planner uses these figures; a test checks them against bytes really loaded.
"""

from __future__ import annotations

from meshnet.models import registry
from meshnet.models.spec import ModelSpec

# bytes per weight of a linear layer, and per other parameter (norms, biases), by quantization
_LINEAR_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "nf4": 0.5}
QUANTS = tuple(_LINEAR_BYTES)
NF4_BLOCK = 64  # one float32 absmax per block of 64 weights


def layer_bytes(spec: ModelSpec, quant: str, *, compute_bytes: int | None = None) -> int:
    """Bytes of one decoder layer's weights at `quant`.

    `compute_bytes` is the element size of non-linear parameters (norms, biases); it defaults
    to 4 for fp32 and 2 otherwise (int8/nf4 keep those in the compute dtype).
    """
    if quant not in _LINEAR_BYTES:
        raise ValueError(f"unknown quantization {quant!r}")
    linear, out_rows, other = registry.get(spec.model_type).layer_params(spec)
    other_bytes = compute_bytes if compute_bytes is not None else (4 if quant == "fp32" else 2)
    total = linear * _LINEAR_BYTES[quant] + other * other_bytes
    if quant == "int8":
        total += out_rows * 4  # one float32 scale per output row
    elif quant == "nf4":
        total += linear / NF4_BLOCK * 4
    return int(total)


def head_bytes(spec: ModelSpec, dtype_bytes: int) -> int:
    """Bytes of the entry node's head: embeddings, final norm, LM head (unless tied)."""
    matrices = 1 if spec.tie_word_embeddings else 2
    return (matrices * spec.vocab_size + 1) * spec.hidden_size * dtype_bytes


def layers_that_fit(spec: ModelSpec, quant: str, budget_bytes: int) -> int:
    """How many whole layers of `spec` at `quant` fit in `budget_bytes` (at most all of them)."""
    return max(0, min(spec.num_layers, budget_bytes // layer_bytes(spec, quant)))
