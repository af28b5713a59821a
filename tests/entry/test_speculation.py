"""Speculative decoding with fake hops (ADR-0038): drafts verified in one frame, rejected
ones rewound on every cache, and the output of plain decoding, token for token."""

from __future__ import annotations

import math

import pytest
import torch

from meshnet.entry.session import PipelineSession
from meshnet.node.runner import EchoRunner
from meshnet.text.events import Finished
from meshnet.text.params import GenerationParams, SamplingParams
from meshnet.types import SessionId
from meshnet.wire import FrameMeta
from tests.conftest import run
from tests.entry.fakes import events_of, fake_mesh, scored
from tests.entry.test_failover import kill_at
from tests.entry.test_generation import collect

GREEDY = GenerationParams(12, (), SamplingParams(temperature=0.0))
# the fake model continues the alphabet: a quote of it is drafted right; in "wrong drafts"
# (26 tokens, 2 chunks of 16) the model's "...abcd" is drafted as the prompt's "exyza": the
# verify frame at 27 keeps "e", and the next frame, at 29, rewinds "xyza" away
PROMPTS = {
    "quote": "abcdefghijklmnopqrstuvwxyz;abcde",
    "wrong drafts": "ABCDEFGHIJKLMNOP" + "abcdexyzab",
    "nothing recurs": "the cat",
}


def generate(prompt: str, drafts: int, **mesh: object) -> tuple[str, Finished]:
    generator, _, _ = fake_mesh(chunk_tokens=16, max_drafts=drafts, **mesh)  # type: ignore[arg-type]
    return run(collect(generator, prompt, GREEDY))


@pytest.mark.parametrize("push", [False, True])
@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_greedy_output_with_drafts_equals_plain_decoding(prompt: str, push: bool) -> None:
    """Context runners (`tests/entry/fakes.py`): each token's logprob depends on what every
    cache held when it was chosen, so a rejected draft left in a cache, or one token too
    many dropped, shows in the scores though the text stays the same."""
    plain, plain_end, plain_scores = scored_run(prompt, 0, push=push)
    drafted, end, scores = scored_run(prompt, 8, push=push)
    assert drafted == plain and end.token_ids == plain_end.token_ids
    assert end.completion_tokens == plain_end.completion_tokens
    assert scores == plain_scores and len(set(scores)) > 1  # the margins moved with the context
    assert plain_end.drafted_tokens == 0
    if prompt != PROMPTS["nothing recurs"]:
        assert end.drafted_tokens > 0
    if prompt == PROMPTS["wrong drafts"]:
        assert 0 < end.accepted_tokens < end.drafted_tokens  # hits, then a rewind


def scored_run(prompt: str, drafts: int, **mesh: object) -> tuple[str, Finished, list[float]]:
    """Greedy text, end and each token's logprob over context runners."""
    params = GenerationParams(12, (), SamplingParams(temperature=0.0))
    generator, _, _ = fake_mesh(chunk_tokens=16, max_drafts=drafts, context=True, **mesh)  # type: ignore[arg-type]
    return run(scored(generator, prompt, params))


def test_drafts_and_accepted_ones_are_counted_in_metrics() -> None:
    generator, _, _ = fake_mesh(chunk_tokens=16, max_drafts=8)
    _, end = run(collect(generator, PROMPTS["quote"], GREEDY))
    metrics = generator.metrics
    drafted = metrics.draft_tokens.labels(generator.model)._value.get()
    accepted = metrics.accepted_tokens.labels(generator.model)._value.get()
    assert (drafted, accepted) == (end.drafted_tokens, end.accepted_tokens)
    assert accepted > 0


def test_accepted_drafts_save_frames_and_every_cache_keeps_only_accepted_tokens() -> None:
    generator, transport, runners = fake_mesh(chunk_tokens=16, max_drafts=8)
    lengths: dict[str, list[tuple[int, int, bool]]] = {}
    for name, runner in runners.items():
        forward = runner.forward

        def logged(
            meta: FrameMeta, hidden: object, name: str = name, f: object = forward
        ) -> object:
            lengths.setdefault(name, []).append((meta.position, hidden.shape[1], meta.rewind))  # type: ignore[attr-defined]
            return f(meta, hidden)  # type: ignore[operator]

        runner.forward = logged  # type: ignore[method-assign]
    text, end = run(collect(generator, PROMPTS["quote"], GREEDY))
    assert text == "fghijklmnopq"
    assert end.accepted_tokens == end.drafted_tokens > 6  # every draft right
    plain_frames = 2 + 11  # a prompt of 2 chunks, then 11 decode steps
    assert len([f for f in transport.frames if f[0] == "a"]) < plain_frames - 6
    for calls in lengths.values():  # each frame continues what the cache kept
        held = 0
        for position, tokens, rewind in calls:
            assert position == held or (rewind and position < held)
            held = position + tokens


def test_a_rejected_draft_is_rewound_on_every_cache_by_the_next_frame() -> None:
    generator, transport, runners = fake_mesh(chunk_tokens=16, max_drafts=8)
    sessions: list[tuple[str, int]] = []
    for name in ("local", "a", "b"):
        runner: EchoRunner = runners[name]
        forward = runner.forward

        def logged(
            meta: FrameMeta, hidden: object, name: str = name, f: object = forward
        ) -> object:
            out = f(meta, hidden)  # type: ignore[operator]
            sessions.append((name, runners[name]._sessions[meta.session][0]))
            return out

        runner.forward = logged  # type: ignore[method-assign]
    text, end = run(collect(generator, PROMPTS["wrong drafts"], GREEDY))
    assert text == generate(PROMPTS["wrong drafts"], 0)[0]
    assert end.accepted_tokens < end.drafted_tokens  # the wrap was drafted wrong
    final = {name: held for name, held in sessions}  # the last frame's cache length
    held = end.prompt_tokens + end.completion_tokens - 1  # the last token is never sent
    assert final == {"local": held, "a": held, "b": held}  # accepted tokens, no more


# the verify frame, the frame that rewinds, a later step
@pytest.mark.parametrize(("address", "position"), [("b", 27), ("a", 29), ("b", 29), ("a", 31)])
def test_a_hop_killed_mid_generation_is_replayed_with_accepted_tokens_only(
    address: str, position: int
) -> None:
    prompt = PROMPTS["wrong drafts"]
    generator, transport, _ = fake_mesh(chunk_tokens=16, replicas=True, max_drafts=8)
    kill_at(transport, address, position)
    text, end = run(collect(generator, prompt, GREEDY))
    assert text == generate(prompt, 0)[0]
    assert len(end.failover_pauses_s) == 1


def test_sampled_generations_with_drafts_keep_their_seeded_tokens_valid() -> None:
    """At temperature > 0 the fake model is near-certain (margin 20): speculation takes
    the drafts the plain sampler would take, and the text is the same for a seed."""
    params = GenerationParams(10, (), SamplingParams(temperature=1.0, seed=3))
    outs = []
    for drafts in (0, 8):
        generator, _, _ = fake_mesh(chunk_tokens=16, max_drafts=drafts)
        outs.append(run(collect(generator, PROMPTS["quote"], params))[0])
    assert outs[0] == outs[1] == "fghijklmno"


def test_a_session_rewind_trims_history_and_replay_inputs() -> None:
    session = PipelineSession(SessionId("s-1"), [])
    session.inputs = [[torch.zeros(1, 5, 2), torch.ones(1, 3, 2)], [torch.zeros(1, 8, 2)]]
    session.history, session.position = list(range(8)), 8
    session.recount()
    session.rewind(4)
    assert (session.position, session.history, session.rewinding) == (4, [0, 1, 2, 3], True)
    assert [[p.shape[1] for p in pieces] for pieces in session.inputs] == [[4], [4]]
    assert session.replay_bytes == 2 * 4 * 2 * 4


class FavouriteHead:
    """Always favours "x" (logit 1.0), then "y" (0.5); every other id, end of text (0)
    included, gets 0."""

    embed_tokens = staticmethod(lambda ids, position: torch.zeros(*ids.shape, 8))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*hidden.shape[:-1], 128)
        out[..., ord("x")], out[..., ord("y")] = 1.0, 0.5
        return out


@pytest.mark.parametrize("drafts", [0, 8])
def test_penalties_reach_every_round_drafted_or_not(drafts: int) -> None:
    """Greedy "x" forever; a presence penalty of 1 takes "x" once, then "y", then nothing
    stands above end of text. Drafts (the prompt's "xxxx" invites them) change nothing."""
    penalized = SamplingParams(temperature=0.0, presence_penalty=1.0)
    outputs = []
    for sampling in (SamplingParams(temperature=0.0), penalized):
        generator, _, _ = fake_mesh(max_drafts=drafts, head=FavouriteHead())
        text, _ = run(collect(generator, "xxxx", GenerationParams(8, (), sampling)))
        outputs.append(text)
    assert outputs == ["xxxxxxxx", "xy"]


def test_drafted_rounds_score_their_tokens_as_plain_decoding_does() -> None:
    """Verified drafts get their logprobs from their own rows of the verify frame: the same
    list, token for token, as one token a round."""
    params = GenerationParams(12, (), SamplingParams(temperature=0.0), logprobs=2)

    async def scores(drafts: int) -> list[object]:
        generator, _, _ = fake_mesh(chunk_tokens=16, max_drafts=drafts, margin=3.0)
        ids = generator.codec.encode(PROMPTS["quote"])
        return [s async for e in generator.stream(ids, params) for s in getattr(e, "logprobs", ())]

    plain, drafted = run(scores(0)), run(scores(8))
    assert len(plain) == 12 and drafted == plain


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("prompt", ["quote", "wrong drafts"])
@pytest.mark.parametrize("drafts", [0, 8])
def test_every_token_is_scored_under_the_row_that_chose_it(
    drafts: int, prompt: str, temperature: float
) -> None:
    """Known values: the counting head gives its input's next id the margin (3) and every
    other id 0, so a token's logprob is `3 - log(e^3 + 127)` where it follows the token
    before it and `-log(e^3 + 127)` where not, whatever the temperature (scores are the
    model's own distribution). With drafts that miss, the token after the accepted ones is
    scored by the row after them, not by the frame's last row."""
    params = GenerationParams(12, (), SamplingParams(temperature=temperature, seed=5), logprobs=1)
    generator, _, _ = fake_mesh(chunk_tokens=16, max_drafts=drafts, margin=3.0)
    ids = generator.codec.encode(PROMPTS[prompt])
    got = run(events_of(generator, PROMPTS[prompt], params))
    scores = [s for e in got for s in getattr(e, "logprobs", ())]
    end = next(e for e in got if isinstance(e, Finished))
    assert [s.token for s in scores] == end.token_ids and len(scores) == 12
    other = -math.log(math.exp(3.0) + 127)
    for before, s in zip([ids[-1], *end.token_ids], scores, strict=False):
        expected = other + 3.0 if s.token == (before + 1) % 128 else other
        assert s.logprob == pytest.approx(expected, abs=1e-5), (before, s)
    if drafts and prompt == "wrong drafts" and temperature == 0.0:
        assert 0 < end.accepted_tokens < end.drafted_tokens  # a draft missed after hits
