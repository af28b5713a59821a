"""Choosing the next token from logits: a pure function of the logits, the settings, the
tokens so far and an RNG.

All logit work is float32. Penalties come first (on the logits, as OpenAI, llama.cpp and
transformers apply them), then temperature, top-k and top-p. Temperature 0 means greedy
(argmax of the penalized logits, no randomness used). Only tensor methods are used, so this
module imports no torch: the logits bring it along.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from meshnet.text.events import TokenLogprob
from meshnet.text.params import SamplingParams

if TYPE_CHECKING:
    import torch

REPEAT_WINDOW = 64  # tokens the repetition penalty looks back over (llama.cpp's repeat_last_n)


def penalize(
    logits: torch.Tensor, params: SamplingParams, history: Sequence[int], generated: int
) -> torch.Tensor:
    """`logits` [V] as float32, penalized for what `history` (every token so far, prompt
    first) holds: OpenAI's frequency and presence penalties count the last `generated`
    tokens (the completion's own, as vLLM counts them); the repetition penalty divides a
    positive logit (multiplies a negative one) of any token among the last `REPEAT_WINDOW`."""
    scores = logits.float().reshape(-1)
    if not params.penalized or not history:
        return scores
    scores = scores.clone()
    vocab = scores.numel()
    done = [t for t in history[len(history) - generated :] if 0 <= t < vocab] if generated else []
    if done and (params.frequency_penalty or params.presence_penalty):
        counts = scores.new_tensor(done).long().bincount(minlength=vocab).to(scores.dtype)
        scores -= params.frequency_penalty * counts + params.presence_penalty * counts.clamp(max=1)
    recent = sorted({t for t in history[-REPEAT_WINDOW:] if 0 <= t < vocab})
    if params.repetition_penalty != 1.0 and recent:
        at = scores.new_tensor(recent).long()
        values = scores[at]
        penalty = params.repetition_penalty
        scores[at] = (values / penalty).where(values > 0, values * penalty)
    return scores


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    history: Sequence[int] = (),
    generated: int = 0,
) -> int:
    """One token id from `logits` [V] (any float dtype) after `history`, whose last
    `generated` tokens are the completion's (`penalize`).

    With top-k, the draw is among the k best only (the same distribution as masking the rest
    to -inf, ties at the k-th value aside): top-p then sorts k values, not the vocabulary
    (3.6 -> ~0.5 ms a token over the default model's 49,152 ids here)."""
    scores = penalize(logits, params, history, generated)
    ids = None
    if 0 < params.top_k < scores.numel() and params.temperature > 0.0:
        scores, ids = scores.topk(params.top_k)  # best first
        params = replace(params, top_k=0)
    probs = probabilities(scores, params)
    pick = int(scores.argmax()) if probs is None else int(probs.multinomial(1, generator=generator))
    return pick if ids is None else int(ids[pick])


def scored(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under `logits` [V] (log-softmax in float32, the model's own
    distribution: before penalties and temperature) and the `top` best ids with theirs."""
    logprobs = logits.float().reshape(-1).log_softmax(dim=-1)
    best = logprobs.topk(min(top, logprobs.numel())) if top > 0 else None
    pairs = (
        () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True))
    )
    return TokenLogprob(token, float(logprobs[token]), pairs)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """The distribution [V] (float32) `sample` draws from, after temperature, top-k and
    top-p (penalties are the caller's, `penalize`); None where it takes the argmax instead
    (temperature 0, or one that overflows)."""
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
    logits: torch.Tensor,
    drafts: list[int],
    params: SamplingParams,
    generator: torch.Generator,
    history: Sequence[int] = (),
    generated: int = 0,
) -> tuple[int, int]:
    """Speculative sampling against a drafter that proposes one token for sure (prompt
    lookup, a greedy draft model): (drafts accepted, the token after them).

    `logits` [n + 1, V]: row i follows the fed tokens up to draft i (row 0: the last
    accepted token). Greedy: a draft stands while it is the argmax. Sampling: draft i stands
    with probability p_i(d_i); the first that falls is replaced by a draw from p_i without
    d_i (renormalized), and when all stand the next token is drawn from p_n. Each token then
    has exactly the distribution `sample` gives it one at a time (Leviathan et al. 2023,
    with a draft distribution that puts all its mass on d_i). Row i is penalized for
    `history` and the drafts before it, as `sample` would be one token at a time.
    """
    for i, draft in enumerate(drafts):
        scores = penalize(logits[i], params, [*history, *drafts[:i]], generated + i)
        probs = probabilities(scores, params)
        if probs is None:
            best = int(scores.argmax())
            if best != draft:
                return i, best
            continue
        if float(probs.new_empty(1).uniform_(generator=generator)) >= float(probs[draft]):
            rest = probs.clone()
            rest[draft] = 0.0
            return i, int(rest.multinomial(1, generator=generator))  # multinomial normalizes
    done, k = [*history, *drafts], len(drafts)
    return k, sample(logits[k], params, generator, done, generated + k)


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask all but the most likely tokens whose cumulative probability first reaches top_p."""
    ordered, order = scores.sort(descending=True)
    probs = ordered.softmax(dim=-1)
    # drop a token when the tokens before it already reach top_p (the top token always stays)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p
    drop[0] = False  # also when top_p rounds to 0 in float32 (e.g. 5e-324)
    return scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
