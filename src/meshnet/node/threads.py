"""How many threads a node computes with: the cores its neighbours leave free (ADR-0053).

A team of compute threads that waits on a core another process holds loses far more than
that core's share: every barrier of every op waits for the descheduled thread (on 2 cores,
one busy-looping neighbour took a 2-thread decode from 60.9 to 3.8 tok/s; issue 47). So a
node measures, while it computes, how much CPU time the rest of the machine takes, and sizes
its team to what is left: `choose` is the decision (pure, table-tested), `ComputeThreads`
feeds it from `/proc/stat` and this process's CPU clock around each compute turn and applies
what it picks to torch and ggml alike. `--threads N` pins the count.

Measuring only during our own turns matters: co-located meshnet processes take turns
(ADR-0026), so between our turns another node's compute is not contention, it is the mesh.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

# /proc/stat's cpu line: user nice system idle iowait irq softirq steal (guest is within user)
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True)
class Choice:
    """The thread count in force, and a different one seen in a row (hysteresis)."""

    threads: int
    pending: int = 0  # 0: none
    streak: int = 0


def choose(
    state: Choice, others_cores: float, cores: int, *, slack: float = 0.3, hold: int = 2
) -> Choice:
    """The thread count after a window in which other processes kept `others_cores` cores busy
    on average, of the `cores` this process may use.

    The target is the cores left, rounded down once more than `slack` short of the next
    whole core (a neighbour at 0.2 cores costs no thread; at 0.8 it costs one), at least 1.
    A new count takes effect after `hold` windows in a row agree on it, so one noisy window
    does not flap the team.
    """
    free = cores - max(0.0, others_cores)
    target = max(1, min(cores, math.floor(free + slack)))
    if target == state.threads:
        return Choice(state.threads)
    streak = state.streak + 1 if target == state.pending else 1
    if streak >= hold:
        return Choice(target)
    return Choice(state.threads, target, streak)


@dataclass(frozen=True)
class CpuTimes:
    """Busy CPU seconds of the whole machine and of this process, at one moment."""

    machine_s: float
    own_s: float


def read_cpu_times(stat_path: str = "/proc/stat") -> CpuTimes:
    """The machine's busy time (`stat_path`, all CPUs; steal counts: the host took the core)
    and this process's CPU time (every thread)."""
    with open(stat_path, "rb") as stat:
        fields = stat.readline().split()[1:]
    ticks = sum(int(fields[i]) for i in BUSY_FIELDS if i < len(fields))
    return CpuTimes(ticks / os.sysconf("SC_CLK_TCK"), time.process_time())


class ComputeThreads:
    """The compute threads of one node process, resized to the cores its neighbours leave.

    `run(fn, *args)` runs one compute turn, measuring the machine around it; after
    `window_s` seconds of turns it decides (`choose`) and applies a change before the next
    turn. `pinned` (`--threads N`) fixes the count and measures nothing.
    """

    def __init__(
        self,
        cores: int,
        pinned: int | None = None,
        *,
        window_s: float = 0.5,
        read: Callable[[], CpuTimes] = read_cpu_times,
        clock: Callable[[], float] = time.perf_counter,
        apply: Callable[[int], None] | None = None,
    ) -> None:
        self.cores = max(1, cores)
        self.pinned = pinned if pinned is not None or self.cores > 1 else 1  # one core: no choice
        self.choice = Choice(pinned or self.cores)
        self.window_s = window_s
        self.read, self.clock = read, clock
        self.apply = apply or apply_threads
        self.others_cores = 0.0  # the last window's figure (for /metrics)
        self._busy_s = self._wall_s = 0.0  # others' CPU time and wall time of this window
        self.changes = 0
        self._unapplied = pinned is not None and pinned != self.cores  # set on the first turn

    @property
    def threads(self) -> int:
        return self.choice.threads

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` (a compute turn, on the compute thread), measured."""
        if self._unapplied:
            self.apply(self.choice.threads)
            self._unapplied = False
        if self.pinned is not None:
            return fn(*args)
        before, started = self.read(), self.clock()
        try:
            return fn(*args)
        finally:
            after, wall = self.read(), self.clock() - started
            own = after.own_s - before.own_s
            self._busy_s += max(0.0, after.machine_s - before.machine_s - own)
            self._wall_s += wall
            if self._wall_s >= self.window_s:
                self._decide()

    def _decide(self) -> None:
        self.others_cores = self._busy_s / self._wall_s
        self._busy_s = self._wall_s = 0.0
        before = self.choice.threads
        self.choice = choose(self.choice, self.others_cores, self.cores)
        if self.choice.threads != before:
            self.changes += 1
            log.info(
                "other processes keep %.1f of %d cores busy: computing with %d threads (was %d)",
                self.others_cores,
                self.cores,
                self.choice.threads,
                before,
            )
            self.apply(self.choice.threads)


def apply_threads(threads: int) -> None:
    """Compute with `threads` threads from the next op on: torch (where it is loaded) and
    every ggml graph of this process. Call it on the compute thread."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
    from meshnet.models.ggml_lib import set_all_threads  # loads ggml once; torch stays out

    set_all_threads(threads)
