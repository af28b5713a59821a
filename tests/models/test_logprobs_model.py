"""Logprobs on the default model: what the entry reports for each greedy token equals the
log-softmax of transformers' whole model at that position, within the mesh's rounding."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from meshnet.config import EntryConfig
from meshnet.text.events import Delta, TokenLogprob
from meshnet.text.params import GenerationParams, SamplingParams
from tests.models.test_speculation_model import generators


@pytest.mark.slow
def test_logprobs_equal_the_whole_models_log_softmax(smollm_reference: Any) -> None:
    (generator,) = generators([EntryConfig(seed=0)])
    prompt = generator.codec.chat([{"role": "user", "content": "What is the capital of France?"}])  # type: ignore[attr-defined]
    params = GenerationParams(8, (), SamplingParams(temperature=0.0), logprobs=3)

    async def scores() -> list[TokenLogprob]:
        stream = generator.stream(prompt, params)  # type: ignore[attr-defined]
        return [s async for e in stream if isinstance(e, Delta) for s in e.logprobs]

    ours = asyncio.run(scores())
    tokens = [s.token for s in ours]
    with torch.no_grad():
        logits = smollm_reference(torch.tensor([prompt + tokens])).logits[0].float()
    reference = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].log_softmax(-1)
    # the entry rounds its hidden state to bf16 before the head (the wire's dtype): logits
    # move by up to ~0.3 on this model (test_correctness); logprobs by as much
    # (near ties, like the first token's 0.07 here, may order differently: ids are compared
    # by their own logprobs, not by rank)
    for score, row in zip(ours, reference, strict=True):
        assert score.top[0] == (score.token, score.logprob)  # greedy: the best one
        assert abs(score.logprob - float(row[score.token])) < 0.3
        assert len(score.top) == 3
        assert all(abs(lp - float(row[t])) < 0.3 for t, lp in score.top)
    answer = generator.codec.decode(tokens)  # type: ignore[attr-defined]
    assert answer == "The capital of France is Paris."  # the end-of-text token is not scored
