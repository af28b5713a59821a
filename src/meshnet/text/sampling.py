"""Choosing the next token from logits: a pure function of the logits, the settings and an RNG.

All logit work is float32. Temperature 0 means greedy (argmax, no randomness used). Only
tensor methods are used, so this module imports no torch: the logits bring it along.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshnet.text.params import SamplingParams

if TYPE_CHECKING:
    import torch


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from `logits` [V] (any float dtype)."""
    scores = logits.float().reshape(-1)
    if params.temperature <= 0.0:
        return int(scores.argmax())
    scaled = scores / params.temperature
    if not bool(scaled.isfinite().all()):  # a temperature so small it overflows: greedy
        return int(scores.argmax())
    scores = scaled
    if 0 < params.top_k < scores.numel():
        kth = scores.topk(params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        scores = _top_p(scores, params.top_p)
    probs = scores.softmax(dim=-1)
    return int(probs.multinomial(1, generator=generator))


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask all but the most likely tokens whose cumulative probability first reaches top_p."""
    ordered, order = scores.sort(descending=True)
    probs = ordered.softmax(dim=-1)
    # drop a token when the tokens before it already reach top_p (the top token always stays)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p
    drop[0] = False  # also when top_p rounds to 0 in float32 (e.g. 5e-324)
    return scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
