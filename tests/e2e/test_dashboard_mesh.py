"""The dashboard, `meshnet status` and `/metrics` against the shared real mesh.

A real headless Chromium shows the tracker's page: full coverage and every node, a request's
speed; then both holders of layers 20:30 are SIGKILLed and the gap must be on the page within
two heartbeat intervals. Both come back and the mesh is whole again for the later tests.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from selenium.webdriver import Chrome

from tests.e2e.browser import chromium
from tests.e2e.mesh import API_KEY, Mesh
from tests.e2e.procs import wait_for
from tests.e2e.streams import chat as chat_body
from tests.e2e.streams import stream

pytestmark = pytest.mark.slow
HEARTBEAT_S = 1.0  # the shared mesh's --heartbeat-interval
MAP = '.model[data-model="default"]'


def metric(url: str, name: str) -> float:
    lines = httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def holders(mesh: Mesh, start: int) -> list[str]:
    by_address = {a: n for n, a in mesh.addresses.items()}
    return [
        by_address[n["address"]]
        for n in mesh.coverage()["nodes"]
        if n["address"] in by_address and any(s["span"]["start"] == start for s in n["loaded"])
    ]


def chat(mesh: Mesh) -> None:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 8,
    }
    answer = httpx.post(f"{mesh.url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text


def test_metrics_of_the_tracker_and_a_node_after_a_request(mesh: Mesh) -> None:
    mesh.wait_whole()
    before = metric(mesh.url, "meshnet_tokens_generated_total")
    chat(mesh)
    assert metric(mesh.url, "meshnet_tokens_generated_total") >= before + 1
    assert metric(mesh.url, 'meshnet_layers_covered{model="default"}') == 30
    assert metric(mesh.url, "meshnet_directives_total") >= 4
    assert metric(mesh.url, "meshnet_bytes_sent_total") > 0
    node = mesh.addresses[holders(mesh, 10)[0]]
    assert (
        metric(node, "meshnet_forward_seconds_count")
        + metric(mesh.addresses[holders(mesh, 10)[-1]], "meshnet_forward_seconds_count")
        > 0
    )
    assert metric(node, "meshnet_sessions_active") == 0  # the finished request's is closed


def test_a_node_counts_the_session_it_serves_while_an_answer_streams(mesh: Mesh) -> None:
    active: list[float] = []

    def sample(n: int) -> None:
        if n == 3:
            busy = [a for name, a in mesh.addresses.items() if mesh.sessions(name) > 0]
            active.extend(metric(a, "meshnet_sessions_active") for a in busy)

    stream(mesh.url, chat_body("Explain how a bicycle works to a child."), sample)
    assert active == [1.0, 1.0]  # one hop of 10:20 and one of 20:30, one session each
    wait_for(lambda: all(mesh.sessions(n) == 0 for n in mesh.addresses), 10, "sessions closed")
    assert sum(metric(a, "meshnet_sessions_active") for a in mesh.addresses.values()) == 0


def test_an_entry_logging_json_names_the_session_on_its_lines(mesh: Mesh) -> None:
    body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 4}
    bearer = {"Authorization": f"Bearer {API_KEY}"}
    answer = httpx.post(f"{mesh.entry}/v1/completions", json=body, headers=bearer, timeout=120)
    assert answer.status_code == 200, answer.text

    def lines() -> list[dict[str, object]]:
        text = (mesh.folder / "entry.log").read_text()
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    wait_for(lambda: any(line["message"] == "closed" for line in lines()), 10, "the close line")
    opened = [line for line in lines() if "prompt tokens; route" in str(line["message"])]
    closed = [line for line in lines() if line["message"] == "closed"]
    assert opened and closed
    assert str(opened[-1]["session"]).startswith("s-")
    assert opened[-1]["session"] == closed[-1]["session"]
    assert {"time", "level", "logger", "message"} <= set(opened[-1])


def test_status_command_prints_the_map_and_every_node(mesh: Mesh) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "meshnet.cli", "status", "--tracker", mesh.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "30/30 layers served  no gaps  routable" in done.stdout
    for node in mesh.coverage()["nodes"]:
        assert node["node_id"] in done.stdout


def test_dashboard_shows_coverage_then_the_gap_of_killed_nodes(mesh: Mesh, tmp_path: Path) -> None:
    mesh.wait_whole()
    chat(mesh)  # a request for the table of recent requests
    victims = holders(mesh, 20)
    assert len(victims) >= 2
    with chromium() as page:
        page.get(f"{mesh.url}/?poll=250")
        wait_for(lambda: gaps(page) == "0" and count(page, "#nodes tbody tr") >= 6, 20, "a map")
        wait_for(lambda: count(page, "#requests tbody tr") > 0, 10, "the request in the table")
        page.save_screenshot(str(tmp_path / "dashboard-full.png"))
        summary = page.execute_script("return document.getElementById('summary').textContent")
        assert summary.endswith("every layer covered")
        for name in victims:
            mesh.procs[name].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        seconds = wait_for(lambda: gaps(page) not in ("0", None), 10, "the gap on the page")
        page.save_screenshot(str(tmp_path / "dashboard-gap.png"))
        layers = set(
            page.execute_script(
                f"return [...document.querySelectorAll('{MAP} .cell[data-state=gap]')]"
                ".map((c) => Number(c.dataset.layer))"
            )
        )
        print(f"\ndashboard: gap shown {time.monotonic() - killed:.2f} s after the kill")
    assert seconds < 2 * HEARTBEAT_S
    assert layers and layers <= set(range(20, 30))
    for name in victims:
        mesh.procs[name].wait()
        mesh.restart(name)
    mesh.wait_whole(180)


def gaps(page: Chrome) -> str | None:
    """The map's count of gap layers (read in one script: the page redraws as we look)."""
    found = page.execute_script(f"return document.querySelector('{MAP}')?.dataset.gaps")
    return None if found is None else str(found)


def count(page: Chrome, selector: str) -> int:
    return int(page.execute_script(f"return document.querySelectorAll('{selector}').length"))


def test_the_dashboard_chat_streams_an_answer_with_speed_and_route(mesh: Mesh) -> None:
    """Issue #25: ask from the page; the answer streams in, then the route and tokens/s."""
    mesh.wait_whole()
    with chromium() as page:
        page.get(f"{mesh.url}/")
        wait_for(lambda: count(page, "#chat-model option") > 0, 20, "the models in the chat box")
        page.find_element("id", "chat-prompt").send_keys("What is the capital of France?")
        page.find_element("id", "chat-send").click()
        wait_for(
            lambda: page.execute_script("return document.getElementById('chat').dataset.done"),
            120,
            "the answer",
        )
        answer, route, rate, stats = page.execute_script(
            "const s = document.getElementById('chat-stats');"
            "return [document.getElementById('chat-answer').textContent, s.dataset.route,"
            " s.dataset.tokensPerS, s.textContent]"
        )
    assert answer == "The capital of France is Paris.", stats
    assert route == "0:10,10:20,20:30" and float(rate) > 0
    assert "tok/s" in stats and "route" in stats
