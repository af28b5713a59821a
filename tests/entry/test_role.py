"""A node that may be an entry: its API answers for exactly the models whose entry span it
holds, as spans come and go (the node app in-process; no tracker is reached)."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from meshnet.assemble.entry import EntryModel
from meshnet.assemble.node import build_app
from meshnet.config import NodeConfig, TrackerConfig
from meshnet.node.runner import EchoRunner
from meshnet.text.codec import CharCodec
from meshnet.types import LayerSpan
from tests.e2e.procs import free_port
from tests.entry.fakes import MODEL, CountingHead

MB = 1 << 20


def node_config(tmp_path: Path) -> NodeConfig:
    # joins a tracker that is never reached: the app's lifespan (the agent) is not started
    return NodeConfig(
        trackers=("http://127.0.0.1:9",), data_dir=str(tmp_path), budget_bytes=100 * MB
    )


def fake_entry(span: LayerSpan) -> EntryModel:
    runner = EchoRunner(MODEL, span)
    return EntryModel(MODEL, runner, CountingHead(), CharCodec(), 6, 4096)  # type: ignore[arg-type]


def complete(client: TestClient) -> tuple[int, dict[str, object]]:
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 3, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    return response.status_code, response.json()


def test_the_api_answers_for_the_models_whose_entry_span_the_node_holds(tmp_path: Path) -> None:
    app = build_app(node_config(tmp_path))
    # loopback, naming localhost: no API key needed
    client = TestClient(app, base_url="http://localhost", client=("127.0.0.1", 50000))
    assert client.get("/v1/models").json()["data"] == []  # no span from layer 0 yet
    status, body = complete(client)
    assert status == 404 and "not served here" in str(body)
    app.state.role.add(fake_entry(LayerSpan(0, 6)))  # what `attach` does after a load
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]
    status, body = complete(client)
    assert status == 200 and body["choices"][0]["text"] == "cde"  # type: ignore[index]
    app.state.role.detach(MODEL, LayerSpan(0, 4))  # another span of the model: no change
    assert complete(client)[0] == 200
    app.state.role.detach(MODEL, LayerSpan(0, 6))  # its entry span dropped
    assert complete(client)[0] == 404
    assert client.get("/health").status_code == 200  # the node's own routes are unchanged
    assert client.post("/forward").status_code == 400  # no frame headers: refused, not 404


def test_a_node_that_may_not_be_an_entry_has_no_api(tmp_path: Path) -> None:
    client = TestClient(
        build_app(replace(node_config(tmp_path), entry=False)), client=("127.0.0.1", 1)
    )
    answer = client.get("/v1/models")
    assert answer.status_code == 404 and answer.json()["error"]["message"] == "Not Found"  # no API


def test_spans_given_by_hand_load_on_the_compute_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiled decode step is built for the thread count of the thread that loads it:
    loaded on the loop thread (one thread), it was built again at the first request (8.8 s).
    So `--layers` loads, a node's and a tracker's, run where model calls run."""
    from meshnet.assemble import tracker
    from meshnet.assemble.entry import EntryRole

    threads: list[str] = []

    def load(self: EntryRole, model_id: str, source: str, span: LayerSpan) -> EchoRunner:
        threads.append(threading.current_thread().name)
        return EchoRunner(MODEL, span)

    def load_entry(config: NodeConfig, model_id: str, source: str, span: LayerSpan) -> EntryModel:
        threads.append(threading.current_thread().name)
        return fake_entry(span)

    monkeypatch.setattr(EntryRole, "load", load)
    monkeypatch.setattr(tracker, "load_entry_model", load_entry)
    config = replace(node_config(tmp_path), layers="0:6", budget_bytes=None)
    build_app(config)
    tracker.build_tracker_node_app(TrackerConfig(port=free_port()), config)
    assert len(threads) == 2 and all(name.startswith("compute") for name in threads)
