"""The fast decode path (ADR-0021): the same numbers as transformers' layers, a static cache
that grows without per-token allocation, and a clean fallback where it cannot run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from meshnet.models import llama_graph
from meshnet.models.cache import (
    MIN_CAPACITY,
    StaticKV,
    cache_bytes,
    cache_length,
    new_cache,
    truncate,
)
from meshnet.models.int4 import Int4Linear
from meshnet.models.llama_fast import RopeTable
from meshnet.models.loader import load_shard
from meshnet.models.products import Int8Rows
from meshnet.models.shard import Shard
from meshnet.models.source import ModelSource, resolve
from meshnet.types import LayerSpan
from tests.models.fixtures import SLIDING


def run(shard: object, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    cache, position, outs = new_cache(), 0, []
    for piece in pieces:
        outs.append(shard.forward(piece, cache, position))  # type: ignore[attr-defined]
        position += piece.shape[1]
    return outs


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", *SLIDING])
@pytest.mark.parametrize("quant", ["fp32", "bf16"])
def test_fast_path_equals_transformers_layers_bit_for_bit(
    model_type: str, quant: str, tiny_folder: Callable[[str], Path]
) -> None:
    source = resolve(str(tiny_folder(model_type)))
    span = LayerSpan(0, source.spec.num_layers)
    fast, eager = load_shard(source, span, quant), load_shard(source, span, quant, fast=False)
    assert fast.fast is not None and eager.fast is None
    width = source.spec.hidden_size
    torch.manual_seed(0)
    # a 70-token prompt in chunks of 40 and 30 (past the first capacity), then 80 decode steps
    pieces = [torch.randn(1, 40, width), torch.randn(1, 30, width)]
    pieces += [torch.randn(1, 1, width) for _ in range(80)]
    for ours, theirs in zip(run(fast, pieces), run(eager, pieces), strict=True):
        assert torch.equal(ours, theirs)


def dequantized(module: nn.Module) -> torch.Tensor:
    """The fp32 weight [N, K] a q4 module, or a bitsandbytes int8 one (CB * SCB / 127),
    stands for."""
    if isinstance(module, Int4Linear):
        return module.dequantized()
    weight: Any = module.weight
    return weight.data.float() * weight.SCB.float()[:, None] / 127.0


def same_weights_in_fp32(quantized: Shard, source: ModelSource) -> Shard:
    """An eager fp32 shard whose linear weights are the int8 or q4 shard's, dequantized."""
    eager = load_shard(source, quantized.span, "fp32", fast=False)
    for ours, theirs in zip(quantized.layers, eager.layers, strict=True):
        for name, module in ours.named_modules():
            if type(module).__name__ in ("Linear8bitLt", "Int4Linear"):
                theirs.get_submodule(name).weight.data = dequantized(module)
    return eager


def assert_within_bf16_rounding(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    """Each output within 2% (relative L2) of the reference's. int8 and q4 products take
    bf16 activations (relative rounding 2^-9) and outputs leave as bf16: measured at most
    0.13%; a wrong weight or cache entry gives tens of percent."""
    for mine, ref in zip(ours, theirs, strict=True):
        error = (mine.float() - ref.float()).norm() / ref.float().norm()
        assert float(error) < 0.02


# int8 on every family; q4 on Qwen3's tiny config (q/k norms, sliding layers), whose q/k/v
# rows the 4-bit packing can stack (`int4.STACK_ROWS`)
QUANTIZED = [(m, "int8") for m in ("llama", "mistral", "qwen2", *SLIDING)] + [("qwen3", "q4")]
PRODUCTS = {"int8": Int8Rows, "q4": Int4Linear}


@pytest.mark.parametrize(("model_type", "quant"), QUANTIZED)
def test_quantized_fast_path_equals_the_same_weights_within_bf16_rounding(
    model_type: str, quant: str, compute: str, tiny_folder: Callable[[str], Path]
) -> None:
    source = resolve(str(tiny_folder(model_type)))
    shard = load_shard(source, LayerSpan(0, source.spec.num_layers), quant)
    assert isinstance(shard.fast.layers[0].qkv, PRODUCTS[quant])
    reference = same_weights_in_fp32(shard, source)
    torch.manual_seed(0)
    width = source.spec.hidden_size
    pieces = [torch.randn(1, 40, width), torch.randn(1, 30, width)]
    pieces += [torch.randn(1, 1, width) for _ in range(80)]
    assert_within_bf16_rounding(run(shard, pieces), run(reference, pieces))


def test_q4_layers_the_packing_cannot_stack_run_eagerly(
    tiny_folder: Callable[[str], Path],
) -> None:
    """Tiny llama's k and v have 32 rows each: stacked after q they would read as garbage
    (`int4.STACK_ROWS`), so the span runs eagerly, with the same weights."""
    source = resolve(str(tiny_folder("llama")))
    q4 = load_shard(source, LayerSpan(0, 2), "q4")
    assert q4.fast is None
    reference = same_weights_in_fp32(q4, source)
    pieces = [torch.randn(1, 12, source.spec.hidden_size)]
    assert_within_bf16_rounding(run(q4, pieces), run(reference, pieces))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_type", "quant"), [("llama", "int8"), ("qwen3", "int8"), ("qwen3", "q4")]
)  # qwen3: q/k norms, sliding layers
def test_compiled_decode_equals_the_same_weights_without_recompiling(
    model_type: str, quant: str, compute: str, tiny_folder: Callable[[str], Path]
) -> None:
    from torch._dynamo.utils import counters

    source = resolve(str(tiny_folder(model_type)))
    span = LayerSpan(0, source.spec.num_layers)
    shard = load_shard(source, span, quant, compile=True)  # warm-up builds the graph
    assert shard.fast.graph is not None and shard.fast.graph.built
    reference = same_weights_in_fp32(shard, source)
    graphs = counters["stats"]["unique_graphs"]
    torch.manual_seed(0)
    width = source.spec.hidden_size
    # prefill runs eagerly; 100 decode steps cross two capacity doublings (64 -> 256) and
    # the attention window grows from 128 to 256 positions
    pieces = [torch.randn(1, 40, width)] + [torch.randn(1, 1, width) for _ in range(100)]
    assert_within_bf16_rounding(run(shard, pieces), run(reference, pieces))
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled on the request path


def test_a_decode_step_that_cannot_compile_runs_eagerly_and_says_why(
    tiny_folder: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def no_compiler(fn: Callable[..., object], **options: object) -> Callable[..., object]:
        def fails(*args: object) -> object:
            raise RuntimeError("no C++ compiler found")

        return fails

    monkeypatch.setattr(llama_graph.torch, "compile", no_compiler)
    source = resolve(str(tiny_folder("llama")))
    span = LayerSpan(0, source.spec.num_layers)
    shard = load_shard(source, span, "int8", compile=True)  # warm-up tries to build the graph
    assert shard.fast.graph is None
    assert "could not compile the decode step (no C++ compiler found)" in caplog.text
    eager = load_shard(source, span, "int8")
    pieces = [
        torch.randn(1, 5, source.spec.hidden_size),
        torch.randn(1, 1, source.spec.hidden_size),
    ]
    for ours, theirs in zip(run(shard, pieces), run(eager, pieces), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize(("model_type", "quant"), [("llama", "nf4"), ("gpt2", "fp32")])
def test_layers_without_a_fast_path_keep_transformers_path(
    model_type: str, quant: str, tiny_folder: Callable[[str], Path]
) -> None:
    source = resolve(str(tiny_folder(model_type)))
    assert load_shard(source, LayerSpan(0, 2), quant).fast is None


def test_int8_fusing_shares_the_quantized_storage(tiny_folder: Callable[[str], Path]) -> None:
    source = resolve(str(tiny_folder("llama")))
    shard = load_shard(source, LayerSpan(0, 2), "int8")
    mlp, fused = shard.layers[1].mlp, shard.fast.layers[1].gate_up
    storage = fused.rows.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.data.untyped_storage().data_ptr() == storage
    assert mlp.up_proj.weight.dtype == torch.int8
    parts = (mlp.gate_proj.weight, mlp.up_proj.weight)
    assert fused.rows.untyped_storage().nbytes() == sum(p.numel() for p in parts)  # 1 B each


def test_rope_table_rows_equal_per_call_rotary(tiny_folder: Callable[[str], Path]) -> None:
    source = resolve(str(tiny_folder("llama")))
    shard = load_shard(source, LayerSpan(0, 1), "fp32")
    table = RopeTable(shard.extras, torch.float32)
    cos, signed = table.rows(300, 5)  # past the first 256 positions: the table grew
    probe = torch.empty(1, 1, 1)
    ref_cos, ref_sin = shard.extras(probe, position_ids=torch.arange(300, 305)[None])
    half = ref_sin.shape[-1] // 2
    assert torch.equal(cos, ref_cos[0])
    assert torch.equal(signed[:, half:], ref_sin[0, :, half:])
    assert torch.equal(signed[:, :half], -ref_sin[0, :, :half])


def test_fusing_shares_storage_instead_of_copying(tiny_folder: Callable[[str], Path]) -> None:
    source = resolve(str(tiny_folder("llama")))
    shard = load_shard(source, LayerSpan(0, 2), "fp32")
    attention = shard.layers[0].self_attn
    fused = shard.fast.layers[0].qkv.weight
    assert (
        attention.q_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    )
    assert (
        attention.v_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    )


def test_static_cache_doubles_and_only_counts_what_it_holds() -> None:
    kv = StaticKV(layers=2, batch=1, kv_heads=2, head_dim=4, dtype=torch.float32)
    kv.keys[:, :, :, :3] = 1.0
    kv.length = 3
    kv.reserve(MIN_CAPACITY)  # 67 > 64: one doubling, contents kept
    assert kv.capacity == 2 * MIN_CAPACITY and float(kv.keys[:, :, :, :3].min()) == 1.0
    allocated = kv.keys.data_ptr()
    kv.reserve(10)  # fits: no new allocation
    assert kv.keys.data_ptr() == allocated
    cache = new_cache()
    cache.static = kv
    assert cache_length(cache) == 3 and cache_bytes(cache) == 3 * 2 * 2 * 2 * 4 * 4
    truncate(cache, 1)
    assert cache_length(cache) == 1


def test_a_decoded_int8_token_attends_by_products_in_fp32_and_by_sdpa_in_bf16(
    compute: str, tiny_folder: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ADR-0047: oneDNN's bf16 `bmm` costs ~45 us a call on AVX-512 hosts, more than SDPA's
    whole attention; fp32 `bmm` costs ~6 us. Eager decode steps, one session and batched."""
    from meshnet.models import llama_fast

    source = resolve(str(tiny_folder("llama")))
    shard = load_shard(source, LayerSpan(0, source.spec.num_layers), "int8")
    width, layers = source.spec.hidden_size, source.spec.num_layers
    caches = [new_cache(), new_cache()]
    for cache in caches:
        shard.forward(torch.randn(1, 5, width), cache, 0)
    calls: list[str] = []
    sdpa, bmm = llama_fast.F.scaled_dot_product_attention, torch.bmm

    def counting_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append("sdpa")
        return sdpa(*args, **kwargs)

    def counting_bmm(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append("bmm")
        return bmm(*args, **kwargs)

    monkeypatch.setattr(llama_fast.F, "scaled_dot_product_attention", counting_sdpa)
    monkeypatch.setattr(llama_fast.torch, "bmm", counting_bmm)
    shard.forward(torch.randn(1, 1, width), caches[0], 5)
    shard.forward_many([torch.randn(1, 1, width)] * 2, caches, [6, 5])
    expected = ["bmm", "bmm"] if compute == "fp32" else ["sdpa"]
    assert calls == expected * layers * 3  # one session's step, then two sessions'
