"""Where a process runs its model work: one compute thread with every core, and an event
loop thread that runs torch single-threaded.

libgomp (PyTorch's OpenMP on Linux) keeps one thread team per thread that enters a parallel
region. Once a process holds more OpenMP threads than CPUs, libgomp stops spin-waiting and
every small parallel region pays a futex wake-up. On this 2-core machine a 30-layer bf16
decode step went from 23 ms to 35-51 ms as soon as a second thread (the event loop, running
a frame check or the sampler) had run one parallel op. So model work goes to the compute
thread only, and the loop thread is pinned to one OpenMP thread before it runs any torch
op (ADR-0021).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch

T = TypeVar("T")

log = logging.getLogger(__name__)


def compute_threads() -> int:
    """Cores this process may use (its CPU affinity), at least 1."""
    return max(1, len(os.sched_getaffinity(0)))


def pin_loop_thread() -> None:
    """Make torch ops on the calling thread single-threaded, for good: torch reads the
    thread's OpenMP setting once, at its first op (here), so later calls that raise the
    process-wide count (the compute thread's) do not reach this thread."""
    torch.set_num_threads(1)
    torch.get_num_threads()  # fixes this thread's OpenMP team size at 1 now


def _init_compute_thread() -> None:
    torch.set_num_threads(compute_threads())


def compute_executor() -> ThreadPoolExecutor:
    """A single thread for model work, using every core."""
    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="compute", initializer=_init_compute_thread
    )


def host_turns_path() -> Path:
    """The lock file every meshnet process of this host and user shares."""
    return Path(tempfile.gettempdir()) / f"meshnet-compute-{os.getuid()}.lock"


class HostTurns:
    """Compute turns among the meshnet processes of one host (ADR-0026).

    Each model call holds an exclusive `flock` on one shared file, so co-located processes
    take turns, each with every core, instead of running their OpenMP teams on the same cores
    at once (three processes on two cores with four sessions in flight gave half the tokens
    of one session). With no path, calls run at once: one process per machine, or a GPU.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._fd: int | None = None

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` in this process's turn (on the compute thread)."""
        if self.path is None:
            return fn(*args)
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            return fn(*args)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


def host_turns(enabled: bool) -> HostTurns:
    """Shared turns for a CPU process when `enabled`; none on CUDA (the GPU's own queue
    orders its work, and CPU cores are not what co-located GPU nodes contend for)."""
    on = enabled and not torch.cuda.is_available()
    return HostTurns(host_turns_path() if on else None)
