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

import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch

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
