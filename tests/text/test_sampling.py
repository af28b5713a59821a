"""Sampling: greedy, temperature, top-k, top-p and seeds, as pure functions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet.entry.generation import seeded_rng
from meshnet.text.params import SamplingParams
from meshnet.text.sampling import sample

LOGITS = torch.tensor([1.0, 3.0, 2.0, 0.5])


def draws(params: SamplingParams, n: int = 400, seed: int = 0) -> set[int]:
    generator = seeded_rng(seed, 0)
    return {sample(LOGITS, params, generator) for _ in range(n)}


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(temperature=0.0), {1}),
        (SamplingParams(temperature=1.0, top_k=1), {1}),
        (SamplingParams(temperature=1.0, top_k=2), {1, 2}),
        (SamplingParams(temperature=5.0), {0, 1, 2, 3}),
        (SamplingParams(temperature=1.0, top_p=0.01), {1}),  # the top token always stays
        (SamplingParams(temperature=1.0, top_p=0.8), {1, 2}),  # p(1)=.63, p(1)+p(2)=.86
    ],
)
def test_which_tokens_can_come_out(params: SamplingParams, allowed: set[int]) -> None:
    assert draws(params) == allowed


def test_greedy_ignores_the_generator() -> None:
    params = SamplingParams(temperature=0.0)
    assert {sample(LOGITS, params, seeded_rng(s, 0)) for s in range(20)} == {1}


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    params = SamplingParams(temperature=1.5)

    def tokens(seed: int) -> list[int]:
        generator = seeded_rng(seed, 0)
        return [sample(LOGITS, params, generator) for _ in range(50)]

    assert tokens(7) == tokens(7)
    assert tokens(7) != tokens(8)


def test_fallback_seed_is_used_when_none_given() -> None:
    params = SamplingParams(temperature=1.5)
    one, two = seeded_rng(None, 42), seeded_rng(None, 42)
    assert [sample(LOGITS, params, one) for _ in range(30)] == [
        sample(LOGITS, params, two) for _ in range(30)
    ]


def test_logit_work_is_float32_whatever_comes_in() -> None:
    bf16 = LOGITS.to(torch.bfloat16)
    assert sample(bf16, SamplingParams(temperature=0.0), seeded_rng(0, 0)) == 1


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-30, 30), min_size=2, max_size=40),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 50),
    top_p=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**31),
)
def test_sampled_token_is_always_among_the_kept_ones(
    logits: list[float], temperature: float, top_k: int, top_p: float, seed: int
) -> None:
    scores = torch.tensor(logits)
    token = sample(scores, SamplingParams(temperature, top_k, top_p), seeded_rng(seed, 0))
    assert 0 <= token < len(logits)
    if top_k:
        assert scores[token] >= torch.topk(scores, min(top_k, len(logits))).values[-1]


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-40])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature: float) -> None:
    logits = torch.tensor([1.0, 30.0, 2.0, 0.0])
    params = SamplingParams(temperature=temperature, top_k=2, top_p=0.5)
    assert sample(logits, params, torch.Generator().manual_seed(0)) == 1


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-12])
def test_a_top_p_that_rounds_to_zero_keeps_the_top_token(top_p: float) -> None:
    logits = torch.zeros(50)
    logits[7] = 0.5
    params = SamplingParams(temperature=1.0, top_p=top_p)
    assert sample(logits, params, torch.Generator().manual_seed(0)) == 7


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 60), st.floats(0.05, 1.0), st.floats(0.1, 3.0), st.integers(0, 2**31))
def test_top_k_draws_among_the_k_best_with_the_full_vectors_probabilities(
    top_k: int, top_p: float, temperature: float, seed: int
) -> None:
    """`sample` draws from the k best only (fast); the distribution is the one
    `probabilities` gives over the whole vocabulary with the others masked."""
    from dataclasses import replace

    from meshnet.text.sampling import probabilities

    logits = torch.randn(500, generator=torch.Generator().manual_seed(seed))
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    full = probabilities(logits, params)
    values, ids = logits.topk(top_k)
    compact = probabilities(values, replace(params, top_k=0))
    assert full is not None and compact is not None
    torch.testing.assert_close(full[ids], compact, rtol=1e-5, atol=1e-7)
    assert float(full.sum() - full[ids].sum()) == pytest.approx(0.0, abs=1e-6)
    drawn = {sample(logits, params, seeded_rng(s, 0)) for s in range(20)}
    assert drawn <= set(ids[compact > 0].tolist())
