"""A tracker and real nodes on loopback: coverage by directives alone, failure, restarts."""

from __future__ import annotations

import io
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshnet.security.signing import Signer
from meshnet.terminal import GenerateOptions, run_generate
from tests.e2e.procs import free_port, get_json, start, stop_together, wait_for

HEARTBEAT_S, DEAD_AFTER_S = 0.5, 2.0
# fp32 layers of the default model are 14,160,384 bytes; with the 10% KV reserve, 165 MB
# holds exactly 10 of them, so three nodes must split the 30 layers three ways.
BUDGET = "165MB"
ENTRY_BUDGET = "290MB"  # the fp32 head (113,248,512 bytes) and ten layers
KEY = "tracker-mesh-test-swarm-key-padded-to-128-bits-0123456789"
ENV = {**os.environ, "MESHNET_SWARM_KEY": KEY}


def spans(coverage: dict[str, Any]) -> dict[str, list[tuple[int, int]]]:
    return {
        n["node_id"]: [(s["span"]["start"], s["span"]["end"]) for s in n["loaded"]]
        for n in coverage["nodes"]
    }


def model(coverage: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = coverage["models"][0]
    return result


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tracker_args = [
        "tracker",
        "--model",
        "default",
        "--port",
        str(port),
        "--heartbeat-interval",
        str(HEARTBEAT_S),
        "--dead-after",
        str(DEAD_AFTER_S),
    ]
    procs: dict[str, subprocess.Popen[bytes]] = {
        "tracker": start(tracker_args, tmp_path / "tracker.log", ENV)
    }

    def add_node(name: str, budget: str = BUDGET, *extra: str) -> None:
        size = ["--budget", budget] if budget else []
        procs[name] = start(
            ["node", "--tracker", url, "--port", str(free_port()), *size, "--quant", "fp32"]
            + ["--data-dir", str(tmp_path / name), *extra],
            tmp_path / f"{name}.log",
            ENV,
        )

    state = {
        "url": url,
        "procs": procs,
        "add_node": add_node,
        "tracker_args": tracker_args,
        "logs": tmp_path,
    }
    try:
        wait_for(lambda: get_json(f"{url}/health")["status"] == "ok", 60, "the tracker")
        yield state
    finally:
        stop_together(procs.values())


@pytest.mark.slow
def test_directives_alone_cover_the_model_and_survive_failures(cluster: dict[str, Any]) -> None:
    url, procs = cluster["url"], cluster["procs"]
    # layer 0 goes only to a node that may be an entry, with room for the head (113 MB fp32)
    # and ten layers; the other two are plain and take the rest, ten layers each
    cluster["add_node"]("n1", ENTRY_BUDGET)
    for name in ("n2", "n3"):
        cluster["add_node"](name, BUDGET, "--no-entry")
    wait_for(lambda: model(get_json(f"{url}/v1/coverage"))["routable"], 120, "full coverage")
    coverage = get_json(f"{url}/v1/coverage")
    assert sorted(s for v in spans(coverage).values() for s in v) == [(0, 10), (10, 20), (20, 30)]
    assert httpx.get(f"{url}/v1/route?model=default").status_code == 401  # members only
    route = httpx.get(f"{url}/v1/route?model=default", auth=Signer(KEY).auth("tracker")).json()
    assert [(h["span"]["start"], h["span"]["end"]) for h in route["hops"]] == [
        (0, 10),
        (10, 20),
        (20, 30),
    ]

    # SIGKILL the node serving 10:20: its layers become a gap once it misses heartbeats.
    victim_id = next(n for n, s in spans(coverage).items() if s == [(10, 20)])
    victim = next(
        name
        for name in ("n1", "n2", "n3")
        if (cluster["logs"] / name / "node_id").read_text().strip() == victim_id
    )
    procs[victim].kill()
    wait_for(
        lambda: model(get_json(f"{url}/v1/coverage"))["gaps"] == [{"start": 10, "end": 20}],
        4 * DEAD_AFTER_S,
        "the gap",
    )

    # A fourth node with room is told to load exactly the gap, within two heartbeats.
    cluster["add_node"]("n4", "400MB")
    n4_id = lambda: (cluster["logs"] / "n4" / "node_id").read_text().strip()  # noqa: E731
    wait_for(lambda: (cluster["logs"] / "n4" / "node_id").exists(), 60, "n4 to start")
    wait_for(
        lambda: any(n["node_id"] == n4_id() for n in get_json(f"{url}/v1/coverage")["nodes"]),
        60,
        "n4 to register",
    )

    def n4_has_gap() -> bool:
        n4 = next(n for n in get_json(f"{url}/v1/coverage")["nodes"] if n["node_id"] == n4_id())
        held = [(s["span"]["start"], s["span"]["end"]) for s in n4["loading"] + n4["loaded"]]
        return held == [(10, 20)]

    assert wait_for(n4_has_gap, 10, "n4's LOAD_SHARD") <= 2 * HEARTBEAT_S
    directives = [
        d
        for d in get_json(f"{url}/v1/coverage")["recent_directives"]
        if d["span"] == {"start": 10, "end": 20} and d["op"] == "LOAD_SHARD"
    ]
    assert directives and "closes gap 10:20" in directives[-1]["reason"]
    wait_for(lambda: model(get_json(f"{url}/v1/coverage"))["routable"], 60, "coverage again")
    assert spans(get_json(f"{url}/v1/coverage"))[n4_id()] == [(10, 20)]

    # Restart the tracker: the nodes register again by themselves with what they hold.
    procs["tracker"].send_signal(signal.SIGKILL)
    procs["tracker"].wait()
    procs["tracker"] = start(cluster["tracker_args"], cluster["logs"] / "tracker2.log", ENV)
    wait_for(
        lambda: model(get_json(f"{url}/v1/coverage"))["routable"],
        60,
        "coverage after the tracker restart",
    )
    assert len(get_json(f"{url}/v1/coverage")["nodes"]) == 3


@pytest.mark.slow
def test_a_tracker_without_layers_forwards_clients_to_its_entries(cluster: dict[str, Any]) -> None:
    """Issue #19 (first part): the `openai` client asks a tracker that runs no model; the
    tracker forwards to the least loaded entry, and to the other one once that is killed."""
    import openai

    url, procs = cluster["url"], cluster["procs"]
    for name in ("e1", "e2"):
        cluster["add_node"](name, "", "--entry", "--layers", "0:10")
    # plain nodes join once the entries hold 0:10 (the planner cannot re-cut a span that a
    # node took before: ADR-0028); they take 10:20 and 20:30
    wait_for(lambda: len(entries(url)) == 2, 180, "two entries")
    for name in ("n1", "n2"):
        cluster["add_node"](name)
    wait_for(lambda: model(get_json(f"{url}/v1/coverage"))["routable"], 180, "the chain")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused-on-loopback", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["default"]
    ask = {"model": "default", "temperature": 0, "max_tokens": 12}
    question = [{"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(messages=question, **ask)  # type: ignore[call-overload]
    direct = httpx.post(
        f"{entries(url)[0]['address']}/v1/chat/completions",
        json={**ask, "messages": question},
        timeout=60,
    ).json()
    assert first.choices[0].message.content == direct["choices"][0]["message"]["content"]
    assert "Paris" in (first.choices[0].message.content or "")
    streamed = client.chat.completions.create(messages=question, stream=True, **ask)  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == first.choices[0].message.content

    chosen = entries(url)[0]["address"]
    victim = next(n for n in ("e1", "e2") if _address(cluster, n) == chosen)
    procs[victim].kill()
    procs[victim].wait()
    again = client.chat.completions.create(messages=question, **ask)  # type: ignore[call-overload]
    assert again.choices[0].message.content == first.choices[0].message.content
    assert [e["address"] for e in entries(url)] != [chosen]


@pytest.mark.slow
def test_the_planner_makes_entries_of_plain_nodes_and_clients_fail_over_to_the_second(
    cluster: dict[str, Any],
) -> None:
    """Issue #19, done when: a tracker with no layers and nodes with no `--entry` flag; the
    planner gives layer 0 (with the head) to a node that may be an entry, then a second
    entry; the `openai` client asks the tracker; SIGKILL the entry that answered and the
    next request is answered by the other one."""
    import openai

    url, procs = cluster["url"], cluster["procs"]
    node_ids = lambda: {n["node_id"] for n in get_json(f"{url}/v1/coverage")["nodes"]}  # noqa: E731
    # 300 MB without a head holds 19 layers; 350 MB holds the head and 14
    cluster["add_node"]("plain", "300MB", "--no-entry")
    wait_for(lambda: len(node_ids()) == 1, 120, "the plain node to register")
    cluster["add_node"]("a", "350MB")
    wait_for(lambda: len(entries(url)) == 1, 180, "the planner's first entry")
    wait_for(lambda: model(get_json(f"{url}/v1/coverage"))["routable"], 180, "the chain")
    cluster["add_node"]("b", "350MB")
    wait_for(lambda: len(entries(url)) == 2, 180, "a second entry")
    held = spans(get_json(f"{url}/v1/coverage"))
    assert sorted(held.values()) == [[(0, 14)], [(0, 14)], [(14, 30)]]
    reasons = [d["reason"] for d in get_json(f"{url}/v1/coverage")["recent_directives"]]
    assert any("an entry of default (1 before)" in r for r in reasons)

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused-on-loopback", max_retries=0)
    ask = {"model": "default", "temperature": 0, "max_tokens": 12}
    question = [{"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(messages=question, **ask)  # type: ignore[call-overload]
    assert first.choices[0].message.content == "The capital of France is Paris."
    route = first.model_extra["meshnet"]["route"]  # type: ignore[index]
    assert [h["span"] for h in route] == ["0:14", "14:30"]  # its own span, then the plain node
    victim = next(n for n in ("a", "b") if _node_id(cluster, n) == route[0]["node_id"])
    procs[victim].kill()
    procs[victim].wait()
    # at once: until the dead-node check the tracker still lists the dead entry; a call it
    # forwards there cannot connect and goes on to the other one
    again = client.chat.completions.create(messages=question, **ask)  # type: ignore[call-overload]
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.model_extra["meshnet"]["route"][0]["node_id"] != route[0]["node_id"]  # type: ignore[index]
    # `meshnet generate --tracker` asks /v1/entries and goes to an entry directly: the dead
    # one (if still listed) cannot be reached, the live one answers
    out = io.StringIO()
    options = GenerateOptions(temperature=0, max_tokens=12)
    assert run_generate(url, "What is the capital of France?", options, out=out) == 0
    assert out.getvalue().strip() == first.choices[0].message.content


def _node_id(cluster: dict[str, Any], name: str) -> str:
    return (cluster["logs"] / name / "node_id").read_text().strip()


def settled(url: str) -> bool:
    """No node is loading a span: the planner is done moving copies (a request in the
    middle of a move can find its route stale and no copy left: 503)."""
    return not any(n["loading"] for n in get_json(f"{url}/v1/coverage")["nodes"])


def entries(url: str, model_name: str = "default") -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = get_json(f"{url}/v1/entries?model={model_name}")["entries"]
    return listed


def _address(cluster: dict[str, Any], name: str) -> str:
    """The address node `name` registered with (from the tracker's node table)."""
    node_id = (cluster["logs"] / name / "node_id").read_text().strip()
    nodes = get_json(f"{cluster['url']}/v1/coverage")["nodes"]
    return str(next(n["address"] for n in nodes if n["node_id"] == node_id))


# Leaving on SIGTERM (re-planned before heartbeats expire) is tested under load, with the
# requests in flight, in tests/e2e/test_failover_mesh.py.


@pytest.mark.slow
@pytest.mark.parametrize("tracker_runs_default", [False, True], ids=["control-only", "as-node"])
def test_one_tracker_answers_for_two_models_each_with_its_own_entry(
    tmp_path: Path, tracker_runs_default: bool
) -> None:
    """Issue #19: the default model under a second id (a link to the same file), each with
    an entry of its own; the `openai` client asks the one tracker for both. The tracker is
    control plane only, or itself the default model's entry (then it forwards only `second`)."""
    import openai

    from meshnet.models.source import default_gguf

    second = tmp_path / "second.gguf"
    second.symlink_to(default_gguf())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    common = ["--quant", "fp32"]
    procs: list[subprocess.Popen[bytes]] = [
        start(
            ["tracker", "--model", "default", "--model", str(second), "--port", str(port)]
            + ["--heartbeat-interval", str(HEARTBEAT_S), "--dead-after", str(DEAD_AFTER_S)]
            + (["--layers", "0:10", *common] if tracker_runs_default else []),
            tmp_path / "tracker.log",
            ENV,
        )
    ]
    try:
        wait_for(lambda: get_json(f"{url}/health")["status"] == "ok", 60, "the tracker")

        def launch(name: str, model_name: str, *extra: str) -> None:
            args = ["node", "--tracker", url, "--port", str(free_port()), "--model", model_name]
            args += [*common, "--data-dir", str(tmp_path / name), *extra]
            procs.append(start(args, tmp_path / f"{name}.log", ENV))

        if not tracker_runs_default:
            launch("e1", "default", "--entry", "--layers", "0:10")
        launch("e2", str(second), "--entry", "--layers", "0:10")
        # plain nodes join once the entries hold 0:10: the planner then gives them 10:30 of
        # each model (it cannot re-cut a span a node took before the entries came)
        for name in ("default", "second"):
            wait_for(lambda n=name: len(entries(url, n)) == 1, 180, f"the entry of {name}")
        launch("n1", "default", "--budget", "330MB")
        launch("n2", "default", "--budget", "330MB")
        both = lambda: [m["routable"] for m in get_json(f"{url}/v1/coverage")["models"]]  # noqa: E731
        wait_for(lambda: both() == [True, True], 240, "both models routable")
        wait_for(lambda: settled(url), 60, "the planner's loads to end")  # no route goes stale
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused-on-loopback", max_retries=0)
        assert sorted(m.id for m in client.models.list().data) == ["default", "second"]
        question = [{"role": "user", "content": "What is the capital of France?"}]
        answers = {
            name: client.chat.completions.create(  # type: ignore[call-overload]
                model=name, messages=question, temperature=0, max_tokens=12
            )
            for name in ("default", "second")
        }
        texts = {name: a.choices[0].message.content for name, a in answers.items()}
        assert texts["default"] == texts["second"] and "Paris" in (texts["default"] or "")
        routes = {name: a.model_extra["meshnet"]["route"] for name, a in answers.items()}
        assert routes["default"][0]["node_id"] != routes["second"][0]["node_id"]  # two entries
        if tracker_runs_default:  # its own model runs here; `second` was forwarded
            assert routes["default"][0]["address"] == "local"
            assert routes["second"][0]["address"] == "local"  # local to the other entry
    finally:
        stop_together(procs)
