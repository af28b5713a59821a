"""The request path with fake runners: prefill chunks, decoding, stops, sessions, concurrency."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from meshnet.errors import RequestError
from meshnet.text.events import Delta, Event, Finished
from meshnet.text.params import GenerationParams, SamplingParams
from tests.conftest import run
from tests.entry.fakes import fake_mesh

GREEDY = SamplingParams(temperature=0.0)


def generate(prompt: str, **params: object) -> tuple[str, Finished]:
    generator, _, _ = fake_mesh()
    return run(collect(generator, prompt, GenerationParams(**params)))  # type: ignore[arg-type]


async def collect(generator: object, prompt: str, params: GenerationParams) -> tuple[str, Finished]:
    events: list[Event] = [
        e
        async for e in generator.stream(generator.codec.encode(prompt), params)  # type: ignore[attr-defined]
    ]
    end = events[-1]
    assert isinstance(end, Finished)
    assert all(isinstance(e, Delta) for e in events[:-1])
    return "".join(e.text for e in events[:-1] if isinstance(e, Delta)), end


def test_greedy_continues_the_alphabet_until_max_tokens() -> None:
    text, end = generate("abc", max_tokens=5, sampling=GREEDY)
    assert text == "defgh"
    assert (end.reason, end.prompt_tokens, end.completion_tokens) == ("length", 3, 5)
    assert [str(h.span) for h in end.route] == ["0:2", "2:4", "4:6"]


def test_end_of_sequence_stops_and_is_not_emitted() -> None:
    text, end = generate("|", max_tokens=50, sampling=GREEDY)  # 124 -> }, ~, DEL, then id 0
    assert text == "}~\x7f" and end.reason == "stop" and end.completion_tokens == 3


@pytest.mark.parametrize(
    ("stop", "text"),
    [
        (("f",), "de"),
        (("fg", "zz"), "de"),
        (("efx",), "defghij"),  # a prefix of the stop is held back, then released
        (("hij",), "defg"),
    ],
)
def test_stop_sequences(stop: tuple[str, ...], text: str) -> None:
    out, end = generate("abc", max_tokens=7, stop=stop, sampling=GREEDY)
    assert out == text
    assert end.reason == ("length" if text == "defghij" else "stop")


def test_seeded_sampling_is_reproducible() -> None:
    params = GenerationParams(max_tokens=20, sampling=SamplingParams(temperature=2.0, seed=3))
    generator, _, _ = fake_mesh(margin=2.0)
    first = run(collect(generator, "a", params))[0]
    again = run(collect(generator, "a", params))[0]
    other = run(collect(generator, "a", GenerationParams(20, (), SamplingParams(2.0, seed=4))))
    assert first == again != other[0]


def test_long_prompt_goes_as_chunks_through_every_hop() -> None:
    # one chunk at a time (pipelined prompts: tests/entry/test_prefill.py)
    generator, transport, runners = fake_mesh(chunk_tokens=16, pipelined=False)
    prompt = "abcdefghijklmnopqrstuvwxyz" * 3  # 78 tokens -> 5 chunks of 16
    text, end = run(collect(generator, prompt, GenerationParams(4, (), GREEDY)))
    assert text == "{|}~" and end.prompt_tokens == 78
    prefill = [(address, tokens, index) for address, tokens, index, total in transport.frames[:10]]
    sizes = [16, 16, 16, 16, 14]
    # each chunk passes hop a, then hop b, before the next chunk starts
    assert prefill == [(a, size, i) for i, size in enumerate(sizes) for a in ("a", "b")]
    assert {total for *_, total in transport.frames[:10]} == {5}
    assert [tokens for _, tokens, _, _ in transport.frames[10:]] == [1] * 6  # decode steps


def test_sessions_are_closed_on_every_hop_when_generation_ends() -> None:
    generator, transport, runners = fake_mesh()
    run(collect(generator, "abc", GenerationParams(3, (), GREEDY)))
    assert sorted(a for a, _ in transport.closed) == ["a", "b"]
    assert all(r.session_count() == 0 for r in runners.values())


def test_sessions_are_closed_when_the_consumer_stops_early() -> None:
    generator, transport, runners = fake_mesh()

    async def take_one() -> None:
        stream = generator.stream([97], GenerationParams(50, (), GREEDY))
        await anext(stream)
        await stream.aclose()  # what a client going away does to the stream

    run(take_one())
    assert all(r.session_count() == 0 for r in runners.values())


def test_concurrent_requests_equal_the_same_requests_one_by_one() -> None:
    prompts = ["abc", "klm", "!", "PQR", "xy", "0123"]
    params = GenerationParams(12, (), GREEDY)
    generator, _, runners = fake_mesh(chunk_tokens=2)

    async def all_at_once() -> list[str]:
        results = await asyncio.gather(*(collect(generator, p, params) for p in prompts))
        return [text for text, _ in results]

    one_by_one = [run(collect(generator, p, params))[0] for p in prompts]
    assert run(all_at_once()) == one_by_one
    assert all(r.session_count() == 0 for r in runners.values())


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [("", GenerationParams(4), "prompt"), ("a", GenerationParams(5000), "max_tokens")],
)
def test_requests_that_cannot_fit_are_refused_before_any_work(
    prompt: str, params: GenerationParams, field: str
) -> None:
    generator, transport, runners = fake_mesh()
    with pytest.raises(RequestError) as refused:
        run(collect(generator, prompt, params))
    assert refused.value.field == field
    assert all(r.session_count() == 0 for r in runners.values()) and not transport.closed


def test_sessions_are_closed_when_the_request_task_is_cancelled() -> None:
    """What Starlette does when a streaming client disconnects: cancel the task's scope."""
    generator, _, runners = fake_mesh()

    async def go() -> None:
        started = anyio.Event()

        async def consume() -> None:
            async for _ in generator.stream([97], GenerationParams(25, (), GREEDY)):
                started.set()

        async with anyio.create_task_group() as group:
            group.start_soon(consume)
            await started.wait()
            assert runners["a"].session_count() == 1
            group.cancel_scope.cancel()
        await asyncio.sleep(0.05)  # the shielded clean-up finishes

    run(go())
    assert all(r.session_count() == 0 for r in runners.values())
