"""int8 weight-only products: the kernel for few rows and the widened weights for many give
the same numbers within bf16 rounding, and widening in blocks changes nothing."""

from __future__ import annotations

import pytest
import torch

from meshnet.models import products
from meshnet.models.products import DEQUANT_ROWS, DEQUANT_ROWS_FP32, Int8Rows

requires_kernel = pytest.mark.skipif(
    not products.int8_kernel_runs(torch.device("cpu")), reason="no weight-only int8 kernel"
)


def int8_rows(n: int, k: int) -> Int8Rows:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    absmax = torch.rand(n, generator=generator) + 0.5
    return Int8Rows(rows, absmax, bias=None)


def reference(product: Int8Rows, x: torch.Tensor) -> torch.Tensor:
    """x @ (rows * scales).T in fp32: what both paths approximate."""
    weight = product.rows.float() * product.scales.float()[:, None]
    return x.float() @ weight.T


@requires_kernel
@pytest.mark.parametrize(
    ("dtype", "rows"),
    [(torch.bfloat16, r) for r in (1, DEQUANT_ROWS - 1, DEQUANT_ROWS, 128)]
    + [(torch.float32, r) for r in (1, DEQUANT_ROWS, DEQUANT_ROWS_FP32 - 1, DEQUANT_ROWS_FP32)],
)
def test_both_int8_paths_equal_the_dequantized_product_within_bf16_rounding(
    dtype: torch.dtype, rows: int
) -> None:
    """bf16 activations (hosts with fast bf16) widen from DEQUANT_ROWS rows on, fp32 ones
    (hosts without) from DEQUANT_ROWS_FP32, in fp32."""
    product = int8_rows(96, 64)
    x = torch.randn(1, rows, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = product(x)
    assert out.shape == (1, rows, 96) and out.dtype == x.dtype
    ref = reference(product, x)
    # two bf16 roundings (activations, output), 2^-9 each: measured below 0.5%
    assert float((out.float() - ref).norm() / ref.norm()) < 0.01


@requires_kernel
@pytest.mark.parametrize(
    ("dtype", "rows"), [(torch.bfloat16, DEQUANT_ROWS), (torch.float32, DEQUANT_ROWS_FP32)]
)
def test_widening_in_blocks_gives_the_same_numbers(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, rows: int
) -> None:
    product = int8_rows(100, 64)
    x = torch.randn(rows, 64, dtype=dtype)
    whole = product(x)
    widened: list[torch.dtype] = []
    monkeypatch.setattr(products, "BLOCK_ELEMENTS", 64 * 30)  # 30 bf16 rows a block: 4 blocks
    monkeypatch.setattr(products.F, "linear", lambda a, w: widened.append(w.dtype) or a @ w.T)
    assert torch.allclose(product(x), whole, rtol=1e-2, atol=1e-2)
    assert widened == [dtype] * (4 if dtype == torch.bfloat16 else 7)  # 15 fp32 rows a block
