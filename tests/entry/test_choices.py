"""Several answers to one prompt (`n`, ADR-0045) over fake hops: the prompt crosses the mesh
once, each further answer forks its session on every cache, and each answer is what a
request for it alone would give, through drafts, push and failover."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from meshnet.errors import LimitError, MeshError
from meshnet.node.runner import EchoRunner
from meshnet.text.events import Delta, Event, Finished
from meshnet.text.params import GenerationParams, SamplingParams
from meshnet.wire import FrameMeta
from tests.conftest import run
from tests.entry.fakes import events_of, fake_mesh, scored
from tests.entry.test_failover import kill_at

GREEDY = GenerationParams(10, (), SamplingParams(temperature=0.0))
PROMPT = "abcdefghijklmnopqrstuvwxyz;abcde"  # 32 tokens: two wire chunks of 16


async def answers(generator: object, prompt: str, params: GenerationParams) -> list[str]:
    """Each answer's text, by index, checking the events' order per answer."""
    events: list[Event] = [
        e
        async for e in generator.stream(generator.codec.encode(prompt), params)  # type: ignore[attr-defined]
    ]
    texts: dict[int, str] = {}
    ended: set[int] = set()
    for event in events:
        assert event.index not in ended, "an event after its answer's end"
        if isinstance(event, Delta):
            texts[event.index] = texts.get(event.index, "") + event.text
        else:
            assert isinstance(event, Finished)
            ended.add(event.index)
    assert ended == set(range(params.n))
    return [texts.get(i, "") for i in range(params.n)]


def alone(prompt: str, params: GenerationParams, **mesh: object) -> str:
    generator, _, _ = fake_mesh(chunk_tokens=16, **mesh)  # type: ignore[arg-type]
    return run(answers(generator, prompt, replace(params, n=1)))[0]


def record_frames(runners: dict[str, EchoRunner]) -> dict[str, list[FrameMeta]]:
    """Every frame each runner is asked to run, in order."""
    seen: dict[str, list[FrameMeta]] = {name: [] for name in runners}
    for name, runner in runners.items():
        forward = runner.forward

        def recording(
            meta: FrameMeta, hidden: torch.Tensor, name: str = name, forward: object = forward
        ) -> torch.Tensor:
            seen[name].append(replace(meta, chunk_total=hidden.shape[1]))  # total: its tokens
            return forward(meta, hidden)  # type: ignore[operator]

        runner.forward = recording  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("push", [False, True])
def test_the_prompt_crosses_every_hop_once_and_the_answers_fork_from_it(push: bool) -> None:
    generator, _, runners = fake_mesh(chunk_tokens=16, push=push)
    seen = record_frames(runners)
    texts = run(answers(generator, PROMPT, replace(GREEDY, n=3)))
    assert texts == [alone(PROMPT, GREEDY, push=push)] * 3
    prompt = len(PROMPT)
    for name, frames in seen.items():
        prefill = [m for m in frames if m.position < prompt]
        assert sum(m.chunk_total for m in prefill) == prompt, name  # the prompt, once
        assert len({m.session for m in prefill}) == 1
        parent = prefill[0].session
        forks = [m for m in frames if m.fork is not None]
        assert [(m.fork, m.position) for m in forks] == [(parent, prompt)] * 2, name
        assert len({m.session for m in frames}) == 3
    assert all(r.session_count() == 0 for r in runners.values()), "a session was left open"


def test_seeded_answers_differ_and_come_again_and_the_first_is_the_single_answer() -> None:
    params = GenerationParams(8, (), SamplingParams(temperature=1.0, seed=5), n=4)
    generator, _, _ = fake_mesh(chunk_tokens=16, margin=1.0)
    first = run(answers(generator, "abc", params))
    again = run(answers(fake_mesh(chunk_tokens=16, margin=1.0)[0], "abc", params))
    assert first == again
    assert len(set(first)) > 1
    assert first[0] == alone("abc", params, margin=1.0)


def test_answers_with_drafts_equal_plain_decoding() -> None:
    generator, _, _ = fake_mesh(chunk_tokens=16, max_drafts=8)
    assert run(answers(generator, PROMPT, replace(GREEDY, n=2))) == [alone(PROMPT, GREEDY)] * 2


def test_each_answer_keeps_its_own_limits_and_logprobs() -> None:
    params = GenerationParams(6, ("h",), SamplingParams(temperature=0.0), logprobs=1, n=2)
    generator, _, _ = fake_mesh(chunk_tokens=16)
    events = run(_events(generator, "abc", params))
    for index in (0, 1):
        end = next(e for e in events if isinstance(e, Finished) and e.index == index)
        deltas = [e for e in events if isinstance(e, Delta) and e.index == index]
        scored = [s for e in deltas for s in e.logprobs]
        assert end.reason == "stop" and end.completion_tokens == len(scored) == 5  # d e f g h
        assert "".join(e.text for e in deltas) == "defg"


async def _events(generator: object, prompt: str, params: GenerationParams) -> list[Event]:
    stream = generator.stream(generator.codec.encode(prompt), params)  # type: ignore[attr-defined]
    return [e async for e in stream]


@pytest.mark.parametrize("push", [False, True])
@pytest.mark.parametrize(("address", "position"), [("a", 32), ("b", 32), ("a", 35)])
def test_a_hop_killed_at_or_after_the_forks_is_replayed_for_every_answer(
    address: str, position: int, push: bool
) -> None:
    """At 32 the forks' first frames meet the dead hop: each answer's replacement is rebuilt
    from the replay inputs the answer shares with the prompt's session, not from a fork."""
    generator, transport, runners = fake_mesh(chunk_tokens=16, replicas=True, push=push)
    kill_at(transport, address, position)
    texts = run(answers(generator, PROMPT, replace(GREEDY, n=3)))
    assert texts == [alone(PROMPT, GREEDY)] * 3
    assert all(r.session_count() == 0 for name, r in runners.items() if name != address)


def test_an_answer_that_fails_ends_the_request_and_every_session_closes() -> None:
    generator, transport, runners = fake_mesh(chunk_tokens=16)  # no replacement for a hop
    kill_at(transport, "b", 34)
    with pytest.raises(MeshError):
        run(answers(generator, PROMPT, replace(GREEDY, n=3)))
    assert all(r.session_count() == 0 for name, r in runners.items() if name != "b")


def test_answers_count_against_the_entry_session_limit() -> None:
    """Each answer holds a session: n over `max_sessions` is a 429 before any token, and
    the sessions already made are closed."""
    generator, _, runners = fake_mesh(chunk_tokens=16)
    generator.pipeline.executor.max_sessions = 2  # type: ignore[attr-defined]
    with pytest.raises(LimitError, match="limit"):
        run(answers(generator, "abc", replace(GREEDY, n=3)))
    assert all(r.session_count() == 0 for r in runners.values())
    assert run(answers(generator, "abc", replace(GREEDY, n=2))) == [alone("abc", GREEDY)] * 2


def test_a_reader_leaving_mid_answers_closes_every_session_and_stops_every_answer() -> None:
    generator, _, runners = fake_mesh(chunk_tokens=16)

    async def leave_early() -> int:
        stream = generator.stream(
            generator.codec.encode("abc"), replace(GREEDY, n=3, max_tokens=500)
        )
        seen = [await anext(stream) for _ in range(4)]
        await stream.aclose()  # every answer stopped before the sessions closed
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not [t for t in others if "pump" in repr(t.get_coro())], "an answer still runs"
        return len(seen)

    assert run(leave_early()) == 4
    assert all(r.session_count() == 0 for r in runners.values())
    assert generator.pipeline.metrics.failovers._value.get() == 0  # no answer met a closed hop


@pytest.mark.parametrize("push", [False, True])
def test_forked_answers_score_as_a_request_alone_would(push: bool) -> None:
    """Context runners: each answer's logprobs show what every forked cache held, and they
    are the single request's: a fork that copied a token too many or too few would show."""
    params = replace(GREEDY, logprobs=0)
    generator, _, _ = fake_mesh(chunk_tokens=16, push=push, context=True)
    events = run(events_of(generator, PROMPT, replace(params, n=3)))
    by_answer: dict[int, list[float]] = {}
    for e in events:
        by_answer.setdefault(e.index, []).extend(s.logprob for s in getattr(e, "logprobs", ()))
    single, _, _ = fake_mesh(chunk_tokens=16, push=push, context=True)
    alone_scores = run(scored(single, PROMPT, params))[2]
    assert len(alone_scores) == 10 and len(set(alone_scores)) > 1
    assert by_answer == {i: alone_scores for i in range(3)}
