"""A sliding-window layer's eager cache keeps only its window plus `REWIND_TOKENS` (Gemma 3's
local layers, Mistral/Qwen sliding layers off the fast path): same outputs as a full cache,
rollbacks within the margin, a clear error beyond it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from meshnet.errors import ModelError
from meshnet.models.cache import (
    REWIND_TOKENS,
    EagerKV,
    cache_bytes,
    cache_length,
    new_cache,
    truncate,
)
from meshnet.models.loader import load_shard
from meshnet.models.shard import Shard
from meshnet.models.source import resolve
from meshnet.types import LayerSpan

WINDOW = 8  # the tiny configs' sliding window


def feed(shard: Shard, cache: object, x: torch.Tensor, start: int) -> torch.Tensor:
    """`x` [1, T, H] through `shard` in 128-token chunks from `start`, then concatenated."""
    outs = [shard.forward(x[:, i : i + 128], cache, start + i) for i in range(0, x.shape[1], 128)]
    return torch.cat(outs, dim=1)


def assert_within_one_bf16_step(a: torch.Tensor, b: torch.Tensor) -> None:
    """Outputs are bf16: attention over fewer (masked) columns sums in another order, which
    moves a few of them by one bf16 step (2^-7 relative at most), never more."""
    diff = (a.float() - b.float()).abs()
    assert bool((diff <= b.float().abs() * 2**-7 + 1e-6).all()), float(diff.max())
    assert float((diff > 0).float().mean()) < 0.01


@pytest.mark.parametrize("model_type", ["gemma3_text", "mistral-sliding"])
def test_sliding_layers_keep_their_window_and_answer_as_with_every_token(
    model_type: str, tiny_folder: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = resolve(str(tiny_folder(model_type)))
    span = LayerSpan(0, source.spec.num_layers)
    eager = load_shard(source, span, "fp32", fast=False)
    torch.manual_seed(0)
    x = torch.randn(1, 400, source.spec.hidden_size)
    cache = new_cache()
    out = feed(eager, cache, x, 0)
    kept = [k.shape[2] for k in cache.eager.keys]  # type: ignore[union-attr]
    windows = cache.eager.windows  # type: ignore[union-attr]
    assert kept == [400 if w is None else w + REWIND_TOKENS for w in windows]
    assert any(w == WINDOW for w in windows) and cache_length(cache) == 400
    # the reference: the same layers caching every token (masks alone do the sliding)
    monkeypatch.setattr(EagerKV, "slide", lambda self, windows: None)
    full = new_cache()
    assert_within_one_bf16_step(out, feed(eager, full, x, 0))
    assert cache_bytes(cache) < cache_bytes(full)


def test_a_rollback_within_the_margin_replays_exactly_and_a_deeper_one_is_refused(
    tiny_folder: Callable[[str], Path],
) -> None:
    source = resolve(str(tiny_folder("gemma3_text")))
    shard = load_shard(source, LayerSpan(0, source.spec.num_layers), "fp32")
    torch.manual_seed(1)
    x = torch.randn(1, 400, source.spec.hidden_size)
    cache = new_cache()
    first = feed(shard, cache, x, 0)
    truncate(cache, 400 - REWIND_TOKENS)  # the deepest rollback the margin allows
    again = feed(shard, cache, x[:, 400 - REWIND_TOKENS :], 400 - REWIND_TOKENS)
    # other chunk boundaries than the first pass
    assert_within_one_bf16_step(again, first[:, 400 - REWIND_TOKENS :])
    with pytest.raises(ModelError, match="cannot take this session back"):
        truncate(cache, 400 - REWIND_TOKENS - WINDOW - 1)
