"""The fast decode path (ADR-0021): the same numbers as transformers' layers, a static cache
that grows without per-token allocation, and a clean fallback where it cannot run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from meshnet.models.cache import (
    MIN_CAPACITY,
    StaticKV,
    cache_bytes,
    cache_length,
    new_cache,
    truncate,
)
from meshnet.models.loader import load_shard
from meshnet.models.source import resolve
from meshnet.types import LayerSpan


def run(shard: object, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    cache, position, outs = new_cache(), 0, []
    for piece in pieces:
        outs.append(shard.forward(piece, cache, position))  # type: ignore[attr-defined]
        position += piece.shape[1]
    return outs


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
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


def test_quantized_layers_keep_transformers_path(tiny_folder: Callable[[str], Path]) -> None:
    source = resolve(str(tiny_folder("llama")))
    assert load_shard(source, LayerSpan(0, 2), "int8").fast is None


def test_gpt2_keeps_transformers_path(tiny_folder: Callable[[str], Path]) -> None:
    source = resolve(str(tiny_folder("gpt2")))
    assert load_shard(source, LayerSpan(0, 2), "fp32").fast is None


def test_fusing_shares_storage_instead_of_copying(tiny_folder: Callable[[str], Path]) -> None:
    source = resolve(str(tiny_folder("llama")))
    shard = load_shard(source, LayerSpan(0, 2), "fp32")
    attention = shard.layers[0].self_attn
    fused = shard.fast.layers[0].qkv
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
