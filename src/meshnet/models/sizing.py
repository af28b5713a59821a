"""Bytes a layer needs at each quantization, from the config alone (no torch, no weights).

The tracker's planner uses these figures; a test checks them against bytes really loaded.
"""

from __future__ import annotations

from pathlib import Path

from meshnet.models import registry
from meshnet.models.spec import ModelSpec
from meshnet.types import ComputeDtype, Quant

# bytes per weight of a linear layer, and per other parameter (norms, biases), by quantization
_LINEAR_BYTES: dict[Quant, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "int8": 1.0,
    "nf4": 0.5,
    "q4": 0.5,
}
NF4_BLOCK = 64  # weights per absmax scale
Q4_GROUP_BYTES = 2 * 2 / 32  # q4: a bf16 scale and a bf16 offset per 32 weights (`models/int4`)
# int8: bitsandbytes' float32 row scale (`SCB`) plus the fast path's bf16 copy (ADR-0022)
INT8_ROW_BYTES = 4 + 2


def layer_bytes(
    spec: ModelSpec, quant: Quant, compute: ComputeDtype | None = None, packed_nf4: bool = False
) -> int:
    """Bytes of one decoder layer's weights at `quant`, computing in `compute`.

    Non-linear parameters (norms, biases) are kept in the compute dtype: fp32 for fp32
    weights, bf16 for bf16 weights, `compute` for int8/nf4/q4 (None: bf16, the smaller). nf4
    keeps one absmax per 64 weights: float32, or bf16 once bitsandbytes has repacked the
    weights for its AVX512-BF16 kernel (`packed_nf4`; `quantize.local_layer_bytes` knows);
    q4 a bf16 scale and offset per 32.
    The tracker calls this with the defaults; a node sizes its own span exactly.
    """
    if quant not in _LINEAR_BYTES:
        raise ValueError(f"unknown quantization {quant!r} (gguf: `file_layer_bytes`)")
    linear, out_rows, other = registry.get(spec.model_type).layer_params(spec)
    other_bytes = 4 if quant == "fp32" or (quant != "bf16" and compute == "fp32") else 2
    total = linear * _LINEAR_BYTES[quant] + other * other_bytes
    if quant == "int8":
        total += out_rows * INT8_ROW_BYTES
    elif quant == "nf4":
        total += linear / NF4_BLOCK * (2 if packed_nf4 else 4)
    elif quant == "q4":
        total += linear * Q4_GROUP_BYTES
    return int(total)


def file_layer_bytes(path: Path) -> int:
    """Bytes of the largest layer of a GGUF file as it stores them: what a ggml span holds
    per layer ("gguf"; its pages are the file's, ADR-0051). Files mix types across layers
    (Q4_K_M keeps some in Q6_K), so the largest bounds every span."""
    from meshnet.models.gguf_file import read_gguf

    per_layer: dict[str, int] = {}
    for tensor in read_gguf(path).tensors:
        if tensor.name.startswith("blk."):
            index = tensor.name.split(".")[1]
            per_layer[index] = per_layer.get(index, 0) + tensor.data.nbytes
    return max(per_layer.values(), default=0)


def head_bytes(spec: ModelSpec, dtype_bytes: int, int8_lm_head: bool = False) -> int:
    """Bytes of the entry node's head: embeddings, final norm, LM head (unless tied); with
    `int8_lm_head`, the LM head as int8 rows and a bf16 scale per row instead (ADR-0046)."""
    table = spec.vocab_size * spec.hidden_size
    embeddings = (table + spec.hidden_size) * dtype_bytes  # with the final norm
    if int8_lm_head:
        return embeddings + table + 2 * spec.vocab_size
    return embeddings + (0 if spec.tie_word_embeddings else table * dtype_bytes)


def entry_head_bytes(spec: ModelSpec, quant: str) -> int:
    """`head_bytes` of an entry beside layers at `quant` (`quantize.head_dtype`; int8 entries
    multiply by an int8 LM head)."""
    return head_bytes(spec, 4 if quant == "fp32" else 2, int8_lm_head=quant == "int8")


def layers_that_fit(spec: ModelSpec, per_layer_bytes: int, budget_bytes: int) -> int:
    """How many whole layers of `spec`, each `per_layer_bytes`, fit in `budget_bytes` (at
    most all of them)."""
    return max(0, min(spec.num_layers, budget_bytes // per_layer_bytes))
