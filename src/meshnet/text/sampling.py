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
    probs = probabilities(logits, params)
    if probs is None:
        return int(logits.float().reshape(-1).argmax())
    return int(probs.multinomial(1, generator=generator))


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """The distribution [V] (float32) `sample` draws from, after temperature, top-k and
    top-p; None where it takes the argmax instead (temperature 0, or one that overflows)."""
    scores = logits.float().reshape(-1)
    if params.temperature <= 0.0:
        return None
    scaled = scores / params.temperature
    if not bool(scaled.isfinite().all()):  # a temperature so small it overflows: greedy
        return None
    scores = scaled
    if 0 < params.top_k < scores.numel():
        kth = scores.topk(params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        scores = _top_p(scores, params.top_p)
    return scores.softmax(dim=-1)


def accept_drafts(
    logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator
) -> tuple[int, int]:
    """Speculative sampling against a drafter that proposes one token for sure (prompt
    lookup, a greedy draft model): (drafts accepted, the token after them).

    `logits` [n + 1, V]: row i follows the fed tokens up to draft i (row 0: the last
    accepted token). Greedy: a draft stands while it is the argmax. Sampling: draft i stands
    with probability p_i(d_i); the first that falls is replaced by a draw from p_i without
    d_i (renormalized), and when all stand the next token is drawn from p_n. Each token then
    has exactly the distribution `sample` gives it one at a time (Leviathan et al. 2023,
    with a draft distribution that puts all its mass on d_i).
    """
    for i, draft in enumerate(drafts):
        probs = probabilities(logits[i], params)
        if probs is None:
            best = int(logits[i].float().argmax())
            if best != draft:
                return i, best
            continue
        if float(probs.new_empty(1).uniform_(generator=generator)) >= float(probs[draft]):
            rest = probs.clone()
            rest[draft] = 0.0
            return i, int(rest.multinomial(1, generator=generator))  # multinomial normalizes
    return len(drafts), sample(logits[len(drafts)], params, generator)


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask all but the most likely tokens whose cumulative probability first reaches top_p."""
    ordered, order = scores.sort(descending=True)
    probs = ordered.softmax(dim=-1)
    # drop a token when the tokens before it already reach top_p (the top token always stays)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p
    drop[0] = False  # also when top_p rounds to 0 in float32 (e.g. 5e-324)
    return scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
