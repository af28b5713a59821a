"""The compute thread's scheduler: every model call of a process, continuously batched.

Callers submit jobs from the event loop; one driver task hands them to the compute thread
(`node/compute.py`) in rounds, planned by pure functions:
- `due`: which jobs may run now. A decode step (one token, with a batch key) waits, at most
  its `wait_s`, until every member (session) of its key's last round is queued again; other
  work runs meanwhile. Without it, sessions that once fell out of step (one joined later, one
  waited for a prefill chunk) would run as alternating batches for good.
- `plan_round`: the jobs that are due, as calls: decode steps of one key run as one call over
  all their items; at most one heavy job (a prefill chunk) runs per round, after them, so a
  long prompt delays a decode step by one chunk at most, never by the whole prompt.
Jobs that arrive while a round runs join the next one (ADR-0027).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import statistics
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from meshnet.node.compute import HostTurns, compute_executor, compute_threads
from meshnet.node.threads import ComputeThreads

log = logging.getLogger(__name__)
T = TypeVar("T")
BatchFn = Callable[[list[Any]], list[Any]]  # items -> one result (or `Failed`) per item


@dataclass(frozen=True)
class Waiting:
    """What the planner sees of a queued job."""

    key: Hashable | None  # jobs with the same key may run as one call; None: always alone
    tokens: int = 1  # tokens of model work; more than one makes it heavy (a prefill chunk)
    member: Hashable = None  # the session it steps, if any
    since_s: float = 0.0  # when it was queued (the loop's clock)
    wait_s: float = 0.0  # how long its round may wait for the last round's members

    @property
    def decode(self) -> bool:
        return self.key is not None and self.tokens == 1


def due(
    waiting: Sequence[Waiting], last: Mapping[Hashable, set[Hashable]], now_s: float
) -> list[bool]:
    """For each job, whether it may run now: anything but a decode step; a decode step once
    every member of its key's `last` round is queued, or once its key's oldest queued step
    has waited its `wait_s`."""
    queued: dict[Hashable, set[Hashable]] = {}
    oldest: dict[Hashable, Waiting] = {}
    for job in waiting:
        if job.decode:
            queued.setdefault(job.key, set()).add(job.member)
            oldest.setdefault(job.key, job)
    ready = {
        key: not (last.get(key, set()) - members)
        or now_s - oldest[key].since_s >= oldest[key].wait_s
        for key, members in queued.items()
    }
    return [not job.decode or ready[job.key] for job in waiting]


def next_due_s(waiting: Sequence[Waiting]) -> float:
    """The loop time by which some waiting decode step is due whoever comes."""
    return min((j.since_s + j.wait_s for j in waiting if j.decode), default=0.0)


def plan_round(waiting: Sequence[Waiting], max_batch: int, max_tokens: int) -> list[list[int]]:
    """The calls of the next round, as indices into `waiting` (oldest first), in order.

    Jobs with a key are grouped by key, up to `max_batch` a call: decode steps and prefill
    chunks together, so one weight read serves them all. Prefill tokens are capped per round
    at `max_tokens` (the oldest chunk always goes): chunks that do not fit, and a key's
    overflow, wait for the next round, keeping their place. Keyless jobs run alone, a keyless
    chunk last and only when no other chunk runs.
    """
    groups: dict[Hashable, list[int]] = {}
    calls: list[list[int]] = []
    chunk_tokens, keyless_chunk = 0, None
    for index, job in enumerate(waiting):
        heavy = job.tokens > 1
        if heavy and chunk_tokens and chunk_tokens + job.tokens > max_tokens:
            continue
        if job.key is None:
            if not heavy:
                calls.append([index])
            elif keyless_chunk is None and not chunk_tokens:
                keyless_chunk, chunk_tokens = index, job.tokens
            continue
        group = groups.setdefault(job.key, [])
        if len(group) >= max_batch:
            continue
        if not group:
            calls.append(group)
        group.append(index)
        chunk_tokens += job.tokens if heavy else 0
    calls.sort(key=lambda call: call[0])
    return calls + ([[keyless_chunk]] if keyless_chunk is not None else [])


@dataclass(frozen=True)
class Failed:
    """A batch function's result for an item that failed alone."""

    error: BaseException


@dataclass
class _Job:
    waiting: Waiting
    run: BatchFn
    item: Any
    future: asyncio.Future[Any]
    context: contextvars.Context = field(default_factory=contextvars.copy_context)


class Scheduler:
    """Owns the compute thread; runs every model call of its process in batched rounds."""

    def __init__(
        self,
        turns: HostTurns | None = None,
        max_batch: int = 32,
        on_decode: Callable[[int], object] = lambda rows: None,
        max_tokens: int = 512,
        threads: ComputeThreads | None = None,
    ) -> None:
        self.worker = compute_executor()
        # how many threads a turn computes with (fixed at the cores unless given one that adapts)
        self.threads = threads or ComputeThreads(compute_threads(), compute_threads())
        self.on_decode = on_decode  # gets the number of decode steps of every call (a metric)
        self.turns = turns or HostTurns()  # compute turns shared with co-located processes
        self.max_batch = max_batch  # jobs of one call
        self.max_tokens = max_tokens  # prefill tokens of one round
        self.batch_sizes: list[int] = []  # of the last batched calls (observability, tests)
        self._rounds_s: list[float] = []  # wall seconds of the last decode rounds
        self._members: dict[Hashable, set[Hashable]] = {}  # key -> its last round's members
        self._queue: list[_Job] = []
        self._driver: asyncio.Task[None] | None = None
        self._arrived = asyncio.Event()  # set by every submit

    def step_s(self) -> float:
        """Median seconds of the last decode rounds (0 before the first): what a new
        session's step waits for here; heartbeats carry it to the tracker's route choice."""
        return statistics.median(self._rounds_s) if self._rounds_s else 0.0

    def run_blocking(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the compute thread, waiting for it here: work before the event
        loop serves (loading a span given by hand), run where its model calls will run.
        A compiled decode step guards on the thread count of the thread that built it:
        built on the loop thread (one thread), it was built again at the first request
        (8.8 s with inductor's cache warm; ADR-0023)."""
        return self.worker.submit(fn, *args).result()

    def queue_depth(self) -> int:
        """Jobs waiting for the compute thread now."""
        return len(self._queue)

    def forget(self, member: Hashable) -> None:
        """`member` (a closed session) sends no more steps: no round waits for it."""
        for members in self._members.values():
            members.discard(member)

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the compute thread, alone (between the rounds' batches)."""
        return await self.submit(None, _alone(fn), args)  # type: ignore[no-any-return]

    async def submit(
        self,
        key: Hashable | None,
        run: BatchFn,
        item: Any,
        tokens: int = 1,
        member: Hashable = None,
        wait_s: float = 0.0,
    ) -> Any:
        """Queue `item`; `run([item, ...])` runs it with the other items of `key` in its
        round. `member` (a session id) will send the next step of `key` too; a round of
        `key` waits up to `wait_s` for the members of the last one. Returns the item's
        result, or raises its `Failed` error."""
        loop = asyncio.get_running_loop()
        waiting = Waiting(key, tokens, member, loop.time(), wait_s)
        job = _Job(waiting, run, item, loop.create_future())
        self._queue.append(job)
        self._arrived.set()
        if self._driver is None or self._driver.done() or self._driver.get_loop() is not loop:
            # a driver is started per event loop: jobs of a closed loop have nobody waiting
            self._queue = [j for j in self._queue if j.future.get_loop() is loop]
            self._arrived = asyncio.Event()  # an event belongs to the loop that first waits
            self._driver = loop.create_task(self._drive())
        return await job.future

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            self._queue = [j for j in self._queue if not j.future.done()]  # callers gone
            waiting = [j.waiting for j in self._queue]
            flags = due(waiting, self._members, loop.time())
            ready = [job for job, ok in zip(self._queue, flags, strict=True) if ok]
            if not ready:
                await self._arrival(next_due_s(waiting) - loop.time())
                continue
            plan = plan_round([j.waiting for j in ready], self.max_batch, self.max_tokens)
            calls = [[ready[i] for i in call] for call in plan]
            planned = {id(job) for call in calls for job in call}
            self._queue = [j for j in self._queue if id(j) not in planned]
            for call in calls:
                await self._run_batch(loop, call)

    async def _arrival(self, timeout_s: float) -> None:
        """Until a job is submitted, or `timeout_s` passes."""
        self._arrived.clear()
        try:
            await asyncio.wait_for(self._arrived.wait(), max(timeout_s, 0.0))
        except TimeoutError:
            return

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, group: list[_Job]) -> None:
        steps = [j for j in group if j.waiting.decode]
        if steps:
            self._members[group[0].waiting.key] = {j.waiting.member for j in steps} - {None}
            self.on_decode(len(steps))
        if len(group) > 1:
            self.batch_sizes = [*self.batch_sizes[-63:], len(group)]
        started = loop.time()
        results = await loop.run_in_executor(self.worker, self._run, group)
        if steps and len(steps) == len(group):  # a pure decode round: its time is a step's
            self._rounds_s = [*self._rounds_s[-31:], loop.time() - started]
        for job, result in zip(group, results, strict=True):
            _settle(job.future, result)

    def _run(self, group: list[_Job]) -> list[Any]:
        """Compute thread: one call over the group's items, in this process's turn."""
        context = group[0].context if len(group) == 1 else contextvars.Context()
        try:
            items = [j.item for j in group]
            results: list[Any] = context.run(self.turns.run, self.threads.run, group[0].run, items)
        except Exception as exc:  # the batch as a whole failed: each of its callers gets it
            return [Failed(exc)] * len(group)
        if len(results) != len(group):
            error = RuntimeError(f"a batch of {len(group)} gave {len(results)} results")
            return [Failed(error)] * len(group)
        return results


def _alone(fn: Callable[..., Any]) -> BatchFn:
    """The batch function of a keyless job: `fn(*args)` for its one item."""

    def run(items: list[Any]) -> list[Any]:
        (args,) = items
        return [fn(*args)]

    return run


def _settle(future: asyncio.Future[Any], result: Any) -> None:
    if future.done():  # the caller went away
        return
    if isinstance(result, Failed):
        future.set_exception(result.error)
    else:
        future.set_result(result)
