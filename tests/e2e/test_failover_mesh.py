"""Fault tolerance with real processes: nodes die mid-generation and nobody notices.

The shared mesh (`tests/e2e/mesh.py`) holds three copies of each span after the entry's.
Greedy generations run through the HTTP API while a hop of their route is SIGKILLed and
restarted, or terminated gracefully, or the last copy of a span dies.
"""

from __future__ import annotations

import json
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.e2e.mesh import Mesh
from tests.e2e.procs import wait_for

pytestmark = pytest.mark.slow
TOKENS = 48
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works to a child.",
    "Describe a walk through a forest in autumn.",
    "Write a letter to a friend about your holiday by the sea.",
]


def stream_chat(
    mesh: Mesh, prompt: str, on_token: Callable[[int], object] = lambda n: None
) -> tuple[str, dict[str, Any]]:
    """Greedy streamed answer; `on_token(n)` runs after the n-th content chunk arrives."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": TOKENS,
        "stream": True,
    }
    parts, count = [], 0
    final: dict[str, Any] = {}
    with httpx.stream("POST", f"{mesh.url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            for choice in event["choices"]:
                if choice["delta"].get("content"):
                    parts.append(choice["delta"]["content"])
                    count += 1
                    on_token(count)
            final = event if "meshnet" in event else final
    return "".join(parts), final


def kill_a_hop(mesh: Mesh, rng: random.Random) -> str:
    """SIGKILL a random node on the running session's route, then start it again."""
    on_route = [name for name in mesh.addresses if mesh.sessions(name) > 0]
    assert on_route, "no node holds the session"
    victim = rng.choice(on_route)
    mesh.procs[victim].send_signal(signal.SIGKILL)
    mesh.procs[victim].wait()
    mesh.restart(victim)  # same port, same data folder: the same node id comes back
    return victim


def test_chaos_every_generation_survives_a_killed_hop(mesh: Mesh) -> None:
    rng = random.Random(7)
    expected = {p: stream_chat(mesh, p)[0] for p in PROMPTS}
    pauses: list[float] = []
    lost = 0
    for i in range(20):
        wait_for(lambda: mesh.copies() >= 2, 60, "a spare copy of every span")
        prompt = PROMPTS[i % len(PROMPTS)]
        at = rng.randrange(2, 40)
        killed: list[str] = []

        def on_token(n: int, at: int = at, killed: list[str] = killed) -> None:
            if n == at:
                killed.append(kill_a_hop(mesh, rng))

        text, final = stream_chat(mesh, prompt, on_token)
        lost += text != expected[prompt]
        assert killed, f"generation {i} ended before token {at}"
        assert text == expected[prompt], f"generation {i}: {killed} killed at token {at}"
        pauses += final["meshnet"]["failover_pauses_s"]
    print(
        f"\nchaos: 20 generations, {lost} lost, {len(pauses)} failovers, pause median "
        f"{statistics.median(pauses) * 1000:.0f} ms, max {max(pauses) * 1000:.0f} ms"
    )
    assert len(pauses) >= 20


@pytest.mark.parametrize("token", [10, 40])
def test_failover_pause_at_token(mesh: Mesh, token: int) -> None:
    rng, pauses = random.Random(token), []
    for prompt in PROMPTS[:1]:
        wait_for(lambda: mesh.copies() >= 2, 60, "a spare copy of every span")
        _, final = stream_chat(
            mesh, prompt, lambda n: kill_a_hop(mesh, rng) if n == token else None
        )
        pauses += final["meshnet"]["failover_pauses_s"]
    print(
        f"\nfailure at token {token}: {len(pauses)} failovers, pause median "
        f"{statistics.median(pauses) * 1000:.0f} ms, max {max(pauses) * 1000:.0f} ms"
    )
    assert len(pauses) == 1


def test_sigterm_under_load_finishes_requests_and_replans_at_once(mesh: Mesh) -> None:
    mesh.wait_whole()
    expected = stream_chat(mesh, PROMPTS[0])[0]
    left: dict[str, float] = {}

    def terminate(n: int) -> None:
        if n != 5:
            return
        victim = next(name for name in mesh.addresses if mesh.sessions(name) > 0)
        node_ids = {n["address"]: n["node_id"] for n in mesh.coverage()["nodes"]}
        sent = time.monotonic()
        mesh.procs[victim].send_signal(signal.SIGTERM)
        node_id = node_ids[mesh.addresses[victim]]
        wait_for(
            lambda: node_id not in {n["node_id"] for n in mesh.coverage()["nodes"]},
            5,
            "the tracker to drop the leaving node",
        )
        left[victim] = time.monotonic() - sent

    text, _ = stream_chat(mesh, PROMPTS[0], terminate)
    assert text == expected
    ((victim, seconds),) = left.items()
    assert seconds < 2.0  # heartbeats expire only after 6 s
    mesh.procs[victim].wait(timeout=30)
    assert mesh.procs[victim].returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
    mesh.restart(victim)
    mesh.wait_whole()


def test_losing_the_last_copy_fails_fast_naming_the_layers_then_recovers(mesh: Mesh) -> None:
    mesh.wait_whole()
    by_address = {a: n for n, a in mesh.addresses.items()}
    holders = [
        by_address[n["address"]]
        for n in mesh.coverage()["nodes"]
        if any(s["span"] == {"start": 20, "end": 30} for s in n["loaded"])
    ]
    for name in holders[:-1]:  # leave gracefully: only one copy of 20:30 is left
        mesh.procs[name].send_signal(signal.SIGTERM)
        mesh.procs[name].wait(timeout=30)
    last = holders[-1]
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "temperature": 0,
        "max_tokens": TOKENS,
    }
    timer = threading.Timer(1.0, lambda: mesh.procs[last].send_signal(signal.SIGKILL))
    timer.start()
    sent = time.monotonic()
    refused = httpx.post(f"{mesh.url}/v1/chat/completions", json=body, timeout=60)
    seconds = time.monotonic() - sent
    assert refused.status_code == 503, refused.text
    assert "20:30" in refused.json()["error"]["message"]
    assert seconds < 10.0
    mesh.procs[last].wait()
    assert all(mesh.sessions(name) == 0 for name in mesh.addresses if name not in holders)
    for name in holders:
        mesh.restart(name)
    mesh.wait_whole()
    text, _ = stream_chat(mesh, PROMPTS[1])
    assert len(text) > 20
