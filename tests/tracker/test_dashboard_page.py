"""The dashboard page in a real headless Chromium against a real tracker server whose state
the test sets: a loading node, a late node, a request and directives, behind an API key."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from meshnet.config import AccessConfig, TrackerConfig
from meshnet.security.signing import Signer
from meshnet.tracker.app import create_app
from meshnet.tracker.planner import ModelOffer
from meshnet.tracker.probe import TrustingProber
from meshnet.tracker.registry import Registry
from meshnet.types import ModelId
from tests.e2e.browser import chromium
from tests.e2e.procs import free_port, wait_for
from tests.tracker.test_app import MB, Clock
from tests.tracker.test_observe import SUMMARY

pytestmark = pytest.mark.slow
KEY, SWARM = "k-dashboard-0123456789-padded-to-128-bits-0123456789", "cd" * 32


@pytest.fixture
def tracker() -> Iterator[tuple[str, Clock]]:
    clock = Clock()
    offers = [ModelOffer(ModelId("m"), 30, {"fp32": 10 * MB})]
    registry = Registry(
        offers, {ModelId("m"): "m"}, dead_after_s=600, clock=clock, heartbeat_interval_s=2.0
    )
    access = AccessConfig(swarm_key=SWARM, api_keys=(KEY,))
    app = create_app(registry, TrackerConfig(), prober=TrustingProber(), access=access)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, "the tracker server")
    yield f"http://127.0.0.1:{port}", clock
    server.should_exit = True
    thread.join(10)


TOKENS: dict[str, str] = {}  # node id -> its membership token


def member(url: str, path: str, body: dict[str, Any]) -> None:
    """A signed call as node `body["node_id"]` makes it (with its membership token)."""
    if path.endswith("/heartbeat"):
        body = body | {"token": TOKENS[body["node_id"]]}
    with httpx.Client(base_url=url, auth=Signer(SWARM).auth("tracker")) as client:
        response = client.post(path, json=body)
        assert response.status_code == 200
        if path.endswith("/register"):
            TOKENS[body["node_id"]] = response.json()["token"]


def node(name: str, port: int, loaded: list[dict[str, Any]]) -> dict[str, Any]:
    """A registration with room for exactly ten layers (no spare room for replicas)."""
    address = f"http://127.0.0.1:{port}"
    return {"node_id": name, "address": address, "budget_bytes": 100 * MB, "quant": "fp32"} | {
        "throughput": 1.0,
        "loaded": loaded,
    }


def page_value(page: Any, script: str) -> Any:
    return page.execute_script(f"return {script}")  # one read: the page redraws as we look


def test_the_page_draws_loading_late_gaps_requests_and_directives(
    tracker: tuple[str, Clock], tmp_path: Path
) -> None:
    url, clock = tracker
    member(
        url,
        "/v1/nodes/register",
        node("late", 9001, [{"model": "m", "span": {"start": 20, "end": 30}}]),
    )
    clock.now = 10.0  # "late" has not beaten for 10 s (interval 2 s)
    member(
        url,
        "/v1/nodes/register",
        node("entry", 9002, [{"model": "m", "span": {"start": 0, "end": 10}}]),
    )
    # told to load the gap 10:20, and to drop what it kept of a model no longer offered
    member(
        url,
        "/v1/nodes/register",
        node("fresh", 9003, [{"model": "retired", "span": {"start": 0, "end": 2}}]),
    )
    member(
        url,
        "/v1/nodes/heartbeat",
        {"node_id": "entry", "requests": [SUMMARY], "threads": 3}
        | {"loaded": [{"model": "m", "span": {"start": 0, "end": 10}}]},
    )
    gap = {"model": "m", "span": {"start": 10, "end": 20}}
    fetching = {"shard": gap, "done_bytes": 5 * MB, "total_bytes": 20 * MB, "rate_bytes_s": MB}
    member(  # its weights come over the mesh (ADR-0054)
        url,
        "/v1/nodes/heartbeat",
        {"node_id": "fresh", "loading": [gap], "fetching": [fetching]},
    )
    with chromium() as page:
        page.get(f"{url}/?poll=200")
        wait_for(
            lambda: not page_value(page, "document.getElementById('login').hidden"),
            10,
            "the key form",
        )
        assert "API key" in page_value(page, "document.getElementById('summary').textContent")
        page.find_element("id", "api-key").send_keys(KEY)
        page.find_element("css selector", "#login button").click()
        wait_for(
            lambda: page_value(page, "document.querySelectorAll('#nodes tbody tr').length") == 3,
            10,
            "the nodes",
        )
        page.save_screenshot(str(tmp_path / "dashboard-states.png"))
        states = page_value(
            page,
            "[...document.querySelectorAll('#nodes tbody tr')]"
            ".map(r => [r.dataset.node, r.dataset.state, r.cells.length])",
        )
        assert sorted(states) == [
            ["entry", "ready", 10],  # the threads column too (ADR-0053)
            ["fresh", "loading", 10],
            ["late", "late", 10],
        ]
        threads = page_value(  # the compute threads its heartbeat said (ADR-0053)
            page, "document.querySelector('#nodes tr[data-node=entry]').cells[7].textContent"
        )
        assert threads == "3"
        spans = page_value(
            page, "document.querySelector('#nodes tr[data-node=fresh]').cells[5].textContent"
        )
        assert "m 10:20 (fetching 5" in spans and "15 s left" in spans, spans
        cells = page_value(
            page,
            "[...document.querySelectorAll('.map .cell[data-node]')]"
            ".filter(c => c.className.trim() !== 'cell')"
            ".map(c => [c.dataset.node, c.className.split(' ')[1], Number(c.dataset.layer)])",
        )
        kinds = {(n, kind) for n, kind, _ in cells}
        assert kinds == {("entry", "loaded"), ("fresh", "loading"), ("late", "late")}
        assert {layer for n, _, layer in cells if n == "late"} == set(range(20, 30))
        gaps = page_value(
            page,
            "[...document.querySelectorAll('.cell[data-state=gap]')]"
            ".map(c => Number(c.dataset.layer))",
        )
        assert set(range(20, 30)) <= set(gaps) and 0 not in gaps  # late layers are a gap
        request = page_value(page, "document.querySelector('#requests tbody tr').textContent")
        assert "entry" in request and "13.9" in request and "stop" in request
        directives = page_value(page, "document.querySelector('#directives tbody').textContent")
        assert "LOAD_SHARD" in directives and "closes gap" in directives
        assert "DROP_SHARD" in directives and "retired is no longer offered" in directives
