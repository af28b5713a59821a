"""`meshnet status`: the coverage map and node table as a terminal shows them."""

from __future__ import annotations

from rich.console import Console

from meshnet.status import layer_bar, render, run_status
from tests.tracker.test_app import beat, register
from tests.tracker.test_observe import Tracker


def text_of(coverage: dict[str, object]) -> str:
    console = Console(record=True, width=200)
    console.print(render(coverage, "http://tracker:8000"))
    return console.export_text()


def test_layer_bar_shows_copies_loading_and_gaps() -> None:
    model = {
        "layers": [{"serving": ["a", "b"], "loading": []}, {"serving": ["a"], "loading": []}]
        + [{"serving": [], "loading": ["c"]}, {"serving": [], "loading": []}]
    }
    assert layer_bar(model).plain == "21~."


def test_status_shows_each_model_bar_and_every_node() -> None:
    tracker = Tracker()
    register(tracker.client, "a", 110)  # told to load 0:11
    register(tracker.client, "bb", 400, loaded=[{"model": "m", "span": {"start": 11, "end": 30}}])
    text = text_of(tracker.coverage())
    assert "m            ~~~~~~~~~~~1111111111111111111  19/30 layers served  gaps 0:11" in text
    assert "NOT routable" in text
    for expected in ("a ", "loading", "bb", "ready", "m 11:30", "m 0:11 (loading)"):
        assert expected in text
    beat(tracker.client, "a", [{"model": "m", "span": {"start": 0, "end": 11}}])
    text = text_of(tracker.coverage())
    assert "30/30 layers served  no gaps  routable" in text


def test_status_shows_how_far_a_fetch_of_weights_has_come() -> None:
    shard = {"model": "m", "span": {"start": 0, "end": 11}}
    node = {"node_id": "a", "address": "http://a:1", "state": "loading", "budget_bytes": 1e9}
    node |= {"quant": "gguf", "loaded": [], "loading": [shard], "sessions": 0}
    node |= {"last_heartbeat_age_s": 0.5, "fetching": [fetch(shard)]}
    model = {"model": "m", "num_layers": 11, "gaps": [], "routable": False, "digest": "ab" * 32}
    model["layers"] = [{"serving": [], "loading": ["a"]}] * 11
    coverage = {"models": [model], "nodes": [node], "heartbeat_interval_s": 2.0}
    text = text_of(coverage)
    assert "m 0:11 (fetching 20/80 MB at 10.0 MB/s, 6 s left)" in text
    assert "m@abababababab" in text


def fetch(shard: dict[str, object]) -> dict[str, object]:
    return {"shard": shard, "done_bytes": 20e6, "total_bytes": 80e6, "rate_bytes_s": 10e6}


def test_an_unreachable_tracker_is_one_clear_line_and_exit_status_1() -> None:
    console = Console(record=True, width=200)
    assert run_status("http://127.0.0.1:9", None, None, console) == 1
    assert "meshnet status: http://127.0.0.1:9:" in console.export_text()


def test_clients_given_several_trackers_use_the_first_that_answers(capsys: object) -> None:
    """`--tracker A,B`: A is down, so `status`, `generate` and `chat` go to B; A is named."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse

    from meshnet.terminal import answering
    from tests.security.test_server import serving

    app = Starlette()
    app.add_route("/health", lambda _: JSONResponse({"status": "ok", "models": ["default"]}))
    with serving(app) as port:
        up = f"http://127.0.0.1:{port}"
        assert answering(["http://127.0.0.1:9", up]) == up
        assert answering([up, "http://127.0.0.1:9"]) == up
    said = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "tracker http://127.0.0.1:9 does not answer" in said
    assert answering(["http://127.0.0.1:9"]) == "http://127.0.0.1:9"  # its error is shown
