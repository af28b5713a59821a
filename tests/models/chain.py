"""Test helper: run a prompt through a chain of shards the way the mesh does."""

from __future__ import annotations

from typing import Any

import torch

from meshnet.models.cache import new_cache
from meshnet.models.shard import Head, Shard
from meshnet.wire import split_prefill


class Chain:
    """Head + shards with one cache each; activations cross every boundary as bf16."""

    def __init__(self, head: Head, shards: list[Shard]) -> None:
        self.head = head
        self.shards = shards
        self.caches: list[Any] = [new_cache() for _ in shards]
        self.position = 0

    def step(self, ids: torch.Tensor, chunk_tokens: int = 128) -> torch.Tensor:
        """Feed ids [1, T]; returns fp32 logits [1, T, V]."""
        hidden = self.head.embed_tokens(ids, self.position).to(torch.bfloat16)
        outputs = []
        for chunk in split_prefill(hidden, self.position, chunk_tokens):
            h = chunk.hidden
            for shard, cache in zip(self.shards, self.caches, strict=True):
                h = shard.forward(h, cache, chunk.position)
            outputs.append(self.head.logits(h))
        self.position += ids.shape[1]
        return torch.cat(outputs, dim=1)


def reference_logits(
    model: Any, ids: torch.Tensor, decode_ids: torch.Tensor, chunk_tokens: int | None = None
) -> torch.Tensor:
    """The monolithic model: prompt in one pass (or in chunks), then cached single-token steps."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        pieces = ids.split(chunk_tokens or ids.shape[1], dim=1)
        logits = [model(piece, cache=cache, use_cache=True).logits for piece in pieces]
        for token in decode_ids[0]:
            logits.append(model(token.view(1, 1), cache=cache, use_cache=True).logits)
    return torch.cat(logits, dim=1).float()


def greedy(chain: Chain, ids: torch.Tensor, tokens: int) -> list[int]:
    logits = chain.step(ids)
    out = []
    for _ in range(tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(int(nxt))
        logits = chain.step(nxt)
    return out


def greedy_up_to_ties(
    chain: Chain, ids: torch.Tensor, reference: list[int], tie: float
) -> tuple[list[int], int]:
    """The greedy continuation of `ids`, except that where `reference`'s token is within
    `tie` logits of the best one it is taken instead: (tokens, how many were so taken).
    Quantized weights move near-ties by CPU kernel (a 0.1-logit margin between "The" and
    "L'" flips on some hosts), which says nothing about the answer's quality."""
    logits, out, taken = chain.step(ids), [], 0
    for want in reference:
        last = logits[0, -1]
        best = int(last.argmax())
        if best != want and float(last.max() - last[want]) <= tie:
            best, taken = want, taken + 1
        out.append(best)
        logits = chain.step(torch.tensor([[best]]))
    return out, taken


def reference_greedy(model: Any, prompt: torch.Tensor, tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt` [1, T], past end-of-sequence."""
    with torch.inference_mode():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )
    return [int(t) for t in out[0, prompt.shape[1] :]]


def france_prompt(tokenizer: Any) -> torch.Tensor:
    """The chat prompt "What is the capital of France?" as ids [1, T]."""
    ids: torch.Tensor = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    return ids
