"""Arbitrary bodies (any JSON, broken JSON, other content types) against every JSON endpoint
of the tracker, the API and the node; each followed by a correct request that must still be
right. Schemathesis (`test_openapi.py`) covers schema-shaped cases; these cover the rest."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from meshnet.config import AccessConfig, WireConfig, WireLimits
from meshnet.node.app import NodeService
from meshnet.node.app import create_app as create_node_app
from meshnet.node.runner import EchoRunner
from meshnet.types import LayerSpan, ModelId
from tests.fuzz.harness import KEY, SigningProxy, record, report
from tests.fuzz.test_openapi import api, tracker

pytestmark = pytest.mark.slow
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=30)
)
documents = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=20,
)
known_keys = st.dictionaries(
    st.sampled_from(
        [
            "model",
            "messages",
            "prompt",
            "max_tokens",
            "node_id",
            "address",
            "loaded",
            "span",
            "stream",
            "stop",
            "temperature",
            "budget_bytes",
            "quant",
            "throughput",
            "reason",
        ]
    ),
    documents,
    max_size=6,
)
bodies = st.one_of(
    documents.map(lambda d: (json.dumps(d).encode(), "application/json")),
    known_keys.map(lambda d: (json.dumps(d).encode(), "application/json")),
    st.binary(max_size=200).map(lambda b: (b, "application/json")),
    st.text(max_size=50).map(lambda t: (t.encode(), "text/plain")),
)
ENDPOINTS = {
    "tracker": ["/v1/nodes/register", "/v1/nodes/heartbeat", "/v1/nodes/leave", "/v1/nodes/report"],
    "api": ["/v1/chat/completions", "/v1/completions"],
}


@pytest.mark.parametrize(
    ("name", "path"), [(n, p) for n, paths in ENDPOINTS.items() for p in paths]
)
def test_any_body_gets_a_json_answer_below_500(name: str, path: str) -> None:
    app, still_right = {"tracker": tracker, "api": api}[name]()

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=bodies)
    def one(body: tuple[bytes, str]) -> None:
        content, media = body
        response = client.post(path, content=content, headers={"Content-Type": media})
        record(f"{name} POST {path}", response.status_code)
        assert response.status_code < 500, response.text
        if response.status_code >= 400:
            assert response.json()["error"]["message"]
        still_right(client)

    with TestClient(SigningProxy(app), client=("127.0.0.1", 50000)) as client:
        one()
    print(report())


def test_node_identity_and_session_paths_take_any_text() -> None:
    runner = EchoRunner(ModelId("m"), LayerSpan(0, 2))
    service = NodeService([runner], WireLimits(), WireConfig())
    service.node_id = "node-a"
    app = SigningProxy(create_node_app(service=service, access=AccessConfig(KEY)), "node-a")

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(text=st.text(max_size=300))
    def one(text: str) -> None:
        identity = client.get("/v1/identity", params={"challenge": text})
        dropped = client.delete(f"/sessions/{quote(text, safe='')}")
        for response in (identity, dropped):
            record("node GET /v1/identity, DELETE /sessions/{id}", response.status_code)
            assert response.status_code < 500, response.text
        good = client.get("/v1/identity", params={"challenge": "c" * 32})
        assert good.status_code == 200 and good.json()["node_id"] == "node-a"

    with TestClient(app, client=("127.0.0.1", 50000)) as client:
        one()
    print(report())
