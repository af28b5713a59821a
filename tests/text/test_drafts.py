"""Prompt-lookup drafts, adaptive draft lengths and speculative acceptance: pure functions."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from meshnet.entry.generation import seeded_rng
from meshnet.text.drafts import DraftState, after_plain, after_verify, lookup
from meshnet.text.params import SamplingParams
from meshnet.text.sampling import accept_drafts, sample


@pytest.mark.parametrize(
    ("tokens", "k", "expected"),
    [
        ([], 4, []),
        ([1, 2, 3], 4, []),  # nothing recurs
        ([1, 2, 3, 4, 1, 2], 4, [3, 4, 1, 2]),  # "1 2" came before: what followed it
        ([1, 2, 3, 4, 1, 2], 2, [3, 4]),  # at most k
        ([1, 2, 3, 4, 1, 2], 0, []),
        ([5, 1, 2, 8, 9, 1, 2, 7, 1, 2], 3, [7, 1, 2]),  # the latest occurrence wins
        ([1, 2, 3, 9, 2, 3, 1, 2, 3], 2, [9, 2]),  # the longest suffix first: "1 2 3"
        ([7, 7, 7, 7], 3, [7]),  # an occurrence ends before the suffix does
        ([4, 2, 6, 2], 3, []),  # one token recurring is below the shortest n-gram (2)
    ],
)
def test_lookup_continues_the_latest_earlier_occurrence_of_the_suffix(
    tokens: list[int], k: int, expected: list[int]
) -> None:
    assert lookup(tokens, k) == expected


@given(st.lists(st.integers(0, 5), max_size=60), st.integers(0, 8))
def test_a_lookup_draft_is_a_copy_of_what_once_followed_the_suffix(
    tokens: list[int], k: int
) -> None:
    draft = lookup(tokens, k)
    assert len(draft) <= k
    if draft:  # some earlier 2..3-token match of the suffix was followed by the draft
        assert any(
            tokens[i : i + n] == tokens[-n:] and tokens[i + n : i + n + len(draft)] == draft
            for n in (2, 3)
            for i in range(len(tokens) - n)
        )


def test_drafting_starts_after_a_plain_step_and_grows_while_it_pays() -> None:
    state = DraftState(0)
    state = after_plain(state, 0.100, initial=4, probe_every=16)
    assert state == DraftState(4, 0.100)
    state = after_verify(state, drafted=4, accepted=4, took_s=0.110, max_length=6)
    assert state.length == 6  # all stood and paid: doubled, up to the bound
    state = after_verify(state, drafted=6, accepted=2, took_s=0.110, max_length=6)
    assert state.length == 3  # two stood: one more than that next
    state = after_verify(state, drafted=3, accepted=0, took_s=0.130, max_length=6)
    assert state.length == 1  # did not pay: halved


def test_drafting_stops_where_it_does_not_pay_and_probes_again() -> None:
    state = DraftState(1, plain_s=0.010)
    state = after_verify(state, drafted=1, accepted=0, took_s=0.014, max_length=8)
    assert state.length == 0
    for _ in range(15):
        state = after_plain(state, 0.010, initial=4, probe_every=16)
        assert state.length == 0
    assert after_plain(state, 0.010, initial=4, probe_every=16).length == 1


def test_a_round_with_every_draft_taken_may_still_not_pay() -> None:
    """On a compute-bound loopback a 9-token round can cost more than 2 plain steps."""
    state = after_verify(DraftState(8, 0.010), drafted=8, accepted=1, took_s=0.025, max_length=8)
    assert state.length == 4


def test_greedy_acceptance_keeps_drafts_while_they_are_the_argmax() -> None:
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])
    greedy, generator = SamplingParams(temperature=0.0), seeded_rng(0, 0)
    assert accept_drafts(logits, [1, 2], greedy, generator) == (2, 0)  # both, then the bonus
    assert accept_drafts(logits, [1, 0], greedy, generator) == (1, 2)  # the second falls
    assert accept_drafts(logits, [2, 2], greedy, generator) == (0, 1)
    assert accept_drafts(logits[:1], [], greedy, generator) == (0, 1)  # no drafts: a step


def chi_square_p(counts: Counter[tuple[int, ...]], expected: dict[tuple[int, ...], float]) -> float:
    """p-value of a chi-square goodness of fit (Wilson-Hilferty normal approximation)."""
    n = sum(counts.values())
    stat = sum((counts[k] - n * p) ** 2 / (n * p) for k, p in expected.items())
    dof = len(expected) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("drafts", [[0, 0], [1, 2], [2, 1]])
def test_sampled_acceptance_gives_each_pair_of_tokens_its_plain_probability(
    drafts: list[int],
) -> None:
    """Two tokens drawn by speculation (drafts likely, unlikely or mixed) against the
    plain distribution, position by position; logits fixed per position for the test."""
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.5, 1.0], [1.0, 0.0, 2.0]])
    params, generator = SamplingParams(temperature=1.0), seeded_rng(7, 0)
    probs = [row.softmax(-1).tolist() for row in logits]
    expected = {(a, b): probs[0][a] * probs[1][b] for a in range(3) for b in range(3)}
    # a pair whose first token fell is completed by a plain draw at position 1
    counts: Counter[tuple[int, ...]] = Counter()
    for _ in range(6000):
        taken, after = accept_drafts(logits, drafts, params, generator)
        pair = [*drafts[:taken], after]
        if len(pair) < 2:
            pair.append(sample(logits[1], params, generator))
        counts[tuple(pair[:2])] += 1
    assert chi_square_p(counts, expected) > 0.001
