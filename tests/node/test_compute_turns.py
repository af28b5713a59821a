"""Compute turns among co-located processes (ADR-0026): model calls of two processes that
share the lock file never overlap; without it they do."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshnet.cli import build_parser, node_config
from meshnet.node.compute import HostTurns

# each process makes 3 "model calls" of 0.15 s from a common start time (so that a slow
# interpreter start cannot keep them apart) and prints their (start, end) times
CALLS = """
import sys, time
from pathlib import Path
from meshnet.node.compute import HostTurns
turns = HostTurns(Path(sys.argv[1]) if sys.argv[1] else None)
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
for _ in range(3):
    print(*turns.run(lambda: (time.time(), time.sleep(0.15), time.time())[::2]), flush=True)
"""


def calls_of_two_processes(lock: str) -> list[tuple[float, float]]:
    start = str(time.time() + 4.0)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CALLS, lock, start], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    spans = []
    for process in procs:
        out, _ = process.communicate(timeout=30)
        spans += [(float(a), float(b)) for a, b in (line.split() for line in out.splitlines())]
    return sorted(spans)


def overlaps(spans: list[tuple[float, float]]) -> int:
    return sum(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False))


@pytest.mark.slow
def test_two_processes_sharing_the_lock_never_compute_at_once(tmp_path: Path) -> None:
    assert overlaps(calls_of_two_processes(str(tmp_path / "turns.lock"))) == 0
    assert overlaps(calls_of_two_processes("")) > 0  # the check can see an overlap


def test_no_path_runs_at_once_and_returns_the_value() -> None:
    assert HostTurns().run(lambda a, b: a + b, 2, 3) == 5


def test_the_flag_turns_them_off() -> None:
    assert node_config(build_parser().parse_args(["node"])).host_turns
    assert not node_config(build_parser().parse_args(["node", "--no-host-turns"])).host_turns


def test_a_turn_waits_at_most_stale_s_for_a_lock_held_by_a_stopped_process(
    tmp_path: Path,
) -> None:
    """Another holder that never lets go (a SIGSTOPped node mid-turn): the turn runs after
    `stale_s` without the lock, later ones at once; once the holder lets go, turns hold the
    lock again and the abandoned wait does not leave it taken."""
    import fcntl
    import os

    path = tmp_path / "turns.lock"
    other = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # its own open file: a rival holder
    fcntl.flock(other, fcntl.LOCK_EX)
    turns = HostTurns(path, stale_s=0.2)
    started = time.perf_counter()
    assert turns.run(lambda: 7) == 7
    assert 0.2 <= time.perf_counter() - started < 1.0 and turns.skipped == 1
    started = time.perf_counter()  # while the same holder keeps it, turns do not wait at all
    assert [turns.run(lambda: 1) for _ in range(5)] == [1] * 5
    assert time.perf_counter() - started < 0.1 and turns.skipped == 6
    fcntl.flock(other, fcntl.LOCK_UN)
    time.sleep(0.05)  # the helper takes the lock for the abandoned turn, then lets it go

    def holds_it() -> bool:
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(other, fcntl.LOCK_UN)
        return False

    assert turns.run(holds_it) and turns.skipped == 6  # this turn holds the lock
    assert not holds_it()  # and nobody holds it after
    os.close(other)
