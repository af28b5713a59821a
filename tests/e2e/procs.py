"""Real processes on loopback for end-to-end tests: start, wait on readiness, stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(
    args: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """`meshnet ARGS` as a child process, output appended to `log` (restarts keep history).

    `env` replaces the environment (`PYTHONUNBUFFERED` is always set); `cwd`: where it runs.
    """
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    with log.open("ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
        )


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll `condition` until true; seconds it took. Raises with `what` on timeout."""
    start_s = time.monotonic()
    while time.monotonic() - start_s < timeout_s:
        try:
            if condition():
                return time.monotonic() - start_s
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def get_json(url: str) -> Any:
    return httpx.get(url, timeout=2.0).json()


def stop(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    stop_together([process], sig)


def stop_together(
    processes: Iterable[subprocess.Popen[bytes] | None], sig: int = signal.SIGTERM
) -> None:
    """Signal every running process first, then wait for each (20 s at most in all, then
    SIGKILL): they drain side by side, not one after another."""
    running = [p for p in processes if p is not None and p.poll() is None]
    for process in running:
        process.send_signal(sig)
    deadline = time.monotonic() + 20
    for process in running:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def ask_france(url: str, model: str = "default") -> str:
    """The entry at `url`'s greedy chat answer to the France question, through `openai`."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=12,
    )
    return answer.choices[0].message.content or ""
