"""Bytes a layer needs at each quantization, from the config alone (no torch, no weights).

The tracker's planner uses these figures; a test checks them against bytes really loaded.
"""

from __future__ import annotations

from pathlib import Path

from meshnet.models import registry
from meshnet.models.quant import scheme_of
from meshnet.models.spec import ModelSpec
from meshnet.types import CONVERSIONS, ComputeDtype, Quant


def layer_bytes(
    spec: ModelSpec, quant: Quant, compute: ComputeDtype | None = None, packed_nf4: bool = False
) -> int:
    """Bytes of one decoder layer's weights at `quant`, computing in `compute`.

    Linear weights cost the scheme's bytes per weight plus its scales (`models/quant/`);
    non-linear parameters (norms, biases) stay in the compute dtype: `compute` for schemes
    that compute in the preferred dtype (None: bf16, the smaller). nf4's absmax scales are
    bf16 once bitsandbytes has repacked the weights for its AVX512-BF16 kernel (`packed_nf4`;
    `quantize.local_layer_bytes` knows). The tracker calls this with the defaults; a node
    sizes its own span exactly.
    """
    found = scheme_of(quant)
    if found.file_types:
        raise ValueError(f"{quant} keeps the file's types: see `file_layer_bytes`")
    linear, out_rows, other = registry.get(spec.model_type).layer_params(spec)
    total = linear * found.linear_bytes + other * found.other_bytes(compute)
    return int(total + found.scale_bytes(linear, out_rows, packed_nf4))


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


def file_conversions(path: Path) -> tuple[Quant, ...]:
    """The conversions whose copies of a GGUF file's layers keep its weights, by the types
    of its layer matrices ("Q4_K", "Q6_K"...): what a tracker serves it in (ADR-0060)."""
    from meshnet.models.gguf_file import read_gguf

    tensors = read_gguf(path).tensors
    types = frozenset(
        t.tensor_type.name for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2
    )
    return tuple(q for q in CONVERSIONS if scheme_of(q).keeps_file_weights(types))


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
    found = scheme_of(quant)
    return head_bytes(spec, found.head_bytes_per_value, int8_lm_head=found.int8_lm_head)


def layers_that_fit(spec: ModelSpec, per_layer_bytes: int, budget_bytes: int) -> int:
    """How many whole layers of `spec`, each `per_layer_bytes`, fit in `budget_bytes` (at
    most all of them)."""
    return max(0, min(spec.num_layers, budget_bytes // per_layer_bytes))
