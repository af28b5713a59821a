"""What quantized layers compute in on a device: bf16 where the hardware is fast at it, else
fp32; `$MESHNET_COMPUTE_DTYPE` overrides (ADR-0024). Imports no torch."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from meshnet.config import COMPUTE_DTYPE_ENV
from meshnet.types import ComputeDtype, Quant, device_kind, parse_compute


@functools.cache
def hardware_bf16_is_fast(device: str = "cpu") -> bool:
    """A CUDA device, or a CPU with native bf16 arithmetic (AVX512-BF16 or AMX)."""
    if device_kind(device) == "cuda":
        return True
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def preferred_compute(device: str = "cpu") -> ComputeDtype:
    """What int8/nf4 layers on `device` compute in and what the default quantization follows:
    bf16 where the hardware has fast bf16, else fp32; `$MESHNET_COMPUTE_DTYPE` overrides the
    detection (ADR-0024), as `ATEN_CPU_CAPABILITY` does PyTorch's, so any machine can run
    both paths."""
    override = os.environ.get(COMPUTE_DTYPE_ENV, "").strip()
    if override:
        return parse_compute(override, COMPUTE_DTYPE_ENV)
    return "bf16" if hardware_bf16_is_fast(device_kind(device)) else "fp32"


def bf16_is_fast(device: str = "cpu") -> bool:
    """True when this process computes quantized layers on `device` in bf16
    (`preferred_compute`)."""
    return preferred_compute(device) == "bf16"


def default_quant(device: str = "cpu") -> Quant:
    return "bf16" if bf16_is_fast(device) else "fp32"
