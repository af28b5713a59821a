"""A mesh started as the README starts one, on the defaults: no --quant or --backend (the
default GGUF file's layers, embeddings and LM head computed by ggml at the file's own types,
ADR-0051, whatever the CPU's compute dtype), the default heartbeat and expiry, the default
swarm key file (which the node finds by itself) and default data folders (under the tests'
private HOME). Its greedy continuations follow llama.cpp's on the same file (recorded by
`benchmarks/llamacpp_reference.py` in `tests/data/llamacpp-default.json`) until a near tie."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshnet.models.quant.compute import preferred_compute
from meshnet.models.sizing import file_layer_bytes
from meshnet.models.source import resolve
from tests.e2e.procs import free_port, get_json, start, stop_together, wait_for

pytestmark = pytest.mark.slow
COMPUTE = preferred_compute()  # what this machine (or $MESHNET_COMPUTE_DTYPE) picks
RECORDED = Path(__file__).parents[1] / "data" / "llamacpp-default.json"


@pytest.mark.parametrize("compute", [COMPUTE], ids=[f"compute={COMPUTE}"])
def test_a_mesh_on_the_defaults_answers_as_llama_cpp(
    compute: str, tmp_path: Path, smollm_tokenizer: Any
) -> None:
    per_layer = file_layer_bytes(resolve("default").path)
    budget = math.ceil(10.5 * per_layer / 0.9)  # ten layers and the 10% KV reserve
    env = {k: v for k, v in os.environ.items() if k != "MESHNET_SWARM_KEY"}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tracker = start(["tracker", "--port", str(port), "--layers", "0:10"], tmp_path / "t.log", env)
    nodes = []
    try:
        wait_for(lambda: "join this mesh" in (tmp_path / "t.log").read_text(), 60, "the tracker")
        for i in range(2):
            args = ["node", "--tracker", url, "--port", str(free_port()), "--budget", str(budget)]
            nodes.append(start(args, tmp_path / f"n{i}.log", env))
        routable = lambda: get_json(f"{url}/v1/coverage")["models"][0]["routable"]  # noqa: E731
        wait_for(routable, 180, "layers 10:30 on the nodes")
        members = get_json(f"{url}/v1/coverage")["nodes"]
        assert [n["quant"] for n in members] == ["gguf"] * 3
        assert (Path(os.environ["HOME"]) / ".meshnet" / "swarm.key").exists()
        # the France question (the recorded set's first prompt, as its chat template's text)
        # is a near tie on its first token: "The" 0.15 above "L" in float32, and each bf16
        # boundary moves that by up to 0.2, so a 3-hop mesh may start "L'Étoile" instead
        agree = agreement(url, smollm_tokenizer)
        # measured [7 (all), 8, 9, 16, 8, 9, 10, 16]; llama.cpp against itself with flash
        # attention off: [8, 16, 9, 16, 8, 10, 11, 16]: these prompts have near ties that
        # bf16 boundaries (or another kernel) tip after 8 tokens or so
        assert sum(agree) >= 65, agree  # of 103: other SIMD may tip other near ties
        assert conversation_reuses_its_history(url) >= 64  # ggml pools, stowed prefixes
    finally:
        stop_together([*nodes, tracker])


def agreement(url: str, tokenizer: Any) -> list[int]:
    """Per recorded prompt: how many of llama.cpp's greedy tokens the mesh's completion
    begins with (all of them when it is llama.cpp's)."""
    recorded = json.loads(RECORDED.read_text())
    same = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for item in recorded["prompts"]:
            assert tokenizer.encode(item["text"], add_special_tokens=False) == item["ids"]
            body = {"model": "default", "prompt": item["text"], "temperature": 0}
            body["max_tokens"] = recorded["tokens"]
            answer = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
            expected = [t for t in item["continuation"] if t not in tokenizer.all_special_ids]
            ours = tokenizer.encode(answer, add_special_tokens=False)
            same.append(common_prefix(ours, expected))
    return same


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


NEAR_TIE = 0.6  # nats: three bf16 boundaries move a logit gap by up to 0.2 each (above)


def conversation_reuses_its_history(url: str) -> int:
    """Three chat turns, each answered with the cache and without (`cache_prompt: false`):
    the same tokens until a near tie (ADR-0058: ggml sums attention over a session's cells
    where they lie in the shared pool, so a forked session's floats differ in the last bits,
    as two sessions in different cells do). The tokens the last turn reused."""
    messages = [{"role": "system", "content": "You answer in one short sentence. " * 6}]
    reused = 0
    with httpx.Client(base_url=url, timeout=120) as client:
        for question in ("Name a tree.", "Where does it grow?", "How tall is it?"):
            messages.append({"role": "user", "content": question})
            body = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": 16}
            body |= {"logprobs": True, "top_logprobs": 2}
            cached = client.post("/v1/chat/completions", json=body).json()
            fresh = client.post("/v1/chat/completions", json=body | {"cache_prompt": False}).json()
            same_until_a_near_tie(cached["choices"][0], fresh["choices"][0])
            reused = cached["usage"]["prompt_tokens_details"]["cached_tokens"]
            messages.append(
                {"role": "assistant", "content": cached["choices"][0]["message"]["content"]}
            )
    return int(reused)


def same_until_a_near_tie(cached: dict[str, Any], fresh: dict[str, Any]) -> None:
    """The two answers' tokens agree, up to the first where the fresh one's two best were
    within `NEAR_TIE` and the cached one took the other."""
    ours, theirs = cached["logprobs"]["content"], fresh["logprobs"]["content"]
    for mine, other in zip(ours, theirs, strict=False):
        if mine["token"] == other["token"]:
            continue
        best = {t["token"]: t["logprob"] for t in other["top_logprobs"]}
        assert mine["token"] in best, (mine, other)
        assert other["logprob"] - best[mine["token"]] < NEAR_TIE, (mine, other)
        return
    assert len(ours) == len(theirs)
