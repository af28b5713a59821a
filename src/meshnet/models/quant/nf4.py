"""nf4: bitsandbytes' `Linear4bit`, one absmax scale per 64 weights (float32, or bf16 once
bitsandbytes repacked the weights for its AVX512-BF16 kernel)."""

from __future__ import annotations

from typing import Any

from meshnet.models.quant.bnb import placed
from meshnet.models.quant.compute import bf16_is_fast
from meshnet.models.quant.scheme import Linear, QuantScheme
from meshnet.types import device_kind

BLOCK = 64  # weights per absmax scale


def nf4_packed_for_cpu(device: str = "cpu") -> bool:
    """Whether bitsandbytes repacks nf4 weights here for its AVX512-BF16 kernel (which
    computes in bf16 and keeps bf16 absmax): only for a CPU shard on such a CPU, and only
    when this process computes in bf16 (`_quantized` turns the repacking off otherwise)."""
    if device_kind(device) != "cpu" or not bf16_is_fast(device):
        return False
    from bitsandbytes.functional import has_avx512bf16

    return bool(has_avx512bf16())


def swap(linear: Linear, dtype: Any, device: str) -> Any:
    """`linear` as an nf4 `Linear4bit` computing in `dtype` on `device`."""
    import bitsandbytes as bnb

    out_features, in_features = linear.weight.shape
    q = bnb.nn.Linear4bit(
        in_features, out_features, bias=linear.bias is not None, compute_dtype=dtype,
        quant_type="nf4", compress_statistics=False,
    )  # fmt: skip
    q.weight = bnb.nn.Params4bit(
        linear.weight.float(), requires_grad=False, quant_type="nf4",
        compress_statistics=False, blocksize=BLOCK, module=q,
    )  # fmt: skip
    # bitsandbytes repacks for its bf16 kernel on an AVX512-BF16 CPU whatever we compute
    # in; with fp32 compute it must not (the switch then means fp32 everywhere)
    setattr(q, "support_avx512bf16_for_cpu", nf4_packed_for_cpu(device))  # noqa: B010
    return placed(q, linear.bias, dtype, device)


SCHEME = QuantScheme(
    "nf4",
    linear_bytes=0.5,
    compute="preferred",
    scale_bytes=lambda linear, rows, packed: linear / BLOCK * (2 if packed else 4),
    swap=swap,
    repacked_for_bf16=True,
    four_bit=True,
)
