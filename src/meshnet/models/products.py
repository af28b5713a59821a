"""A layer's matrix products for the fast path: dense weights, int8 weight-only rows, or
4-bit weights (`models/int4.py`'s `Int4Linear`, a product itself).

A `Product` computes `x @ W.T (+ b)` for x [..., K]. Fusing (q/k/v, gate/up) concatenates
the modules' weights row-wise once at load, and the modules' own parameters become views into
the fused tensor, so memory does not grow and the eager path still sees the same numbers.

INT8 layers are bitsandbytes' `Linear8bitLt` with its row-wise weights: `CB` int8 [N, K] and
`SCB` [N], the absolute maximum of each row, so W = CB * SCB / 127. bitsandbytes' own CPU
product also quantizes the activations to int8; here the activations stay as they are and
PyTorch's weight-only kernel (`_weight_int8pack_mm`, bf16 activations) reads half the bytes
of bf16 weights. Same weights, less rounding than LLM.int8 (ADR-0022).

That kernel's time grows linearly with the rows M (measured here, 3072x576: 88 us at M=1,
1.3 ms at 32, 4.2 ms at 128), so from `DEQUANT_ROWS` rows on (prefill chunks, wide batches)
the rows are widened to bf16 in blocks and multiplied densely, with the scales applied to the
output columns: 0.75 ms at 128 rows, same weights, one more bf16 rounding (ADR-0027). The
widening costs about the same at any M (the int8 -> bf16 copy, ~0.2 ms for 3072x576), so
the crossover is where the kernel's M rows cost that much: a layer of the default model's
four products on a 2-core AVX-512/AMX Xeon, kernel against widened, 0.69 against 1.27 ms at
8 rows, 0.96 against 1.08 at 12, 1.24 against 0.95 at 16 (ADR-0047).

Where bf16 products are slow (no AVX-512 BF16: such hosts compute in fp32, so the
activations come as fp32) widening to bf16 costs more than the kernel at every M (2-core AMD
EPYC, AVX2: 7.9 ms against 1.36 ms at 32 rows); fp32 activations are widened to fp32 instead,
and only from `DEQUANT_ROWS_FP32` rows on (there, 4.8 ms against 5.4 ms at 128 rows; 3.0
against 2.7 at 64). The kernel itself always takes bf16 activations (fp32 ones run ~9x slower).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from meshnet.models.int4 import Int4Linear

log = logging.getLogger(__name__)
INT8_MAX = 127.0
DEQUANT_ROWS = 16  # from this many bf16 activation rows on, widen the weights (crossover ~14)
DEQUANT_ROWS_FP32 = 96  # and from this many fp32 ones (crossover ~96-128, AVX2)
BLOCK_ELEMENTS = 1 << 23  # weights widened at a time: 16 MiB of bf16, whatever the layer


class Product(Protocol):
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        ...


class Dense:
    """`F.linear` over a dense weight [N, K], exactly what `nn.Linear` runs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features = int(weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Int8Rows:
    """Weight-only int8: int8 rows [N, K] times one scale per row, bf16 activations."""

    def __init__(self, rows: torch.Tensor, absmax: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.rows = rows
        self.scales = (absmax.float() / INT8_MAX).to(torch.bfloat16)  # [N]
        self.bias = bias
        self.out_features = int(rows.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [M, K]
        wide = torch.float32 if flat.dtype == torch.float32 else torch.bfloat16
        if flat.shape[0] >= (DEQUANT_ROWS_FP32 if wide == torch.float32 else DEQUANT_ROWS):
            out = self._widened(flat.to(wide))
        else:
            out = torch.ops.aten._weight_int8pack_mm(
                flat.to(torch.bfloat16), self.rows, self.scales
            )
        out = out.view(*x.shape[:-1], self.out_features).to(x.dtype)  # [..., N]
        return out if self.bias is None else out + self.bias

    def _widened(self, flat: torch.Tensor) -> torch.Tensor:
        """[M, K] @ (rows in flat's dtype).T * scales, BLOCK_ELEMENTS weights at a time ->
        [M, N] in flat's dtype."""
        # 16 MiB of widened weights at a time, whatever the layer and dtype
        block = max(1, BLOCK_ELEMENTS * 2 // (flat.element_size() * int(self.rows.shape[1])))
        scales = self.scales.to(flat.dtype)
        if block >= self.out_features:
            return F.linear(flat, self.rows.to(flat.dtype)) * scales
        out = flat.new_empty(flat.shape[0], self.out_features)
        for start in range(0, self.out_features, block):
            stop = min(start + block, self.out_features)
            part = F.linear(flat, self.rows[start:stop].to(flat.dtype))
            torch.mul(part, scales[start:stop], out=out[:, start:stop])
        return out


def int8_rows_of(weight: torch.Tensor) -> Int8Rows:
    """A dense weight [N, K] as weight-only int8 rows: each row scaled by its absolute maximum
    (bitsandbytes' row-wise rounding)."""
    absmax = weight.float().abs().amax(dim=1).clamp(min=1e-12)  # [N]
    rows = (weight.float() * (INT8_MAX / absmax[:, None])).round().clamp(-127, 127)
    return Int8Rows(rows.to(torch.int8), absmax, bias=None)


def int8_kernel_runs(device: torch.device) -> bool:
    """Whether this PyTorch build has the weight-only int8 kernel on `device`."""
    try:
        rows = torch.ones(8, 32, dtype=torch.int8, device=device)
        scales = torch.ones(8, dtype=torch.bfloat16, device=device)
        x = torch.ones(1, 32, dtype=torch.bfloat16, device=device)
        torch.ops.aten._weight_int8pack_mm(x, rows, scales)
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        log.info("no weight-only int8 kernel on %s: %s", device, exc)
        return False
    return True


def kind(module: nn.Module) -> str | None:
    """'dense' for `nn.Linear`, 'int8' for bitsandbytes' `Linear8bitLt`, 'int4' for
    `Int4Linear`, else None."""
    if type(module) is nn.Linear:
        return "dense"
    if type(module) is Int4Linear:
        return "int4"
    if type(module).__name__ == "Linear8bitLt" and getattr(module.weight, "SCB", None) is not None:
        return "int8"
    return None


def fuse(modules: list[Any]) -> Product | None:
    """One product over `modules` (linear layers) stacked row-wise, or None when they cannot
    be fused (mixed kinds, some with a bias and some without, an unknown layer)."""
    kinds = {kind(m) for m in modules}
    if len(kinds) != 1 or None in kinds:
        return None
    biases = [m.bias for m in modules]
    if any(b is not None for b in biases) and any(b is None for b in biases):
        return None
    if kinds == {"int4"}:
        return Int4Linear.stacked(modules) if Int4Linear.stackable(modules) else None
    bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
    rows = _fuse_rows(modules)
    if kinds == {"dense"}:
        return Dense(rows, bias)
    return Int8Rows(rows, torch.cat([m.weight.SCB for m in modules]), bias)


def _fuse_rows(modules: list[Any]) -> torch.Tensor:
    """Concatenate the weights row-wise; each module's weight becomes a view of the result."""
    fused = torch.cat([m.weight.detach() for m in modules]).contiguous()
    start = 0
    for m in modules:
        weight, rows = m.weight, int(m.weight.shape[0])
        if type(weight) is nn.Parameter:
            m.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        else:  # bitsandbytes' Int8Params: keep the object (and its SCB), share the storage
            weight.data = fused[start : start + rows]
            if getattr(weight, "CB", None) is not None:
                weight.CB = weight.data
        start += rows
    return fused
