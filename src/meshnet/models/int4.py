"""4-bit weights kept 4-bit (`--quant q4`, ADR-0040).

A weight [N, K] is held as 4-bit codes with one scale and one offset per group of 32 weights
along K: W[n, k] = (code - 8) * scale[n, k // 32] + offset[n, k // 32]. GGUF's Q4_0, Q4_1 and
Q4_K blocks are exactly of this form (Q4_K's 6-bit sub-block scales and mins multiplied out),
so a span of a Q4 file keeps its codes as they are; any other tensor is quantized here from
its float values (the group's min and max). The product is PyTorch's weight-only int4 CPU
kernel (`_weight_int4pack_mm_for_cpu`), fed bf16 activations: it has no fast fp32 variant
(1536x576 at M=1, AVX2: 70 us in bf16, 2 ms in fp32), so like the int8 product it computes in
bf16 whatever the rest of the layer does.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from meshnet.errors import ModelError

log = logging.getLogger(__name__)
GROUP = 32  # weights per scale and offset
CENTER = 8  # the kernel's codes are unsigned, centred on 8
ROW_MULTIPLE = 16  # the packing wants whole blocks of 16 output rows
# The packing interleaves rows in blocks of 64 (then 32, 16 for a tail), so stacking packed
# weights row-wise is only right when every part but the last is whole blocks of 64: measured,
# [64, 16, 16] rows stacked gave errors of 45 while [64, 64, 48] and [576, 192, 192] are exact.
STACK_ROWS = 64
# GGUF types whose codes are kept as they are (`quant.q4.KEPT_BLOCKS` says the same to the
# torch-free side; a test pins them equal: importing it here would close a circle)
DECODED_BLOCKS = frozenset({"Q4_0", "Q4_1", "Q4_K"})


@dataclass(frozen=True)
class Int4Blocks:
    """A weight as codes and per-group affine parameters (see the module docstring)."""

    codes: np.ndarray  # uint8 [N, K], each 0..15
    scales: np.ndarray  # float32 [N, K / GROUP]
    offsets: np.ndarray  # float32 [N, K / GROUP]

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: what the codes stand for."""
        widen = np.repeat  # one scale/offset per GROUP codes
        scales = widen(self.scales, GROUP, axis=1)
        offsets = widen(self.offsets, GROUP, axis=1)
        values: np.ndarray = (self.codes.astype(np.float32) - CENTER) * scales + offsets
        return values

    def rows(self, order: np.ndarray) -> Int4Blocks:
        """The same blocks with rows taken in `order` (llama.cpp's rotary permutation)."""
        return Int4Blocks(self.codes[order], self.scales[order], self.offsets[order])


def from_float(weight: torch.Tensor, name: str = "weight", refits: int = 2) -> Int4Blocks:
    """Quantize [N, K] float weights in groups of 32: codes from the group's min and max, then
    `refits` rounds of least squares for each group's scale and offset given its codes (cuts
    the RMS error ~8%, measured on Gemma 3's Q5_0 projections)."""
    n, k = weight.shape
    if k % GROUP:
        raise ModelError(f"{name}: {k} input features are not a multiple of {GROUP}; q4 needs it")
    groups = weight.detach().double().reshape(n, k // GROUP, GROUP).numpy()  # [N, K/32, 32]
    low = groups.min(axis=2)
    step = np.maximum(groups.max(axis=2) - low, 1e-12) / 15.0
    for _ in range(refits):
        step, low = _refit(groups, _codes(groups, step, low), step, low)
    codes = _codes(groups, step, low).astype(np.uint8).reshape(n, k)
    return Int4Blocks(codes, step.astype(np.float32), (low + CENTER * step).astype(np.float32))


def _codes(groups: np.ndarray, step: np.ndarray, low: np.ndarray) -> np.ndarray:
    codes: np.ndarray = np.clip(np.rint((groups - low[..., None]) / step[..., None]), 0, 15)
    return codes


def _refit(
    groups: np.ndarray, codes: np.ndarray, step: np.ndarray, low: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per group, the (step, low) minimising ||step * codes + low - w||^2 (a 2x2 system);
    groups whose codes are all equal keep their old pair."""
    c_sum, w_sum = codes.sum(axis=2), groups.sum(axis=2)
    cc, cw = (codes * codes).sum(axis=2), (codes * groups).sum(axis=2)
    det = GROUP * cc - c_sum * c_sum
    solvable = det > 0
    safe = np.where(solvable, det, 1.0)
    new_step = np.where(solvable, (GROUP * cw - c_sum * w_sum) / safe, step)
    new_low = np.where(solvable, (w_sum - new_step * c_sum) / GROUP, low)
    return np.maximum(new_step, 1e-12), new_low


def from_gguf(kind: str, data: np.ndarray, shape: tuple[int, int]) -> Int4Blocks | None:
    """The blocks of a GGUF tensor of type `kind` (bytes [N, row bytes], torch shape
    `shape`), or None for a type whose codes are not 4-bit groups of 32."""
    if kind not in DECODED_BLOCKS:
        return None
    n, k = shape
    raw = np.ascontiguousarray(data).reshape(n, -1)
    if kind == "Q4_K":
        return _q4_k(raw, n, k)
    width = 18 if kind == "Q4_0" else 20  # bytes a block of 32: fp16 d (and m), 16 of codes
    blocks = raw.reshape(n, k // GROUP, width)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_0":  # w = d (q - 8)
        offsets = np.zeros_like(d)
    else:  # Q4_1: w = d q + m
        offsets = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d
    codes = _nibbles(blocks[..., width - 16 :])
    return Int4Blocks(codes.reshape(n, k), d, offsets)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles are elements 0-15, high ones 16-31."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _q4_k(raw: np.ndarray, n: int, k: int) -> Int4Blocks:
    """Q4_K: super-blocks of 256 (144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit
    scales and mins, 128 of codes); w = d sc q - dmin m per sub-block of 32."""
    blocks = raw.reshape(n, k // 256, 144)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 4:16].astype(np.uint16)  # [n, supers, 12]
    low, mid, top = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low & 63, (top & 0x0F) | ((low >> 6) << 4)], axis=-1)  # [.., 8]
    mn = np.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=-1)
    scales = d[..., None] * sc
    offsets = CENTER * scales - dmin[..., None] * mn
    qs = blocks[..., 16:].reshape(n, k // 256, 4, 32)  # 4 chunks of 64: low nibbles first
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [n, supers, 4, 64]
    return Int4Blocks(
        codes.reshape(n, k), scales.reshape(n, -1).astype(np.float32), offsets.reshape(n, -1)
    )


class Int4Linear(nn.Module):
    """`x @ W.T (+ b)` with W as packed 4-bit codes; a drop-in for `nn.Linear` (and a fast
    path `Product`). Buffers: `packed` uint8 [N, K/2], `scales_zeros` bf16 [K/32, N, 2]."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    bias: nn.Parameter | None

    def __init__(self, blocks: Int4Blocks, bias: torch.Tensor | None, name: str = "weight") -> None:
        super().__init__()
        n, k = blocks.codes.shape
        if n % ROW_MULTIPLE or k % GROUP:
            raise ModelError(
                f"{name}: [{n}, {k}] cannot be packed as int4 (q4 needs output rows a multiple "
                f"of {ROW_MULTIPLE} and input features a multiple of {GROUP}); use int8 or nf4"
            )
        self.in_features, self.out_features = int(k), int(n)
        codes = torch.from_numpy(blocks.codes.astype(np.int32))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        pairs = np.stack([blocks.scales.T, blocks.offsets.T], axis=-1)  # [K/32, N, 2]
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", torch.from_numpy(pairs).to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @staticmethod
    def stackable(modules: list[Int4Linear]) -> bool:
        """Whether `stacked` gives the right product: see `STACK_ROWS`."""
        return all(m.out_features % STACK_ROWS == 0 for m in modules[:-1])

    @classmethod
    def stacked(cls, modules: list[Int4Linear]) -> Int4Linear:
        """One product over `modules` stacked row-wise (the fast path's q/k/v, gate/up); each
        module's buffers become views of the stacked ones, so memory does not grow. The
        caller checks `stackable` first."""
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.in_features = modules[0].in_features
        fused.out_features = sum(m.out_features for m in modules)
        fused.register_buffer("packed", torch.cat([m.packed for m in modules]))
        pairs = torch.cat([m.scales_zeros for m in modules], dim=1)
        fused.register_buffer("scales_zeros", pairs)
        biases = [m.bias for m in modules]
        bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
        fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        start = 0
        for m in modules:
            stop = start + m.out_features
            m.packed, m.scales_zeros = fused.packed[start:stop], pairs[:, start:stop]
            if m.bias is not None and fused.bias is not None:
                m.bias = nn.Parameter(fused.bias.data[start:stop], requires_grad=False)
            start = stop
        return fused

    def codes(self) -> torch.Tensor:
        """uint8 [N, K]: the codes, read back through the kernel itself (whatever its packed
        layout): with scale 1 and offset 8 the weights are the codes, exact in bf16."""
        k, n = self.in_features, self.out_features
        unit = torch.ones(k // GROUP, n, 2, dtype=torch.bfloat16)
        unit[..., 1] = CENTER
        eye = torch.eye(k, dtype=torch.bfloat16)
        columns = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, unit)
        return columns.t().round().to(torch.uint8)  # type: ignore[no-any-return]

    def dequantized(self) -> torch.Tensor:
        """float32 [N, K]: the weights the product multiplies by (for checks and tests)."""
        pairs = self.scales_zeros.float().repeat_interleave(GROUP, dim=0)  # [K, N, 2]
        return (self.codes().float() - CENTER) * pairs[..., 0].t() + pairs[..., 1].t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, K]
        pairs = self.scales_zeros.contiguous()  # a view after stacking: the kernel wants rows
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, GROUP, pairs
        )
        out = out.view(*x.shape[:-1], self.out_features).to(x.dtype)  # [..., N]
        return out if self.bias is None else out + self.bias


@functools.cache
def int4_kernel_runs() -> bool:
    """Whether this PyTorch build packs and multiplies int4 weights on the CPU."""
    try:
        codes = np.zeros((ROW_MULTIPLE, GROUP), np.uint8)
        ones = np.ones((ROW_MULTIPLE, 1), np.float32)
        Int4Linear(Int4Blocks(codes, ones, ones), None)(torch.ones(1, GROUP))
    except (RuntimeError, NotImplementedError, AttributeError, ModelError) as exc:
        log.info("no weight-only int4 CPU kernel: %s", exc)
        return False
    return True
