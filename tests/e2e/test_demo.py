"""`meshnet demo` as a user runs it: a real three-process mesh, an answer, nothing left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.procs import wait_for

pytestmark = pytest.mark.slow
DEMO = [sys.executable, "-m", "meshnet.cli", "demo"]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return "\nState:\tZ" not in status.read()  # a zombie has exited
    except FileNotFoundError:
        return False


def child_pids(output: str) -> list[int]:
    return [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", output)]


def test_demo_answers_through_three_processes_and_stops_them() -> None:
    done = subprocess.run(DEMO, capture_output=True, text=True, timeout=400)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "A: The capital of France is Paris." in out
    route = re.findall(r"layers\s+(\d+:\d+)\s+(node-\w+)", out)
    assert [span for span, _ in route] == ["0:10", "10:20", "20:30"]
    assert len({node for _, node in route}) == 3
    assert re.search(r"decode [\d.]+ tokens/s", out)
    assert "30/30 layers served" in out
    assert re.search(r"^dashboard: http://127\.0\.0\.1:\d+/ ", out, re.M)
    pids = child_pids(out)
    assert len(pids) == 3 and not any(alive(p) for p in pids)


def test_ctrl_c_stops_every_process_it_started() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    demo = subprocess.Popen(DEMO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert demo.stdout is not None
    lines: list[str] = []
    while len(child_pids("".join(lines))) < 3:
        line = demo.stdout.readline().decode()
        assert line, "".join(lines)
        lines.append(line)
    time.sleep(3)  # the children are importing torch and loading shards now
    demo.send_signal(signal.SIGINT)
    rest, _ = demo.communicate(timeout=60)
    output = "".join(lines) + rest.decode()
    assert demo.returncode == 130, output
    assert "interrupted" in output and "stopped 3 processes" in output
    pids = child_pids(output)
    wait_for(lambda: not any(alive(p) for p in pids), 10, "the demo's children to exit")
