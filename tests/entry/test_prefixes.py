"""Prompt prefixes reused across requests (ADR-0058), without a model.

The index's decisions are table-driven and property-checked here; the entry's use of it runs
over context runners (`tests/entry/fakes.py`), whose logprobs show every token each cache
held: a reused prefix one token too long or short, or another client's, would change them.
Real weights and real processes: `tests/e2e/test_prefix_cache.py`.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet.entry.generation import Generator
from meshnet.entry.prefixes import BLOCK_TOKENS, PrefixIndex, chain, common_length, scope_of
from meshnet.entry.session import PipelineSession, cut
from meshnet.entry.transport import InProcessTransport
from meshnet.text.events import Delta, Finished
from meshnet.text.params import GenerationParams, SamplingParams
from meshnet.types import Hop, LayerSpan, NodeId, SessionId
from tests.conftest import run
from tests.entry.fakes import fake_mesh

GREEDY = GenerationParams(12, (), SamplingParams(temperature=0.0), logprobs=0)
HOP = Hop(NodeId("node-a"), "a", LayerSpan(2, 4))


def kept(sid: str, tokens: list[int], hops: list[Hop] | None = None) -> PipelineSession:
    session = PipelineSession(SessionId(sid), hops or [HOP], list(tokens), len(tokens))
    return session


def index_of(*sessions: tuple[PipelineSession, str]) -> PrefixIndex:
    index = PrefixIndex()
    for session, scope in sessions:
        index.add(session, scope)
    return index


BASE = list(range(1, 200))


@pytest.mark.parametrize(
    ("prompt", "scope", "want"),
    [
        (BASE[:150] + [999] * 10, "k", ("long", 150)),  # diverges inside block 3: exact
        (BASE[:100] + [7] * 20, "k", ("long", 100)),
        (BASE[:63] + [5] * 40, "k", None),  # less than a block in common
        (BASE[:150] + [999], "other", None),  # another client's: never
        (BASE[:180], "k", ("long", 179)),  # all of a prompt held: its last token is fed
        ([5] + BASE[1:150], "k", None),  # the first token differs
    ],
)
def test_the_longest_kept_prefix_in_the_scope_is_found(
    prompt: list[int], scope: str, want: tuple[str, int] | None
) -> None:
    index = index_of((kept("short", BASE[:80]), "k"), (kept("long", BASE), "k"))
    found = index.match(prompt, scope, lambda hops: True)
    assert (None if found is None else (found[0].id, found[1])) == want


def test_a_prefix_on_an_unusable_route_gives_way_to_a_shorter_one() -> None:
    slow = Hop(NodeId("node-slow"), "s", LayerSpan(2, 4))
    index = index_of((kept("short", BASE[:80]), "k"), (kept("long", BASE, [slow]), "k"))
    found = index.match(BASE[:150], "k", lambda hops: slow not in hops)
    assert found is not None and (found[0].id, found[1]) == ("short", 80)


def test_past_its_limits_the_least_recently_used_prefix_goes() -> None:
    index = PrefixIndex(max_prefixes=2)
    assert index.add(kept("a", BASE[:70]), "k") == []
    index.add(kept("b", [9] + BASE[:70]), "k")
    index.match(BASE[:70] + [1], "k", lambda hops: True)  # "a" used: "b" is the oldest now
    gone = index.add(kept("c", [8] + BASE[:70]), "k")
    assert [s.id for s in gone] == ["b"] and list(index.kept) == ["a", "c"]
    assert index.remove(SessionId("a")) is not None and index.remove(SessionId("a")) is None
    assert index.match(BASE[:70] + [1], "k", lambda hops: True) is None  # its blocks went too


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=0, max_size=300),
    st.lists(st.integers(0, 3), min_size=2, max_size=300),
)
def test_a_match_is_exactly_the_common_prefix(held: list[int], prompt: list[int]) -> None:
    """Tokens from a tiny alphabet: many shared blocks, many near misses."""
    prefix = [1] * 64  # most pairs share at least a block
    held, prompt = prefix + held, prefix + prompt
    found = index_of((kept("x", held), "k")).match(prompt, "k", lambda hops: True)
    true = 0
    while true < min(len(held), len(prompt)) and held[true] == prompt[true]:
        true += 1
    want = min(true, len(prompt) - 1)
    assert (found[1] if found else 0) == (want if want >= BLOCK_TOKENS else 0)


@settings(max_examples=60)
@given(
    st.lists(st.integers(0, 3), min_size=0, max_size=200),
    st.lists(st.integers(0, 3), min_size=2, max_size=200),
)
def test_a_wait_for_a_pending_prompt_is_exactly_the_common_prefix(
    pending: list[int], prompt: list[int]
) -> None:
    """As a kept prefix's match: at most all but the prompt's last token (which must be run
    for its logits), within the scope (test review 12-07, P2: a fork of a pending prompt one
    token too long passed every fast test)."""
    prefix = [1] * 64
    pending, prompt = prefix + pending, prefix + prompt
    index = PrefixIndex()
    index.announce(kept("p", []), pending, "k")
    found = index.waiting(prompt, "k", longer_than=0)
    true = 0
    while true < min(len(pending), len(prompt)) and pending[true] == prompt[true]:
        true += 1
    want = min(true, len(prompt) - 1)
    assert (found[1] if found else 0) == (want if want >= BLOCK_TOKENS else 0)
    assert index.waiting(prompt, "another client", longer_than=0) is None


def test_chains_name_whole_prefixes_and_cut_keeps_the_first_tokens() -> None:
    assert chain(BASE[:127]) == chain(BASE[:64]) == chain(BASE)[:1]
    assert chain([0] + BASE[:127])[0] != chain(BASE)[0]
    assert common_length(BASE, BASE[:10] + [0], 5) == 10
    assert common_length(BASE, [0] * 20, 5) == 0  # `known` is checked, never trusted
    inputs = [[torch.zeros(1, 5, 2), torch.ones(1, 5, 2)], []]
    assert [[p.shape[1] for p in ps] for ps in cut(inputs, 7)] == [[5, 2], []]
    assert scope_of("client", "key:a") == "key:a" and scope_of("all", "key:a") == ""
    assert scope_of("off", "key:a") is None and scope_of("client", None) is None


# ---- the entry over context runners ---------------------------------------------------


async def answer(generator: Generator, prompt: str, client: str | None = "key:a") -> tuple:  # type: ignore[type-arg]
    ids = generator.codec.encode(prompt)
    events = [e async for e in generator.stream(ids, GREEDY, client)]
    end = events[-1]
    assert isinstance(end, Finished)
    text = "".join(e.text for e in events if isinstance(e, Delta))
    return text, [s.logprob for e in events for s in getattr(e, "logprobs", ())]


def computed(transport: InProcessTransport, address: str) -> int:
    """Tokens hop `address` ran so far."""
    return sum(tokens for where, tokens, *_ in transport.frames if where == address)


def conversation(turns: int, **mesh: object) -> tuple[list[tuple], list[int]]:  # type: ignore[type-arg]
    """`turns` turns of a chat, each prompt the history so far plus a new line: the answers,
    and the tokens hop a ran for each turn."""
    generator, transport, _ = fake_mesh(context=True, chunk_tokens=16, **mesh)  # type: ignore[arg-type]
    history, answers, ran = "", [], []

    async def go() -> None:
        nonlocal history
        for turn in range(turns):
            history += f"user {turn}: " + "tell me more about the alphabet, please. " * 2
            before = computed(transport, "a")
            text, scores = await answer(generator, history)
            ran.append(computed(transport, "a") - before)
            answers.append((text, scores))
            history += text

    run(go())
    return answers, ran


@pytest.mark.parametrize(
    "mesh",
    [{}, {"push": True}, {"pipelined": False}, {"max_drafts": 4}],
    ids=["relayed", "pushed", "one-chunk-at-a-time", "speculative"],
)
def test_a_conversation_answers_the_same_and_each_turn_runs_only_its_new_tokens(
    mesh: dict[str, object],
) -> None:
    cached, ran = conversation(5, **mesh)
    fresh, ran_fresh = conversation(5, prefix_sharing="off", **mesh)
    assert cached == fresh  # text and every logprob: every cache held the same tokens
    assert ran[0] == ran_fresh[0]
    for turn in range(1, 5):  # the new line (~95 tokens) and the last answer's last token
        assert ran[turn] < 110 < ran_fresh[turn], (ran, ran_fresh)


def test_prefixes_are_not_shared_across_clients_unless_configured() -> None:
    prompt = "the same long system prompt for everybody, " * 4

    async def two(sharing: str) -> tuple[list[int], list[tuple]]:  # type: ignore[type-arg]
        generator, transport, _ = fake_mesh(context=True, prefix_sharing=sharing)
        results, ran = [], []
        for client, extra in (("key:a", "question one"), ("key:b", "question two")):
            before = computed(transport, "a")
            results.append(await answer(generator, prompt + extra, client))
            ran.append(computed(transport, "a") - before)
        return ran, results

    ran, private = run(two("client"))
    assert ran[1] == len(prompt) + len("question two") + GREEDY.max_tokens - 1  # all of it
    shared_ran, shared = run(two("all"))
    assert shared_ran[1] < 40 and shared == private


def test_a_prefix_gone_on_a_hop_is_prefilled_again_and_nobody_is_blamed() -> None:
    generator, transport, runners = fake_mesh(context=True, replicas=True)
    prompt = "a prompt long enough to be kept as a prefix of the next one, " * 2

    async def go() -> tuple[tuple, tuple, tuple]:  # type: ignore[type-arg]
        first = await answer(generator, prompt)
        (kept_id,) = generator.pipeline.prefixes.kept
        runners["b"].drop(kept_id)  # evicted there: the fork misses on hop b
        ids = generator.codec.encode(prompt + "and more")
        events = [e async for e in generator.stream(ids, GREEDY, "key:a")]
        again = "".join(e.text for e in events if isinstance(e, Delta))
        again_scores = [s.logprob for e in events for s in getattr(e, "logprobs", ())]
        # no reuse reported after the miss (test review 12-07, P3: cached_tokens read before
        # the prefill fell back said the prefix was reused)
        assert isinstance(events[-1], Finished) and events[-1].cached_tokens == 0
        fresh, *_ = fake_mesh(context=True, replicas=True)
        return first, (again, again_scores), await answer(fresh, prompt + "and more", None)

    first, again, fresh = run(go())
    assert again == fresh
    assert generator.pipeline.hops.bans.active() == set()
    assert generator.metrics.failovers._value.get() == 0  # type: ignore[attr-defined]
    assert kept_prefixes(runners) == {"local": 1, "a": 1, "b": 1}  # the new one, everywhere


def kept_prefixes(runners: dict) -> dict[str, int]:  # type: ignore[type-arg]
    return {name: r.prefix_stats().kept for name, r in runners.items() if r.prefix_stats().kept}


def test_a_hop_killed_between_turns_fails_over_with_the_kept_inputs() -> None:
    generator, transport, runners = fake_mesh(context=True, replicas=True)
    prompt = "a prompt long enough to be kept as a prefix of the next one, " * 2

    async def go() -> tuple:  # type: ignore[type-arg]
        await answer(generator, prompt)
        transport.dead.add("a")  # the kept prefix's hop 2:4 dies
        return await answer(generator, prompt + "and then")

    killed = run(go())
    fresh, *_ = fake_mesh(context=True, replicas=True)
    assert killed == run(answer(fresh, prompt + "and then", None))
    assert computed(transport, "a2") > len(prompt)  # replayed from the kept inputs


def test_users_sharing_a_system_prompt_at_once_prefill_it_once() -> None:
    system = "you are a helpful assistant who knows the alphabet well. " * 4  # 232 tokens
    generator, transport, _ = fake_mesh(context=True, prefix_sharing="all")

    async def together() -> list[tuple]:  # type: ignore[type-arg]
        asks = [answer(generator, system + f"user {i} asks") for i in range(8)]
        return list(await asyncio.gather(*asks))

    answers = run(together())
    fresh, *_ = fake_mesh(context=True)
    for i, got in enumerate(answers):
        assert got == run(answer(fresh, system + f"user {i} asks", None))
    tails = 8 * (len("user 0 asks") + GREEDY.max_tokens)
    assert computed(transport, "a") < len(system) + tails + 16  # the system prompt once
    assert replace(GREEDY).max_tokens == 12
