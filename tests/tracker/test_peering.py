"""Several trackers over real HTTP (ADR-0057): they elect one planner, another takes over
within 3 heartbeat intervals when it stops, and trackers of another mesh are refused."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, ExitStack
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse

from meshnet.assemble.tracker import build_tracker_app, tracker_hello
from meshnet.config import AccessConfig, TrackerConfig
from meshnet.errors import ConfigError
from meshnet.node.trackers import Failover, check_trackers
from meshnet.security.signing import Signer
from meshnet.security.vouch import TrackerIdentity
from meshnet.tracker.peering import ask_statement, check_peers
from tests.e2e.procs import free_port
from tests.security.test_server import serving

INTERVAL_S = 0.5


def tracker(
    config: TrackerConfig, access: AccessConfig = AccessConfig()
) -> AbstractContextManager[int]:
    """A tracker app under uvicorn in a thread, at `config`'s port (asyncio's loop: uvloop's
    close fails in a thread stopped while the lease rounds run)."""
    return serving(build_tracker_app(config, access), port=config.port, loop="asyncio")


def configs(tmp_path: Path, n: int, **kw: object) -> list[TrackerConfig]:
    ports = [free_port() for _ in range(n)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    return [
        TrackerConfig(
            port=port,
            heartbeat_interval_s=INTERVAL_S,
            dead_after_s=3 * INTERVAL_S,
            data_dir=str(tmp_path),
            peers=tuple(u for u in urls if not u.endswith(f":{port}")),
            **kw,  # type: ignore[arg-type]
        )
        for port in ports
    ]


def render_text(coverage: dict[str, object], url: str) -> str:
    from rich.console import Console

    from meshnet.status import render

    console = Console(width=200, record=True)
    console.print(render(coverage, url))
    return console.export_text()


def planners(urls: list[str]) -> set[object]:
    said = set()
    for url in urls:
        try:
            said.add(httpx.get(url + "/health", timeout=1.0).json()["planner"])
        except httpx.HTTPError:
            continue
    return said


def wait_for_one(urls: list[str], within_s: float, gone: str = "") -> tuple[str, float]:
    """The one planner every tracker at `urls` names (not `gone`), and how long it took."""
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        said = planners(urls)
        if len(said) == 1 and not said & {None, gone}:
            return str(said.pop()), time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"no one planner after {within_s} s: {planners(urls)}")


def test_three_trackers_agree_on_one_planner_and_elect_another_when_it_stops(
    tmp_path: Path,
) -> None:
    three = configs(tmp_path, 3)
    urls = [f"http://127.0.0.1:{c.port}" for c in three]
    with ExitStack() as everything:
        running = {url: everything.enter_context(ExitStack()) for url in urls}
        for url, config in zip(urls, three, strict=True):
            running[url].enter_context(tracker(config))
        first, _ = wait_for_one(urls, 10 * INTERVAL_S)
        # the first in URL order asks first; its voters must hear its key from its own hello
        # first (ADR-0059), which a loaded machine can make later than the next one's turn
        assert first in urls
        follower = max(urls)  # `meshnet status` on any tracker names the planner
        coverage = httpx.get(follower + "/v1/coverage").json()
        assert coverage["planner"] == first
        assert f"planner {first}" in render_text(coverage, follower)
        # bad asks change nothing: a clear 4xx, and the planner stays
        garbage = httpx.post(follower + "/v1/trackers/lease", json={"url": 5, "term": -1})
        assert garbage.status_code == 400 and "term" in garbage.text
        stranger = {"url": "http://x:1", "trackers": ["http://x:1"], "models": [], "term": 99}
        refused = httpx.post(follower + "/v1/trackers/lease", json=stranger)
        assert refused.status_code == 409 and "http://x:1" in refused.json()["error"]["message"]
        models = [m["model"] for m in coverage["models"]]  # review L2: a URL of no tracker
        impostor = {"url": "http://127.0.0.1:9", "trackers": urls, "models": models, "term": 9}
        refused = httpx.post(follower + "/v1/trackers/lease", json=impostor)
        assert refused.status_code == 409 and "127.0.0.1:9" in refused.json()["error"]["message"]
        assert planners(urls) == {first}
        running[first].close()  # stops its server
        rest = [u for u in urls if u != first]
        second, took_s = wait_for_one(rest, 6 * INTERVAL_S, gone=first)
        assert took_s <= 3 * INTERVAL_S + 0.5  # + polling and a loaded CI
        health = httpx.get(second + "/health").json()
        assert health["trackers"] == sorted(urls)
        # L2's rest: a member asks in the name of the listed tracker that is down, signed
        # with a key of its own (or not at all): refused, and the planner stays
        member = TrackerIdentity()
        term = int(health["term"]) + 5
        ask = {"url": first, "trackers": sorted(urls), "models": models, "term": term}
        ask["signature"] = member.sign(ask_statement(first, term, sorted(urls), models))
        for forged in ({**ask, "key": member.public}, {**ask, "signature": ""}):
            refused = httpx.post(max(rest) + "/v1/trackers/lease", json=forged)
            assert refused.status_code == 409, refused.text
            assert refused.json()["error"]["field"] == "signature"
        assert planners(rest) == {second}


def test_trackers_of_another_mesh_are_refused_at_start_naming_both(tmp_path: Path) -> None:
    a, b = configs(tmp_path, 2)
    a_url, b_url = f"http://127.0.0.1:{a.port}", f"http://127.0.0.1:{b.port}"
    signer = Signer(None)
    with tracker(a):
        assert check_peers(tracker_hello(b, AccessConfig(), ["default"]), signer) == []
        other_models = tracker_hello(b, AccessConfig(), ["default", "gemma"])
        with pytest.raises(ConfigError, match="offer different models") as refused:
            check_peers(other_models, signer)
        assert a_url in str(refused.value) and b_url in str(refused.value)
        three = replace(b, peers=(a_url, "http://127.0.0.1:9"))
        with pytest.raises(ConfigError, match="list different trackers"):
            check_peers(tracker_hello(three, AccessConfig(), ["default"]), signer)
    # a peer that is down: started without, and named
    assert check_peers(tracker_hello(b, AccessConfig(), ["default"]), signer) == [a_url]


def test_a_peer_with_another_swarm_key_is_refused_naming_both(tmp_path: Path) -> None:
    a, b = configs(tmp_path, 2)
    with tracker(a, AccessConfig(swarm_key="k" * 43)):
        with pytest.raises(ConfigError, match="swarm key") as refused:
            check_peers(tracker_hello(b, AccessConfig(), ["default"]), Signer("x" * 43))
        assert str(a.port) in str(refused.value) and str(b.port) in str(refused.value)


def test_a_node_refuses_trackers_that_offer_different_models_and_names_a_down_one(
    tmp_path: Path,
) -> None:
    a, b = configs(tmp_path, 2)
    urls = [f"http://127.0.0.1:{c.port}" for c in (a, b)]
    with tracker(a):
        assert check_trackers([*urls]) == [urls[1]]  # b is down: named, the node starts
    other = Starlette()
    other.add_route("/health", lambda _: JSONResponse({"models": ["default", "gemma"]}))
    with tracker(replace(a, peers=())), serving(other) as port:
        urls[1] = f"http://127.0.0.1:{port}"
        with pytest.raises(ConfigError, match="offer different models") as refused:
            check_trackers(urls)
        assert urls[0] in str(refused.value) and urls[1] in str(refused.value)
        garbage = Starlette()
        garbage.add_route("/health", lambda _: PlainTextResponse("<html>"))
        with serving(garbage) as bad:
            assert check_trackers([urls[0], f"http://127.0.0.1:{bad}"]) == [
                f"http://127.0.0.1:{bad}"
            ]


def test_calls_go_to_the_next_tracker_when_one_refuses_connections_and_stay_there() -> None:
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        if request.url.host == "a":
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/fails":
            return httpx.Response(500)
        return httpx.Response(200, json={"from": request.url.host})

    import asyncio

    async def scenario() -> None:
        transport = Failover(["http://a:1", "http://b:2"], httpx.MockTransport(answer))
        async with httpx.AsyncClient(base_url="http://a:1", transport=transport) as client:
            assert (await client.get("/v1/entries")).json() == {"from": "b"}
            assert (await client.get("/v1/entries")).json() == {"from": "b"}
            assert (await client.get("/fails")).status_code == 500  # reached: never re-sent
        assert seen == ["a", "b", "b", "b"]

    asyncio.run(scenario())


def test_a_tracker_as_node_refuses_peers() -> None:
    from meshnet.assemble.tracker import build_tracker_node_app
    from meshnet.config import NodeConfig

    with pytest.raises(ConfigError, match="--peers needs trackers without a span"):
        build_tracker_node_app(TrackerConfig(peers=("http://b:1",)), NodeConfig())
