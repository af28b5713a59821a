"""Real hidden states of a model at layer boundaries, for benchmarks and the demo."""

from __future__ import annotations

import torch

from meshnet.models.cache import new_cache
from meshnet.models.loader import load_head, load_shard, load_tokenizer
from meshnet.models.source import resolve
from meshnet.types import LayerSpan

SAMPLE_TEXT = (
    "The tracker keeps a map of which machines serve which layers of each model. When a node "
    "joins, it declares how much memory it can offer, and the tracker assigns it a span of "
    "layers that closes a gap in the coverage. Activations travel from node to node as raw "
    "bfloat16 bytes over plain HTTP, and every node keeps a cache of keys and values for each "
    "conversation it serves. "
)


def boundary_hidden_states(
    model: str, tokens: int, boundaries: tuple[int, ...]
) -> dict[int, torch.Tensor]:
    """bf16 hidden states [1, tokens, H] after each layer in `boundaries` on a fixed text."""
    source = resolve(model)
    tokenizer = load_tokenizer(source)
    ids = tokenizer(SAMPLE_TEXT * 8, return_tensors="pt")["input_ids"][:, :tokens]
    hidden = load_head(source).embed_tokens(ids, 0)
    states, start = {}, 0
    for end in sorted(boundaries):
        shard = load_shard(source, LayerSpan(start, end), "fp32")
        hidden = shard.forward(hidden, new_cache(), 0)
        states[end] = hidden
        start = end
    return states
