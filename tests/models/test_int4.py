"""q4 weights (`models/int4.py`): GGUF's 4-bit blocks read exactly, float weights quantized
within 4-bit error, the packed product equal to the dequantized one within bf16 rounding,
stacking only where the packing allows it, and clear errors for what cannot be packed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from meshnet.errors import ConfigError, ModelError
from meshnet.models import int4, products
from meshnet.models.checkpoint import GgufCheckpoint
from meshnet.models.int4 import Int4Blocks, Int4Linear
from meshnet.models.quant import check_device
from meshnet.models.source import ModelSource

pytestmark = pytest.mark.skipif(not int4.int4_kernel_runs(), reason="no int4 CPU kernel")


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_are_read_exactly(kind: str) -> None:
    qtype = GGMLQuantizationType[kind]
    data = quantize(weights(48, 96).numpy(), qtype)  # bytes [48, row bytes]
    blocks = int4.from_gguf(kind, data, (48, 96))
    assert blocks is not None
    np.testing.assert_array_equal(blocks.dequantize(), dequantize(data, qtype))


def test_gguf_q4_k_blocks_are_read_exactly(gemma3_source: ModelSource) -> None:
    """Gemma 3's attention output projections are Q4_K in the shipped file."""
    checkpoint = GgufCheckpoint(*_gguf_parts(gemma3_source))
    tensor = checkpoint.tensors["blk.0.attn_output.weight"]
    assert tensor.tensor_type.name == "Q4_K"
    rows, cols = (int(d) for d in reversed(tensor.shape))
    blocks = int4.from_gguf("Q4_K", tensor.data, (rows, cols))
    assert blocks is not None
    np.testing.assert_array_equal(blocks.dequantize(), dequantize(tensor.data, tensor.tensor_type))


def test_other_gguf_types_are_not_taken_as_q4() -> None:
    data = quantize(weights(16, 64).numpy(), GGMLQuantizationType.Q8_0)
    assert int4.from_gguf("Q8_0", data, (16, 64)) is None


def test_q4_codes_of_a_file_come_in_hugging_face_row_order(default_source: ModelSource) -> None:
    """The default model is Q4_1: q/k rows undo llama.cpp's rotary permutation like `read`."""
    checkpoint = GgufCheckpoint(*_gguf_parts(default_source))
    for name in (
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
    ):
        blocks = checkpoint.read_int4(name)
        assert blocks is not None, name
        np.testing.assert_array_equal(blocks.dequantize(), checkpoint.read(name).numpy())
    assert checkpoint.read_int4("model.layers.3.input_layernorm.weight") is None


def test_float_weights_quantize_within_four_bit_error() -> None:
    """Gaussian weights, groups of 32: the RMS error is ~7.5% of the weights' spread; the
    least-squares refits never make it worse than min/max alone."""
    w = weights(64, 256)
    errors = [
        float((torch.from_numpy(int4.from_float(w, refits=r).dequantize()) - w).pow(2).mean())
        for r in (0, 2)
    ]
    assert errors[1] <= errors[0]
    assert errors[1] ** 0.5 < 0.09 * float(w.std())


def test_a_constant_group_stays_exact() -> None:
    w = torch.full((16, 64), 0.25)
    np.testing.assert_allclose(int4.from_float(w).dequantize(), w.numpy(), atol=1e-6)


@pytest.mark.parametrize("rows", [1, 7, 128])
def test_the_packed_product_equals_the_dequantized_one(rows: int) -> None:
    blocks = int4.from_float(weights(96, 128))
    bias = torch.randn(96)
    linear = Int4Linear(blocks, bias)
    x = torch.randn(2, rows, 128, generator=torch.Generator().manual_seed(1))
    out = linear(x)
    assert out.shape == (2, rows, 96) and out.dtype == x.dtype
    ref = x @ torch.from_numpy(blocks.dequantize()).T + bias
    # bf16 activations, scales and offsets: measured under 1%
    assert float((out - ref).norm() / ref.norm()) < 0.02


@pytest.mark.parametrize("parts", [[576, 192, 192], [64, 64, 48], [128, 80]])
def test_stacked_products_equal_their_parts(parts: list[int]) -> None:
    modules = [Int4Linear(int4.from_float(weights(n, 64, i)), None) for i, n in enumerate(parts)]
    x = torch.randn(3, 64)
    expected = torch.cat([m(x) for m in modules], dim=-1)
    fused = products.fuse(modules)
    assert isinstance(fused, Int4Linear)
    assert torch.equal(fused(x), expected)
    assert all(
        torch.equal(m(x), e) for m, e in zip(modules, expected.split(parts, -1), strict=True)
    )


def test_parts_the_packing_cannot_stack_are_not_fused() -> None:
    """Rows packed in blocks of 16 stacked after a 16-row part read as garbage (measured:
    errors of 55); such layers keep separate products (the eager path)."""
    modules = [Int4Linear(int4.from_float(weights(16, 64, i)), None) for i in range(2)]
    assert not Int4Linear.stackable(modules)
    assert products.fuse(modules) is None


@pytest.mark.parametrize("shape", [(24, 64), (32, 48)])
def test_weights_that_cannot_be_packed_are_refused_by_name(shape: tuple[int, int]) -> None:
    n, k = shape
    codes = np.zeros((n, k), np.uint8)
    scales = np.ones((n, max(1, k // 32)), np.float32)
    with pytest.raises(ModelError, match="mlp.up_proj.*cannot be packed as int4"):
        Int4Linear(Int4Blocks(codes, scales, scales), None, "mlp.up_proj")


def test_q4_refuses_a_cuda_device() -> None:
    with pytest.raises(ConfigError, match="q4 runs on CPU nodes only"):
        check_device("q4", "cuda:0")


def _gguf_parts(source: ModelSource) -> tuple[Any, ...]:
    return (source.path, source.arch, source.spec)


def test_codes_and_weights_read_back_from_the_packed_layout() -> None:
    blocks = int4.from_float(weights(80, 96))
    linear = Int4Linear(blocks, None)
    assert torch.equal(linear.codes(), torch.from_numpy(blocks.codes))
    expected = torch.from_numpy(blocks.dequantize())  # scales and offsets in float32
    assert torch.allclose(linear.dequantized(), expected, rtol=0.01, atol=0.01)  # bf16 ones


def test_the_blocks_kept_are_the_ones_the_q4_scheme_names() -> None:
    """What q4 copies keep decides which of them a GGUF model is served in (ADR-0060)."""
    from meshnet.models.quant.q4 import KEPT_BLOCKS

    assert int4.DECODED_BLOCKS == KEPT_BLOCKS
