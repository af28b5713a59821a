"""Penalties: OpenAI's frequency and presence penalties over the completion's tokens, the
repetition penalty over the last 64 tokens, exact against their definitions and against
transformers' processor; drafted rounds penalize as plain decoding does."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet.entry.generation import seeded_rng
from meshnet.text.params import SamplingParams
from meshnet.text.sampling import REPEAT_WINDOW, accept_drafts, penalize, sample

LOGITS = torch.tensor([1.0, 3.0, -2.0, 0.5, 2.0])


@pytest.mark.parametrize(
    ("params", "history", "generated", "expected"),
    [
        (SamplingParams(), [1, 1, 2], 3, [1.0, 3.0, -2.0, 0.5, 2.0]),
        # frequency: minus 0.5 per occurrence in the completion (the last 3 tokens)
        (SamplingParams(frequency_penalty=0.5), [4, 1, 1, 2], 3, [1.0, 2.0, -2.5, 0.5, 2.0]),
        # presence: minus 0.5 once per token the completion holds; the prompt's 4 is spared
        (SamplingParams(presence_penalty=0.5), [4, 1, 1, 2], 3, [1.0, 2.5, -2.5, 0.5, 2.0]),
        # negative penalties raise instead
        (SamplingParams(frequency_penalty=-1.0), [3, 3], 2, [1.0, 3.0, -2.0, 2.5, 2.0]),
        # repetition: positive logits divided, negative multiplied, the prompt included
        (SamplingParams(repetition_penalty=2.0), [4, 2], 0, [1.0, 3.0, -4.0, 0.5, 1.0]),
        (SamplingParams(repetition_penalty=0.5), [1], 0, [1.0, 6.0, -2.0, 0.5, 2.0]),
        # out-of-vocabulary ids in a history are ignored, not an index error
        (SamplingParams(presence_penalty=1.0, repetition_penalty=2.0), [9, -1], 2, LOGITS.tolist()),
    ],
)
def test_penalties_follow_their_definitions(
    params: SamplingParams, history: list[int], generated: int, expected: list[float]
) -> None:
    assert penalize(LOGITS, params, history, generated).tolist() == expected


def test_the_repetition_penalty_looks_back_64_tokens_only() -> None:
    history = [1] + [0] * REPEAT_WINDOW  # token 1 fell out of the window
    scores = penalize(LOGITS, SamplingParams(repetition_penalty=2.0), history, 0)
    assert scores[1] == 3.0 and scores[0] == 0.5


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(0, 31), min_size=1, max_size=REPEAT_WINDOW),
    st.floats(0.2, 5.0),
    st.integers(0, 2**31),
)
def test_the_repetition_penalty_equals_transformers_processor(
    history: list[int], penalty: float, seed: int
) -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(32, generator=torch.Generator().manual_seed(seed))
    ours = penalize(logits, SamplingParams(repetition_penalty=penalty), history, 0)
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([history]), logits[None])
    assert torch.equal(ours, theirs[0])


def test_penalties_change_what_greedy_picks() -> None:
    greedy = SamplingParams(temperature=0.0, presence_penalty=1.5)
    generator = seeded_rng(0, 0)
    assert sample(LOGITS, greedy, generator, [1], 0) == 1  # the prompt's 1 is not penalized
    assert sample(LOGITS, greedy, generator, [1], 1) == 4  # the completion's 1 is


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_are_penalized_as_one_token_at_a_time(temperature: float) -> None:
    """accept_drafts over rows [k + 1, V] with drafts equal to what sampling one at a time
    gives (same generator state) accepts them all and picks the same next token."""
    params = SamplingParams(temperature=temperature, frequency_penalty=0.7, repetition_penalty=1.3)
    rows = torch.randn(5, 16, generator=torch.Generator().manual_seed(3))
    history, generated = [3, 5, 3], 1
    one_by_one, generator = [], seeded_rng(11, 0)
    for row in rows:
        one_by_one.append(
            sample(row, params, generator, [*history, *one_by_one], generated + len(one_by_one))
        )
    if temperature == 0.0:  # greedy: every draft stands, and the token after them is the same
        taken, after = accept_drafts(
            rows, one_by_one[:4], params, seeded_rng(11, 0), history, generated
        )
        assert (taken, after) == (4, one_by_one[4])
    else:  # sampling: a draft stands with its penalized probability: ~1 stands, 0 never
        certain = torch.full((5, 16), -30.0)
        certain[range(5), [7, 8, 9, 10, 11]] = 30.0
        drafts = [7, 8, 9, 10]
        assert accept_drafts(certain, drafts, params, seeded_rng(11, 0), history, 1) == (4, 11)
        certain[1, 8] = float("-inf")  # the second draft cannot be sampled: the first stands
        taken, after = accept_drafts(certain, drafts, params, seeded_rng(11, 0), history, 1)
        assert taken == 1 and after != 8


def test_a_token_is_scored_by_the_log_softmax_of_its_logits() -> None:
    from meshnet.text.sampling import scored

    logits = torch.tensor([[1.0, 3.0, -2.0, 0.5, 2.0]]).to(torch.bfloat16)
    exact = torch.log_softmax(logits.float()[0], dim=-1)
    score = scored(logits, 4, top=2)
    assert score.token == 4 and score.logprob == float(exact[4])
    assert score.top == ((1, float(exact[1])), (4, float(exact[4])))
    assert scored(logits, 0, top=0).top == ()
