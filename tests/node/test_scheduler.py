"""The scheduler (ADR-0027): round planning as a pure function, and the compute thread's
batching, failure isolation and fairness with real asyncio tasks (no model)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnet.node.scheduler import Failed, Scheduler, Waiting, due, plan_round

D, L, H = Waiting("decode"), Waiting("logits"), Waiting(None, tokens=128)  # heavy: a chunk
C = Waiting("decode", tokens=100)  # a prefill chunk of the decoding key's shard


@pytest.mark.parametrize(
    ("waiting", "max_batch", "rounds"),
    [
        ([], 8, []),
        ([D], 8, [[0]]),
        ([D, D, D], 8, [[0, 1, 2]]),
        ([D, L, D, L], 8, [[0, 2], [1, 3]]),  # one call per key, in order of first arrival
        ([D, D, D], 2, [[0, 1]]),  # the overflow waits for the next round
        ([H, D, H, D], 8, [[1, 3], [0]]),  # keyless chunks: last, one a round, oldest first
        ([Waiting(None), Waiting(None), D], 8, [[0], [1], [2]]),  # keyless calls run alone
        ([H, H, H], 8, [[0]]),
        ([D, C, D, C], 8, [[0, 1, 2, 3]]),  # chunks of a key ride in its decode call
        ([C, C, C, D], 8, [[0, 1, 3]]),  # 300 tokens over the cap of 256: the third waits
        ([Waiting("k", tokens=900), C], 8, [[0]]),  # the oldest chunk goes even when too big
        ([C, H], 8, [[0]]),  # a keyless chunk only when no other chunk runs
    ],
)
def test_plan_round(waiting: list[Waiting], max_batch: int, rounds: list[list[int]]) -> None:
    assert plan_round(waiting, max_batch, max_tokens=256) == rounds


def step(member: str, key: str = "k", wait_s: float = 1.0) -> Waiting:
    return Waiting(key, member=member, wait_s=wait_s)


@pytest.mark.parametrize(
    ("waiting", "last", "now_s", "expected"),
    [
        ([step("a")], {"k": {"a", "b"}}, 0.0, [False]),  # b is on its way
        ([step("a"), step("b")], {"k": {"a", "b"}}, 0.0, [True, True]),
        ([step("a", wait_s=0.1)], {"k": {"a", "b"}}, 0.1, [True]),  # it waited long enough
        ([step("c")], {"k": {"a"}}, 0.0, [False]),  # a newcomer waits for the batch
        ([step("a"), H, Waiting(None)], {"k": {"a", "b"}}, 0.0, [False, True, True]),
        ([step("a", key="j")], {"k": {"b"}}, 0.0, [True]),  # another key's members
        ([step("a")], {}, 0.0, [True]),  # the first round of a key
    ],
)
def test_due(
    waiting: list[Waiting], last: dict[str, set[str]], now_s: float, expected: list[bool]
) -> None:
    assert due(waiting, last, now_s) == expected  # type: ignore[arg-type]


jobs = st.lists(
    st.builds(Waiting, st.sampled_from(["a", "b", None]), st.sampled_from([1, 1, 1, 7])),
    max_size=40,
)


@given(jobs, st.integers(1, 6), st.integers(1, 30))
def test_rounds_run_every_job_once_and_keep_their_limits(
    waiting: list[Waiting], max_batch: int, max_tokens: int
) -> None:
    left, runs = list(range(len(waiting))), []
    while left:
        planned = plan_round([waiting[i] for i in left], max_batch, max_tokens)
        assert planned, "a round with jobs waiting must run something"
        batches = [[left[i] for i in batch] for batch in planned]
        chunks = [waiting[i].tokens for b in batches for i in b if waiting[i].tokens > 1]
        assert len(chunks) <= 1 or sum(chunks) <= max_tokens  # the prefill cap of a round
        for batch in batches:
            assert len(batch) <= max_batch and batch == sorted(batch)
            assert len({waiting[i].key for i in batch}) == 1
            assert len(batch) == 1 or waiting[batch[0]].key is not None
        runs += [i for b in batches for i in b]
        left = [i for i in left if i not in set(runs)]
    assert sorted(runs) == list(range(len(waiting)))


def recorder(log: list[list[Any]], fail: Any = None) -> Any:
    def run(items: list[Any]) -> list[Any]:
        assert threading.current_thread().name.startswith("compute")
        log.append(list(items))
        time.sleep(0.01)  # model work: others queue meanwhile
        return [Failed(ValueError(f"bad {i}")) if i == fail else i * 10 for i in items]

    return run


def test_concurrent_calls_of_one_key_run_as_one_batch_and_fail_alone() -> None:
    scheduler, log = Scheduler(), []
    run = recorder(log, fail=3)

    async def scenario() -> list[Any]:
        first = asyncio.create_task(scheduler.submit("k", run, 0))
        await asyncio.sleep(0.002)  # the first round is running: the rest queue behind it
        rest = [scheduler.submit("k", run, i) for i in range(1, 6)]
        return await asyncio.gather(first, *rest, return_exceptions=True)

    results = asyncio.run(scenario())
    assert log == [[0], [1, 2, 3, 4, 5]]
    assert results[:3] == [0, 10, 20] and results[4:] == [40, 50]
    assert isinstance(results[3], ValueError) and "bad 3" in str(results[3])
    assert scheduler.batch_sizes == [5]


def test_sessions_in_step_stay_in_one_batch() -> None:
    """Four sessions: each submits its next step a little after its answer (as a request
    handler does after writing its response). Every round still takes all four."""
    scheduler, log = Scheduler(), []
    run = recorder(log)

    async def session(n: int) -> None:
        for _ in range(5):
            await scheduler.submit("k", run, n, member=n, wait_s=0.05)
            await asyncio.sleep(0.001 * n)  # the caller's own work between steps

    async def scenario() -> None:
        await asyncio.gather(*(session(n) for n in range(4)))

    asyncio.run(scenario())
    assert [len(batch) for batch in log] == [4] * 5


def test_sessions_out_of_step_merge_while_other_work_runs() -> None:
    """Two sessions that go round a pipeline out of step (the entry's step, then another
    key's work, as hops and logits are): the entry's round waits for the other session,
    running the other key meanwhile, so after the first lap both step together."""
    scheduler, log = Scheduler(), []
    run = recorder(log)

    async def session(n: int, laps: int) -> None:
        await asyncio.sleep(0.015 * n)  # the second one starts a round later
        for _ in range(laps):
            await scheduler.submit("entry", run, n, member=n, wait_s=0.2)
            await scheduler.submit("hop", run, 100 + n, member=n, wait_s=0.005)

    async def scenario() -> None:
        await asyncio.gather(session(0, 6), session(1, 6))

    asyncio.run(scenario())
    entry_rounds = [sorted(batch) for batch in log if batch[0] < 100]
    # merged at the second round or so, then together to the end (0's last lap is alone)
    assert entry_rounds.count([0, 1]) >= 5 and len(entry_rounds) <= 8


def test_a_member_that_stops_coming_is_waited_for_once_at_most() -> None:
    scheduler, log = Scheduler(), []
    run = recorder(log)

    async def scenario() -> float:
        await asyncio.gather(*(scheduler.submit("k", run, n, member=n, wait_s=0.1) for n in (0, 1)))
        started = time.perf_counter()
        for _ in range(3):  # member 1 went quiet (a slow client): 0.1 s once, then none
            await scheduler.submit("k", run, 0, member=0, wait_s=0.1)
        return time.perf_counter() - started

    assert 0.1 <= asyncio.run(scenario()) < 0.1 + 0.25
    scheduler.forget(0)  # a closed session is waited for never


def test_a_long_prompt_does_not_starve_decode_steps() -> None:
    """Ten prefill chunks queued at once and a session decoding: between two chunks, every
    decode step that was waiting runs."""
    scheduler, order = Scheduler(), []

    def work(items: list[Any]) -> list[Any]:
        order.extend(items)
        time.sleep(0.005)
        return items

    async def decoding() -> None:
        for step in range(6):
            await scheduler.submit("decode", work, f"d{step}")

    async def scenario() -> None:
        chunks = [scheduler.submit(None, work, f"c{i}", tokens=128) for i in range(10)]
        await asyncio.gather(decoding(), *chunks)

    asyncio.run(scenario())
    chunks_before_last_step = sum(1 for item in order[: order.index("d5")] if item[0] == "c")
    assert chunks_before_last_step <= 6  # one chunk a round, not the whole prompt first


def test_a_caller_that_went_away_is_skipped() -> None:
    scheduler, log = Scheduler(), []
    run = recorder(log)

    async def scenario() -> None:
        first = asyncio.create_task(scheduler.submit("k", run, 0))
        await asyncio.sleep(0.002)
        gone = asyncio.create_task(scheduler.submit("k", run, 1))
        kept = asyncio.create_task(scheduler.submit("k", run, 2))
        await asyncio.sleep(0)
        gone.cancel()
        assert await first == 0 and await kept == 20

    asyncio.run(scenario())
    assert log == [[0], [2]]


def test_a_batch_that_raises_fails_each_of_its_callers() -> None:
    scheduler = Scheduler()

    def broken(items: list[Any]) -> list[Any]:
        raise RuntimeError("out of memory")

    async def scenario() -> list[Any]:
        calls = [scheduler.submit("k", broken, i) for i in range(3)]
        return await asyncio.gather(*calls, return_exceptions=True)

    assert all(isinstance(r, RuntimeError) for r in asyncio.run(scenario()))


def test_one_scheduler_serves_one_event_loop_after_another() -> None:
    scheduler = Scheduler()
    for _ in range(3):  # what tests and `asyncio.run` per request do
        assert asyncio.run(scheduler.call(sum, [1, 2, 3])) == 6
