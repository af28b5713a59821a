"""Gemma 3 270M (base, Q4_K_M GGUF) as a 2-process mesh of both backends: a tracker-as-entry
holding layers 0:9 at bf16 and the 262k-token head on torch, and a node holding 9:18 on the
defaults (ggml at the file's own types, ADR-0051; q4 nodes have `test_q4_mesh.py`).
Completions through the real `openai` client; chat is refused with a 400, since the base
model ships no chat template."""

from __future__ import annotations

import os
import re
from pathlib import Path

import openai
import pytest

from tests.e2e.procs import free_port, get_json, start, stop_together, wait_for
from tests.models.fixtures import gemma3_gguf

pytestmark = pytest.mark.slow


def test_a_gemma3_mesh_completes_text(tmp_path: Path) -> None:
    model = str(gemma3_gguf())
    env = {k: v for k, v in os.environ.items() if k != "MESHNET_SWARM_KEY"}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tracker_args = ["tracker", "--port", str(port), "--layers", "0:9", "--model", model]
    tracker_args += ["--quant", "bf16"]
    tracker = start(tracker_args, tmp_path / "t.log", env)
    nodes = []
    try:
        wait_for(lambda: "join this mesh" in (tmp_path / "t.log").read_text(), 120, "the tracker")
        args = ["node", "--tracker", url, "--port", str(free_port()), "--layers", "9:18"]
        nodes.append(start([*args, "--model", model], tmp_path / "n.log", env))
        routable = lambda: get_json(f"{url}/v1/coverage")["models"][0]["routable"]  # noqa: E731
        wait_for(routable, 300, "layers 9:18 on the node")
        quants = sorted(n["quant"] for n in get_json(f"{url}/v1/coverage")["nodes"])
        assert quants == ["bf16", "gguf"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
        model_id = client.models.list().data[0].id
        answer = client.completions.create(
            model=model_id, prompt="The capital of France is", temperature=0, max_tokens=12
        )
        text = answer.choices[0].text
        print(f"gemma3 completion: {text!r}")
        assert re.fullmatch(r"[\w\s,.'-]{8,}", text), text  # words, not byte soup
        assert answer.model_extra is not None
        hops = answer.model_extra["meshnet"]["route"]
        assert len(hops) == 2, hops  # the entry's own span, then the node's
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
    finally:
        stop_together([*nodes, tracker])
