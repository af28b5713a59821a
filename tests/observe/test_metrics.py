"""Prometheus metrics: every family the issue names, and a node's counters after real calls."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
import torch

from meshnet.node.app import create_app
from meshnet.node.runner import EchoRunner
from meshnet.observe.metrics import Metrics
from meshnet.types import LayerSpan, ModelId
from meshnet.wire import FrameMeta
from tests.conftest import run
from tests.owned import encode, new_session, proof

FAMILIES = [
    ("meshnet_sessions_active", "gauge"),
    ("meshnet_forward_seconds", "histogram"),
    ("meshnet_tokens_generated_total", "counter"),
    ("meshnet_bytes_sent_total", "counter"),
    ("meshnet_bytes_received_total", "counter"),
    ("meshnet_kv_cache_bytes", "gauge"),
    ("meshnet_failovers_total", "counter"),
    ("meshnet_directives_total", "counter"),
    ("meshnet_layers_covered", "gauge"),
]


@pytest.mark.parametrize(("name", "kind"), FAMILIES)
def test_every_process_declares_the_family(name: str, kind: str) -> None:
    text = Metrics().render().decode()
    assert f"# TYPE {name} {kind}" in text


def test_scrape_hooks_refresh_gauges_before_each_scrape() -> None:
    metrics, sessions = Metrics(), [3]
    metrics.on_scrape(lambda: metrics.sessions_active.set(sessions[0]))
    assert "meshnet_sessions_active 3.0" in metrics.render().decode()
    sessions[0] = 0
    assert "meshnet_sessions_active 0.0" in metrics.render().decode()


async def forward_then_scrape(frames: list[tuple[dict[str, str], bytes]]) -> str:
    app = create_app(EchoRunner(ModelId("default"), LayerSpan(0, 10)))
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 1))
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        for headers, body in frames:
            await client.post("/forward", headers=headers, content=body)
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


def test_a_node_counts_forward_time_bytes_sessions_and_refusals() -> None:
    meta = FrameMeta(new_session(), ModelId("default"), LayerSpan(0, 10), position=0)
    hidden = torch.randn(1, 4, 16)
    good = encode(hidden, meta)
    wrong_span = {**good.headers, "X-Meshnet-Layers": "0:5"} | proof(
        replace(meta, span=LayerSpan(0, 5)), hidden
    )
    body = bytes(good.body)
    text = run(forward_then_scrape([(good.headers, body), (wrong_span, body)]))
    samples = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert float(samples['meshnet_forward_seconds_count{model="default"}']) == 1
    assert float(samples['meshnet_bytes_received_total{encoding="none"}']) == 2 * len(body)
    assert float(samples['meshnet_bytes_sent_total{encoding="none"}']) == len(body)
    assert float(samples["meshnet_sessions_active"]) == 1
    assert float(samples['meshnet_errors_total{error="WireError"}']) == 1


def test_every_family_is_the_attribute_of_its_kind_and_names_are_unique() -> None:
    """The table (`FAMILIES`) and the typed attributes agree one to one (issue #61: the
    families as a table, not a 127-line constructor)."""
    from typing import get_type_hints

    from meshnet.observe.metrics import FAMILIES, Metrics

    hints = {k: v for k, v in get_type_hints(Metrics).items() if not k.startswith("_")}
    assert {f.attribute: f.kind for f in FAMILIES} == hints
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
    metrics = Metrics()
    assert all(isinstance(getattr(metrics, f.attribute), f.kind) for f in FAMILIES)
