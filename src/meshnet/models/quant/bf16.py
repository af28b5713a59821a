"""bf16: half the bytes of fp32, computed in bf16 (fast on AVX512-BF16, AMX and GPUs)."""

from meshnet.models.quant.scheme import QuantScheme

SCHEME = QuantScheme("bf16", linear_bytes=2.0, compute="bf16")
