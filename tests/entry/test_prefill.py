"""Pipelined prefill with fake hops (ADR-0036): chunks overlap across the hops, each hop
still sees them in order, and the output is the one-chunk-at-a-time output."""

from __future__ import annotations

from typing import Any

import pytest

from meshnet.text.params import GenerationParams, SamplingParams
from meshnet.wire import FrameMeta
from tests.conftest import run
from tests.entry.fakes import fake_mesh, scored
from tests.entry.test_failover import failure_free_scores, kill_at
from tests.entry.test_generation import collect
from tests.entry.test_push import moved_off

PARAMS = GenerationParams(6, (), SamplingParams(temperature=0.0))
PROMPT = "abcdefghijklmnopqrstuvwxyz" * 3  # 78 tokens: 5 chunks of 16


def sequential() -> str:
    generator, _, _ = fake_mesh(chunk_tokens=16, pipelined=False)
    return run(collect(generator, PROMPT, PARAMS))[0]


def test_chunks_overlap_across_the_hops_and_each_hop_sees_them_in_order() -> None:
    generator, transport, runners = fake_mesh(chunk_tokens=16)
    text, end = run(collect(generator, PROMPT, PARAMS))
    assert text == sequential() and end.prompt_tokens == 78
    prefill = transport.frames[:10]
    for address in ("a", "b"):
        assert [(i, t) for a, _, i, t in prefill if a == address] == [(i, 5) for i in range(5)]
    places = [address for address, *_ in prefill]
    assert places.index("b") < len(places) - 1 - places[::-1].index("a")  # b starts before a ends
    assert [tokens for _, tokens, _, _ in transport.frames[10:]] == [1] * 10  # decode steps
    assert all(r.session_count() == 0 for r in runners.values())


def test_the_entrys_span_runs_in_pieces_each_sent_on_when_done() -> None:
    generator, transport, _ = fake_mesh(chunk_tokens=16, piece_tokens=32)
    pipeline = generator.pipeline
    events: list[tuple[str, int]] = []
    local_pass = pipeline.local_pass

    async def logged(
        session: Any, ids: list[int], position: int, pick: Any = None, rows: int = 1
    ) -> Any:
        out = await local_pass(session, ids, position, pick, rows)
        events.append(("local", position))
        return out

    pipeline.local_pass = logged  # type: ignore[method-assign]
    transport.before_frame = lambda address, meta: events.append((address, meta.position))
    text, _ = run(collect(generator, PROMPT, PARAMS))
    assert text == sequential()
    pieces = [position for where, position in events if where == "local"]
    assert pieces[:3] == [0, 32, 64]  # 78 tokens in pieces of 32, 32, 14
    assert events.index(("a", 0)) < events.index(("local", 64))  # hop a did not wait
    assert [(i, t) for a, _, i, t in transport.frames[:10] if a == "b"] == [
        (i, 5) for i in range(5)
    ]  # chunk numbers run over the pieces


@pytest.mark.parametrize(("address", "position"), [("a", 32), ("b", 16), ("b", 64)])
@pytest.mark.parametrize("push", [False, True])
def test_a_hop_failing_mid_prompt_moves_the_session_and_the_output_is_unchanged(
    address: str, position: int, push: bool
) -> None:
    generator, transport, runners = fake_mesh(
        chunk_tokens=16, replicas=True, push=push, context=True
    )
    kill_at(transport, address, position)
    text, end, scores = run(scored(generator, PROMPT, PARAMS))
    assert text == sequential() and scores == failure_free_scores(PROMPT, PARAMS, pipelined=False)
    moved_off(generator, end, runners, address)


def test_a_short_prompt_goes_as_one_chunk_as_before() -> None:
    generator, transport, _ = fake_mesh(chunk_tokens=16)
    seen: list[FrameMeta] = []
    transport.before_frame = lambda address, meta: seen.append(meta)
    run(collect(generator, "abc", PARAMS))
    assert [(m.position, m.chunk_total) for m in seen[:2]] == [(0, 1), (0, 1)]


def test_a_pushing_entry_keeps_only_the_first_hops_inputs_after_a_pipelined_prompt() -> None:
    generator, _, _ = fake_mesh(chunk_tokens=16, push=True)
    pipeline = generator.pipeline

    async def prompt() -> list[int]:
        session = await pipeline.open()
        await pipeline.feed(session, list(range(1, 79)), lambda logits: 0)
        held = [sum(t.shape[1] for t in pieces) for pieces in session.inputs]
        await pipeline.close(session)
        return held

    assert run(prompt()) == [78, 0]
