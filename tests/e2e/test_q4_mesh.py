"""The default model as a 2-process mesh mixing weight formats: a tracker-as-entry holding
layers 0:15 at bf16 and a node holding 15:30 at q4 (the GGUF file's Q4_1 blocks kept 4-bit).
It still answers the France question through the real `openai` client."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from meshnet.models.int4 import int4_kernel_runs
from tests.e2e.procs import ask_france, free_port, get_json, start, stop_together, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not int4_kernel_runs(), reason="no int4 CPU kernel"),
]


def test_a_mesh_with_a_q4_node_answers(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MESHNET_SWARM_KEY"}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tracker_args = ["tracker", "--port", str(port), "--layers", "0:15", "--quant", "bf16"]
    tracker = start(tracker_args, tmp_path / "t.log", env)
    node = None
    try:
        wait_for(lambda: "join this mesh" in (tmp_path / "t.log").read_text(), 60, "the tracker")
        node_args = ["node", "--tracker", url, "--port", str(free_port()), "--layers", "15:30"]
        # no compiled decode step: its build costs ~27 s here, and tests/models/test_fast_path.py
        # checks it; this test is about mixed weight formats answering together
        node = start([*node_args, "--quant", "q4", "--no-compile"], tmp_path / "n.log", env)
        routable = lambda: get_json(f"{url}/v1/coverage")["models"][0]["routable"]  # noqa: E731
        wait_for(routable, 180, "layers 15:30 on the node")
        quants = sorted(n["quant"] for n in get_json(f"{url}/v1/coverage")["nodes"])
        assert quants == ["bf16", "q4"]
        content = ask_france(url)
        assert content.startswith("The capital of France is Paris."), content
    finally:
        stop_together([node, tracker])
