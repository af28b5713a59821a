"""int8 weight-only products: the kernel for few rows and the widened weights for many give
the same numbers within bf16 rounding, and widening in blocks changes nothing."""

from __future__ import annotations

import pytest
import torch

from meshnet.models import products
from meshnet.models.products import DEQUANT_ROWS, Int8Rows

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
@pytest.mark.parametrize("rows", [1, DEQUANT_ROWS - 1, DEQUANT_ROWS, 128])
def test_both_int8_paths_equal_the_dequantized_product_within_bf16_rounding(rows: int) -> None:
    product = int8_rows(96, 64)
    x = torch.randn(1, rows, 64, generator=torch.Generator().manual_seed(1))
    out = product(x)
    assert out.shape == (1, rows, 96) and out.dtype == x.dtype
    ref = reference(product, x)
    # two bf16 roundings (activations, output), 2^-9 each: measured below 0.5%
    assert float((out.float() - ref).norm() / ref.norm()) < 0.01


@requires_kernel
def test_widening_in_blocks_gives_the_same_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    product = int8_rows(100, 64)
    x = torch.randn(DEQUANT_ROWS, 64, dtype=torch.bfloat16)
    whole = product(x)
    monkeypatch.setattr(products, "BLOCK_ELEMENTS", 64 * 30)  # 30 rows a block: 4 blocks
    assert torch.equal(product(x), whole)
