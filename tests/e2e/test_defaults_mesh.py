"""A mesh started as the README starts one, on the defaults: no --quant (bf16 where the CPU
has fast bf16, else fp32), the default heartbeat and expiry, the default swarm key file (which
the node finds by itself) and default data folders (under the tests' private HOME)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from meshnet.models.quantize import default_quant, local_layer_bytes, preferred_compute
from meshnet.models.source import resolve
from tests.e2e.procs import ask_france, free_port, get_json, start, stop_together, wait_for

pytestmark = pytest.mark.slow
COMPUTE = preferred_compute()  # what this machine (or $MESHNET_COMPUTE_DTYPE) picks


@pytest.mark.parametrize("compute", [COMPUTE], ids=[f"compute={COMPUTE}"])
def test_a_mesh_on_the_defaults_answers(compute: str, tmp_path: Path) -> None:
    quant = default_quant()
    per_layer = local_layer_bytes(resolve("default").spec, quant)
    budget = math.ceil(15.5 * per_layer / 0.9)  # layers 15:30 and the 10% KV reserve
    env = {k: v for k, v in os.environ.items() if k != "MESHNET_SWARM_KEY"}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tracker = start(["tracker", "--port", str(port), "--layers", "0:15"], tmp_path / "t.log", env)
    node = None
    try:
        wait_for(lambda: "join this mesh" in (tmp_path / "t.log").read_text(), 60, "the tracker")
        node_args = ["node", "--tracker", url, "--port", str(free_port()), "--budget", str(budget)]
        node = start(node_args, tmp_path / "n.log", env)
        routable = lambda: get_json(f"{url}/v1/coverage")["models"][0]["routable"]  # noqa: E731
        wait_for(routable, 180, "layers 15:30 on the node")
        nodes = get_json(f"{url}/v1/coverage")["nodes"]
        assert sorted(n["quant"] for n in nodes) == [quant, quant]
        assert (Path(os.environ["HOME"]) / ".meshnet" / "swarm.key").exists()
        content = ask_france(url)
        assert content.startswith("The capital of France is Paris."), content
    finally:
        stop_together([node, tracker])
