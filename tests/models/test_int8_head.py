"""An int8 entry's LM head as int8 rows (ADR-0046): the default model's logits within int8
rounding of its bf16 head's, the same greedy tokens, and the head's bytes as sizing counts
them."""

from __future__ import annotations

import pytest
import torch

from meshnet.models import products, sizing
from meshnet.models.cache import new_cache
from meshnet.models.loader import load_head, load_shard
from meshnet.models.source import resolve
from meshnet.types import LayerSpan

requires_kernel = pytest.mark.skipif(
    not products.int8_kernel_runs(torch.device("cpu")), reason="no weight-only int8 kernel"
)


@requires_kernel
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_int8_head_logits_are_the_bf16_heads_within_int8_rounding(compute: torch.dtype) -> None:
    source = resolve("default")
    head = load_head(source, torch.bfloat16)
    shard = load_shard(source, LayerSpan(0, source.spec.num_layers), "fp32")
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314, 7042, 30, 2, 198] * 4])
    hidden = shard.forward(head.embed_tokens(ids, 0).float(), new_cache(), 0)  # [1, 40, 576]
    with torch.inference_mode():  # fp32 products of the bf16 head's own numbers
        exact = head.norm(hidden.to(torch.bfloat16)).float() @ head.embed.weight.float().T
    dense = head.logits(hidden)
    head.quantize_lm_head(compute)
    int8 = head.logits(hidden)
    assert int8.shape == dense.shape and int8.dtype == torch.float32
    errors = [float((x - exact).norm() / exact.norm()) for x in (dense, int8)]
    assert errors[1] < 0.015, errors  # measured: bf16 head 0.0016, int8 head 0.0082
    top2 = exact.topk(2, dim=-1).values
    # int8 rows move a logit by up to ~0.5 here (0.8% of logits near 35): near-ties may flip,
    # as they do between int8 layers and fp32 ones
    clear = (top2[..., 0] - top2[..., 1]) > 1.0
    assert int(clear.sum()) >= 30  # of 40 positions
    assert torch.equal(int8.argmax(-1)[clear], exact.argmax(-1)[clear])
    assert head.embed.weight.shape[0] == source.spec.vocab_size  # tied: embeddings kept


def test_sizing_counts_an_int8_lm_head_beside_the_embeddings() -> None:
    spec = resolve("default").spec
    table = spec.vocab_size * spec.hidden_size
    assert sizing.entry_head_bytes(spec, "bf16") == (table + spec.hidden_size) * 2
    assert (
        sizing.entry_head_bytes(spec, "int8")
        == (table + spec.hidden_size) * 2 + table + 2 * spec.vocab_size
    )
