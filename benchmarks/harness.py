"""What the benchmarks share: a free loopback port and a median timing (one home: the
benchmarks import it as a sibling module, `from harness import ...`)."""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def median_s(fn: Callable[[], object], repeats: int) -> float:
    """The median wall time of `repeats` calls of `fn`, in seconds."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
