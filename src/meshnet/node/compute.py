"""Where a process runs its model work: one compute thread with every core, and an event
loop thread that runs torch single-threaded (in a process that loads torch at all: a node
whose spans are all ggml does not, ADR-0052).

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
import queue
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from meshnet.types import device_kind

T = TypeVar("T")

log = logging.getLogger(__name__)


def compute_threads() -> int:
    """Cores this process may use (its CPU affinity), at least 1."""
    return max(1, len(os.sched_getaffinity(0)))


def pin_loop_thread() -> None:
    """Make torch ops on the calling thread single-threaded, for good: torch reads the
    thread's OpenMP setting once, at its first op (here), so later calls that raise the
    process-wide count (the compute thread's) do not reach this thread. Loads torch: only
    for a process that computes with it."""
    import torch

    torch.set_num_threads(1)
    torch.get_num_threads()  # fixes this thread's OpenMP team size at 1 now


def _init_compute_thread() -> None:
    torch = sys.modules.get("torch")  # loaded by `pin_loop_thread` where torch computes
    if torch is not None:
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

    A turn waits at most `stale_s` for the lock, then runs without it (logged): a process
    stopped while holding it (SIGSTOP, a debugger) must not freeze every other one on the
    host. Until that holder lets go, later turns do not wait at all. A blocking `flock`
    cannot time out, so a helper thread takes the lock for the compute thread and hands it
    over, or lets it go again if the compute thread gave up.
    """

    def __init__(self, path: Path | None = None, stale_s: float = 0.5) -> None:
        self.path = path
        self.stale_s = stale_s
        self.skipped = 0  # turns that ran without the lock
        self._fd: int | None = None
        self._requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._stuck = threading.Event()  # a holder kept the lock past `stale_s`; not back yet

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` in this process's turn (on the compute thread)."""
        if self.path is None:
            return fn(*args)
        held = self._acquire()
        try:
            return fn(*args)
        finally:
            if held:
                fcntl.flock(self._fd_for_lock(), fcntl.LOCK_UN)
                os.sched_yield()  # a woken waiter gets its turn before our next one

    def _acquire(self) -> bool:
        """Whether this turn holds the lock (False: it waited `stale_s` in vain)."""
        fd = self._fd_for_lock()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the common case: free
            return True
        except BlockingIOError:
            if self._stuck.is_set():  # the holder that kept it is still holding it
                self.skipped += 1
                return False
        request = _Request()
        self._requests.put(request)
        if request.granted.wait(self.stale_s) or not request.give_up():
            return True
        self.skipped += 1
        self._stuck.set()
        log.warning(
            "another meshnet process has held the compute lock %s for over %.1f s (stopped?); "
            "computing without it",
            self.path,
            self.stale_s,
        )
        return False

    def _fd_for_lock(self) -> int:
        if self._fd is None:
            assert self.path is not None  # only called with a path
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            threading.Thread(target=self._take_for_requests, daemon=True).start()
        return self._fd

    def _take_for_requests(self) -> None:
        """Helper thread: a blocking `flock` per request; handed over, or let go when the
        compute thread stopped waiting."""
        while True:
            request = self._requests.get()
            fcntl.flock(self._fd_for_lock(), fcntl.LOCK_EX)
            if not request.hand_over():
                fcntl.flock(self._fd_for_lock(), fcntl.LOCK_UN)
                self._stuck.clear()  # the stuck holder let go: turns wait for the lock again


class _Request:
    """One compute turn waiting for the lock: either handed over or given up, never both."""

    def __init__(self) -> None:
        self.granted = threading.Event()
        self._mutex = threading.Lock()
        self._abandoned = False

    def hand_over(self) -> bool:
        with self._mutex:
            if not self._abandoned:
                self.granted.set()
            return not self._abandoned

    def give_up(self) -> bool:
        """False when the lock was handed over meanwhile (then the turn holds it)."""
        with self._mutex:
            self._abandoned = not self.granted.is_set()
            return self._abandoned


def host_turns(enabled: bool, device: str = "cpu") -> HostTurns:
    """Shared turns for a process computing on the CPU when `enabled`; none on CUDA (the
    GPU's own queue orders its work, and CPU cores are not what co-located GPU nodes contend
    for)."""
    on = enabled and device_kind(device) == "cpu"
    return HostTurns(host_turns_path() if on else None)
