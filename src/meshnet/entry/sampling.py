"""Choosing the next token from logits: a pure function of the logits, the settings and an RNG.

All logit work is float32. Temperature 0 means greedy (argmax, no randomness used).
"""

from __future__ import annotations

import torch

from meshnet.text.params import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from `logits` [V] (any float dtype)."""
    scores = logits.float().reshape(-1)
    if params.temperature <= 0.0:
        return int(torch.argmax(scores))
    scaled = scores / params.temperature
    if not bool(torch.isfinite(scaled).all()):  # a temperature so small it overflows: greedy
        return int(torch.argmax(scores))
    scores = scaled
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        scores = _top_p(scores, params.top_p)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask all but the most likely tokens whose cumulative probability first reaches top_p."""
    ordered, order = torch.sort(scores, descending=True)
    cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    # drop a token when the tokens before it already reach top_p (the top token always stays)
    drop = (cumulative - torch.softmax(ordered, dim=-1)) >= top_p
    drop[0] = False  # also when top_p rounds to 0 in float32 (e.g. 5e-324)
    return scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))


def make_generator(seed: int | None, fallback: int) -> torch.Generator:
    """A CPU generator seeded with `seed`, or with `fallback` (drawn by the caller) when None."""
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else fallback)
    return generator
