"""`QuantScheme`: everything meshnet knows about one weight quantization, without torch.

A scheme says what a layer's weights cost (bytes per linear weight, the scales beside them,
the dtype of the other parameters), what the layers compute in, how a linear is swapped for
its quantized form (a function loaded only when a layer is built: torch, bitsandbytes), what
it asks of the device, how far two honest copies may differ in a spot check, and what the
entry's head is beside such layers. Each scheme lives in its own module of this package;
`models/quant/__init__.py` keeps the table, and nothing outside the package branches on a
quantization's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from meshnet.types import ComputeDtype, Quant

# what the layers compute in: a fixed dtype, or the process's preferred one (ADR-0024)
Compute = Literal["fp32", "bf16", "preferred"]


@dataclass(frozen=True)
class Linear:
    """One linear layer's weights as a swap gets them (torch tensors; typed loosely here so
    that sizing never imports torch)."""

    weight: Any  # [out, in], float
    bias: Any  # [out] or None
    path: str  # its module path in the layer: "mlp.up_proj"
    blocks: Any = None  # the 4-bit blocks the file holds for it (q4), or None


@dataclass(frozen=True)
class QuantScheme:
    name: Quant
    linear_bytes: float  # bytes per weight of a linear layer
    compute: Compute
    # scales beside the weights: (linear weights, output rows, nf4 repacked for bf16) -> bytes
    scale_bytes: Callable[[int, int, bool], float] = lambda linear, rows, packed: 0.0
    # the linear swap, importing torch when called (None: the layer is only cast to its dtype)
    swap: Callable[[Linear, Any, str], Any] | None = None
    keeps_file_blocks: frozenset[str] = frozenset()  # GGUF block types it keeps as they are (q4)
    file_types: bool = False  # keeps the file's own types: ggml computes it, nothing sizes it
    repacked_for_bf16: bool = False  # bitsandbytes repacks it on an AVX512-BF16 CPU (nf4)
    # re-quantizes weights to 4 bits of its own: its copies part from others by more than
    # rounding, so spot checks give them the loose tolerance (none in a GGUF mesh: ADR-0060)
    four_bit: bool = False
    int8_lm_head: bool = False  # its entry multiplies by int8 rows of the LM head (ADR-0046)
    check: Callable[[str], None] | None = None  # (device): ConfigError where it cannot run

    def other_bytes(self, compute: ComputeDtype | None) -> int:
        """Bytes per non-linear parameter (norms, biases): they stay in the compute dtype
        (`compute` for the preferred one; None: bf16, the smaller)."""
        if self.compute == "fp32" or (self.compute == "preferred" and compute == "fp32"):
            return 4
        return 2

    def keeps_file_weights(self, block_types: frozenset[str]) -> bool:
        """Whether its copy of a GGUF file's layers whose matrices are of `block_types`
        computes the file's own weights (to within 8-bit rounding: measured against ggml
        <= 0.064 for fp32, bf16, int8; q4 of a Q4 file 0.023, of a Q4_K_M file 0.136 and nf4
        0.18, spans of SmolLM2 and Gemma 3, ADR-0060): all but the 4-bit schemes, and those
        where they keep every block as it is."""
        return not self.four_bit or block_types <= self.keeps_file_blocks

    @property
    def head_bytes_per_value(self) -> int:
        """The entry's head beside these layers: fp32 beside fp32 layers, else bf16."""
        return 4 if self.compute == "fp32" else 2
