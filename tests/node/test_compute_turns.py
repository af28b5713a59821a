"""Compute turns among co-located processes (ADR-0026): model calls of two processes that
share the lock file never overlap; without it they do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshnet.cli import build_parser, node_config
from meshnet.node.compute import HostTurns

# each process makes 3 "model calls" of 0.15 s and prints their (start, end) times
CALLS = """
import sys, time
from pathlib import Path
from meshnet.node.compute import HostTurns
turns = HostTurns(Path(sys.argv[1]) if sys.argv[1] else None)
for _ in range(3):
    print(*turns.run(lambda: (time.time(), time.sleep(0.15), time.time())[::2]), flush=True)
"""


def calls_of_two_processes(lock: str) -> list[tuple[float, float]]:
    procs = [
        subprocess.Popen([sys.executable, "-c", CALLS, lock], stdout=subprocess.PIPE, text=True)
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
