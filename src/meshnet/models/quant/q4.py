"""q4: a GGUF file's 4-bit blocks kept as they are (`models/int4.py`), for PyTorch's int4
CPU kernel; a bf16 scale and a bf16 offset per 32 weights. CPU nodes only."""

from __future__ import annotations

from typing import Any

from meshnet.errors import ConfigError
from meshnet.models.quant.scheme import Linear, QuantScheme
from meshnet.types import device_kind

GROUP_BYTES = 2 * 2 / 32  # a bf16 scale and a bf16 offset per 32 weights
KEPT_BLOCKS = frozenset({"Q4_0", "Q4_1", "Q4_K"})  # GGUF types whose codes it keeps exactly


def swap(linear: Linear, dtype: Any, device: str) -> Any:
    """`linear` as an `Int4Linear` of the file's own blocks, or of its weight quantized."""
    from meshnet.models import int4

    q4 = linear.blocks or int4.from_float(linear.weight, linear.path)
    bias = None if linear.bias is None else linear.bias.detach().to(dtype)
    return int4.Int4Linear(q4, bias, linear.path)


def check(device: str) -> None:
    """q4 runs on CPU nodes whose PyTorch packs int4 weights; a clear error otherwise."""
    from meshnet.models.int4 import int4_kernel_runs

    if device_kind(device) != "cpu":
        raise ConfigError(f"--quant q4 runs on CPU nodes only, not {device}; use int8 or nf4")
    if not int4_kernel_runs():
        raise ConfigError("this PyTorch has no int4 CPU kernel for --quant q4; use int8 or nf4")


SCHEME = QuantScheme(
    "q4",
    linear_bytes=0.5,
    compute="preferred",
    scale_bytes=lambda linear, rows, packed: linear * GROUP_BYTES,
    swap=swap,
    keeps_file_blocks=KEPT_BLOCKS,
    four_bit=True,
    check=check,
)
