"""What the tracker shows: node states, late nodes' gaps, the fast dead-node check, recent
requests and directives, its metrics and its dashboard files."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from meshnet.config import AccessConfig, TrackerConfig
from meshnet.tracker.app import create_app, watch
from meshnet.tracker.beats import overdue
from meshnet.tracker.planner import ModelOffer
from meshnet.tracker.probe import TrustingProber
from meshnet.tracker.registry import Registry
from meshnet.types import ModelId, NodeId
from tests.tracker.members import Members
from tests.tracker.test_app import MB, Clock, beat, register

INTERVAL_S = 2.0
SPAN = {"start": 0, "end": 30}
SUMMARY = {
    "session": "s-1",
    "model": "m",
    "outcome": "stop",
    "prompt_tokens": 38,
    "completion_tokens": 7,
    "duration_s": 0.8,
    "time_to_first_token_s": 0.23,
    "decode_tokens_per_s": 13.9,
}


class Tracker:
    def __init__(self, access: AccessConfig = AccessConfig()) -> None:
        self.clock = Clock()
        offers = [ModelOffer(ModelId("m"), 30, {q: 10 * MB for q in ("fp32", "bf16")})]
        self.registry = Registry(
            offers,
            {ModelId("m"): "m"},
            dead_after_s=3 * INTERVAL_S,
            clock=self.clock,
            heartbeat_interval_s=INTERVAL_S,
        )
        self.prober = TrustingProber()
        config = TrackerConfig(heartbeat_interval_s=INTERVAL_S)
        app = create_app(self.registry, config, prober=self.prober, access=access)
        self.client = Members(TestClient(app))

    def coverage(self) -> dict[str, Any]:
        body: dict[str, Any] = self.client.get("/v1/coverage").json()
        return body


@pytest.fixture
def tracker() -> Tracker:
    return Tracker()


def node_states(tracker: Tracker) -> dict[str, str]:
    return {n["node_id"]: n["state"] for n in tracker.coverage()["nodes"]}


def test_states_follow_directives_loads_heartbeats_and_reports(tracker: Tracker) -> None:
    register(tracker.client, "a", 400)
    assert node_states(tracker) == {"a": "loading"}
    beat(tracker.client, "a", [{"model": "m", "span": SPAN}])
    assert node_states(tracker) == {"a": "ready"}
    tracker.clock.now = 1.5 * INTERVAL_S + 0.01
    assert node_states(tracker) == {"a": "late"}
    beat(tracker.client, "a", [{"model": "m", "span": SPAN}])
    for reporter in ("e1", "e2"):  # one member's report changes only its own routes (N5)
        token = register(tracker.client, reporter, 1)["token"]
        body = {"node_id": "a", "reason": "timeout", "reporter": reporter, "token": token}
        tracker.client.post("/v1/nodes/report", json=body)
        agreed = reporter == "e2"
        assert node_states(tracker)["a"] == ("suspect" if agreed else "ready")


def test_a_late_nodes_layers_show_as_a_gap_but_stay_routable(tracker: Tracker) -> None:
    register(tracker.client, "a", 400, loaded=[{"model": "m", "span": SPAN}])
    tracker.clock.now = 1.5 * INTERVAL_S + 0.01  # one beat clearly missed, not yet expired
    model = tracker.coverage()["models"][0]
    assert model["gaps"] == [SPAN] and model["layers"][0]["serving"] == []
    assert model["routable"]  # routes still use it until it expires or fails a hop
    assert tracker.client.get("/v1/route", params={"model": "m"}).status_code == 200


@pytest.mark.parametrize(
    ("seen_s", "checked_s", "now_s", "check"),
    [
        (0.0, 0.0, 2.0, False),  # on time
        (0.0, 0.0, 1.1 * INTERVAL_S + 0.01, True),  # overdue, never checked
        (0.0, 2.3, 2.5, False),  # overdue, already checked since its last beat
        (3.0, 2.3, 5.4, True),  # it beat again, then fell overdue again
    ],
)
def test_overdue_nodes_are_checked_once_per_missed_beat(
    seen_s: float, checked_s: float, now_s: float, check: bool
) -> None:
    beats = {NodeId("a"): (seen_s, checked_s)}
    assert overdue(beats, now_s, INTERVAL_S) == ([NodeId("a")] if check else [])


@given(
    st.dictionaries(
        st.sampled_from(["a", "b", "c"]),
        st.tuples(st.floats(0, 100), st.floats(0, 100)),
    ),
    st.floats(0, 200),
)
def test_overdue_never_names_a_node_heard_from_within_the_interval(
    beats: dict[str, tuple[float, float]], now_s: float
) -> None:
    for node in overdue({NodeId(k): v for k, v in beats.items()}, now_s, INTERVAL_S):
        assert now_s - beats[node][0] > INTERVAL_S


def run_watch_once(tracker: Tracker) -> None:
    async def once() -> None:
        task = asyncio.create_task(watch(tracker.registry, tracker.prober, 0.001))
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(once())


def test_a_killed_node_is_dropped_one_interval_after_its_last_beat(tracker: Tracker) -> None:
    for node in ("a", "bb"):
        register(tracker.client, node, 400, loaded=[{"model": "m", "span": SPAN}])
    tracker.prober.gone.add("http://127.0.0.1:9001")  # a's address: connection refused
    tracker.clock.now = 1.1 * INTERVAL_S + 0.01  # bb is as overdue, but still listens
    run_watch_once(tracker)
    assert sorted(tracker.registry.nodes) == ["bb"]
    assert tracker.registry.nodes[NodeId("bb")].checked_s == tracker.clock.now  # checked once


def test_heartbeats_bring_recent_requests_to_the_coverage_answer(tracker: Tracker) -> None:
    register(tracker.client, "entry", 400, loaded=[{"model": "m", "span": SPAN}])
    tracker.clock.now = 1.0
    body = {"node_id": "entry", "loaded": [{"model": "m", "span": SPAN}], "requests": [SUMMARY]}
    assert tracker.client.post("/v1/nodes/heartbeat", json=body).status_code == 200
    tracker.clock.now = 3.5
    (request,) = tracker.coverage()["recent_requests"]
    assert request == SUMMARY | {"entry": "entry", "age_s": 2.5, "failovers": 0, "error": ""}


@pytest.mark.parametrize(
    "bad",
    [
        {"decode_tokens_per_s": float("inf")},
        {"outcome": "exploded"},
        {"session": "../etc"},
        {"error": "x" * 501},
    ],
)
def test_bad_request_summaries_are_refused_and_change_nothing(
    tracker: Tracker, bad: dict[str, Any]
) -> None:
    register(tracker.client, "entry", 400)
    body = {"node_id": "entry", "requests": [SUMMARY | bad]}
    content = json.dumps(body).replace("Infinity", "1e999")  # JSON has no infinity
    response = tracker.client.post(
        "/v1/nodes/heartbeat", content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert tracker.coverage()["recent_requests"] == []


def test_directives_are_listed_with_node_reason_and_age(tracker: Tracker) -> None:
    register(tracker.client, "a", 400)
    tracker.clock.now = 4.0
    (directive,) = tracker.coverage()["recent_directives"]
    assert directive["node_id"] == "a" and directive["op"] == "LOAD_SHARD"
    assert directive["reason"].startswith("closes gap 0:30") and directive["age_s"] == 4.0


def metric(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[-1])


def test_metrics_count_directives_and_covered_layers_and_errors(tracker: Tracker) -> None:
    register(tracker.client, "a", 400)
    text = tracker.client.get("/metrics").text
    assert metric(text, 'meshnet_directives_total{op="LOAD_SHARD"}') == 1
    assert metric(text, 'meshnet_layers_covered{model="m"}') == 0
    beat(tracker.client, "a", [{"model": "m", "span": SPAN}])
    tracker.client.post("/v1/nodes/heartbeat", json={"node_id": "ghost"})  # 404
    text = tracker.client.get("/metrics").text
    assert metric(text, 'meshnet_layers_covered{model="m"}') == 30
    assert metric(text, 'meshnet_errors_total{error="UnknownNodeError"}') == 1


def test_the_dashboard_is_static_open_and_reads_coverage_with_the_callers_key() -> None:
    tracker = Tracker(AccessConfig(swarm_key="ab" * 32, api_keys=("k-0123456789abcdef",)))
    page = tracker.client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/dashboard/dashboard.js">' in page.text
    script = tracker.client.get("/dashboard/dashboard.js")
    assert script.status_code == 200 and "/v1/coverage" in script.text
    assert tracker.client.get("/dashboard/dashboard.css").status_code == 200
    # the data is not open: a key (or loopback without keys, or a swarm proof) is needed
    assert tracker.client.get("/v1/coverage").status_code == 401
    assert tracker.client.get("/metrics").status_code == 401
    bearer = {"Authorization": "Bearer k-0123456789abcdef"}
    assert tracker.client.get("/v1/coverage", headers=bearer).status_code == 200
    assert tracker.client.get("/metrics", headers=bearer).status_code == 200
