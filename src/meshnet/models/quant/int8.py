"""int8: bitsandbytes' `Linear8bitLt` (LLM.int8(): outlier input features stay 16-bit); the
fast path multiplies with PyTorch's weight-only kernel from a bf16 copy of the row scales
(`models/products.py`, ADR-0022)."""

from __future__ import annotations

from typing import Any

from meshnet.models.quant.bnb import placed
from meshnet.models.quant.scheme import Linear, QuantScheme

OUTLIER_THRESHOLD = 6.0  # LLM.int8(): input features above this stay in 16-bit
# bitsandbytes' float32 row scale (`SCB`) plus the fast path's bf16 copy (ADR-0022)
ROW_BYTES = 4 + 2


def swap(linear: Linear, dtype: Any, device: str) -> Any:
    """`linear` as a `Linear8bitLt` on `device` (bitsandbytes quantizes on that move)."""
    import bitsandbytes as bnb

    out_features, in_features = linear.weight.shape
    q = bnb.nn.Linear8bitLt(
        in_features, out_features, bias=linear.bias is not None, has_fp16_weights=False,
        threshold=OUTLIER_THRESHOLD,
    )  # fmt: skip
    data = linear.weight.float()
    q.weight = bnb.nn.Int8Params(data, requires_grad=False, has_fp16_weights=False)
    return placed(q, linear.bias, dtype, device)


SCHEME = QuantScheme(
    "int8",
    linear_bytes=1.0,
    compute="preferred",
    scale_bytes=lambda linear, rows, packed: rows * ROW_BYTES,
    swap=swap,
    int8_lm_head=True,
)
