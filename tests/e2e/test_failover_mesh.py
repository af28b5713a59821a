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


def spare(mesh: Mesh) -> set[str]:
    """Nodes whose span has another live copy: killing one leaves a replacement."""
    coverage = mesh.coverage()
    layers = coverage["models"][0]["layers"]
    names = {a: n for n, a in mesh.addresses.items()}
    return {
        names[node["address"]]
        for node in coverage["nodes"]
        if node["address"] in names
        and node["loaded"]
        and not node["suspect"]
        and all(len(layers[s["span"]["start"]]["serving"]) >= 2 for s in node["loaded"])
    }


def kill_a_hop(mesh: Mesh, rng: random.Random) -> str:
    """SIGKILL a random node of the running session's route that has a spare copy; restart it.

    Only spare-backed hops are candidates, so that a replacement exists: the point here is
    failover, not running out of copies (the test after the chaos one does that).
    """
    candidates = spare(mesh)
    on_route = [name for name in mesh.addresses if mesh.sessions(name) > 0 and name in candidates]
    assert on_route, "no hop of the route has a spare copy"
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
    by_token: dict[str, list[float]] = {"5-15": [], "35-45": []}
    for i in range(20):
        # a route has a hop on each span; one of them needs a spare copy for the kill
        wait_for(lambda: bool(spare(mesh) - {"entry"}), 60, "a spare copy of a span")
        prompt = PROMPTS[i % len(PROMPTS)]
        at = rng.randrange(2, 46)
        killed: list[str] = []

        def on_token(n: int, at: int = at, killed: list[str] = killed) -> None:
            if n == at:
                killed.append(kill_a_hop(mesh, rng))

        text, final = stream_chat(mesh, prompt, on_token)
        lost += text != expected[prompt]
        assert killed, f"generation {i} ended before token {at}"
        assert text == expected[prompt], f"generation {i}: {killed} killed at token {at}"
        pauses += final["meshnet"]["failover_pauses_s"]
        for label, (low, high) in {"5-15": (5, 15), "35-45": (35, 45)}.items():
            if low <= at <= high:
                by_token[label] += final["meshnet"]["failover_pauses_s"]
    print(f"\nchaos: 20 generations, {lost} lost, {len(pauses)} failovers, pause {ms(pauses)}")
    for label, found in by_token.items():
        print(f"  failures at tokens {label}: {len(found)}, pause {ms(found)}")
    assert len(pauses) >= 20


def ms(pauses: list[float]) -> str:
    if not pauses:
        return "-"
    return f"median {statistics.median(pauses) * 1000:.0f} ms, max {max(pauses) * 1000:.0f} ms"


def settled(mesh: Mesh) -> bool:
    """Every running node has registered and loaded its span (none idle, none loading)."""
    loaded = {n["address"] for n in mesh.coverage()["nodes"] if n["loaded"] and not n["loading"]}
    running = {a for n, a in mesh.addresses.items() if mesh.procs[n].poll() is None}
    return running <= loaded


def test_sigterm_under_load_finishes_requests_and_replans_at_once(mesh: Mesh) -> None:
    wait_for(lambda: settled(mesh) and bool(spare(mesh)), 60, "a settled mesh with spares")
    expected = stream_chat(mesh, PROMPTS[0])[0]
    left: dict[str, float] = {}

    def terminate(n: int) -> None:
        if n != 5:
            return
        candidates = spare(mesh)
        victim = next(n for n in mesh.addresses if mesh.sessions(n) > 0 and n in candidates)
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


def test_losing_the_last_copy_fails_fast_naming_the_layers_then_recovers(mesh: Mesh) -> None:
    """Runs last: it leaves the mesh with one copy of 20:30 (the end of the session)."""
    wait_for(lambda: settled(mesh), 60, "no node idle or loading")
    by_address = {a: n for n, a in mesh.addresses.items()}
    holders = [
        by_address[n["address"]]
        for n in mesh.coverage()["nodes"]
        if n["address"] in by_address
        and mesh.procs[by_address[n["address"]]].poll() is None
        and any(s["span"] == {"start": 20, "end": 30} for s in n["loaded"])
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
    mesh.restart(last)
    wait_for(lambda: mesh.coverage()["models"][0]["routable"], 60, "layers 20:30 back")
    text, _ = stream_chat(mesh, PROMPTS[1])
    assert len(text) > 20
