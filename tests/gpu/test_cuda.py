"""CUDA nodes (ADR-0039): spans on a GPU against the same spans on the CPU, a mixed mesh
against an all-CPU one, and the decode benchmark's CUDA rows. Skipped where PyTorch sees no
CUDA device (tests/conftest.py); run them with `MESHNET_TORCH=cuda ./run test -m gpu`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from meshnet.models.loader import load_head, load_shard
from meshnet.models.quantize import head_dtype
from meshnet.models.shard import _tensors
from meshnet.models.source import ModelSource
from meshnet.types import QUANTS, LayerSpan
from tests.e2e.procs import free_port, get_json, start, stop, wait_for
from tests.models.chain import Chain, france_prompt, greedy, reference_logits

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# ||cuda - ref|| / ||ref|| of the logits against the fp32 model on the CPU. fp32: kernels sum
# in other orders; bf16: one rounding a product; int8 and nf4: tests/models/test_quantization
# bounds (bitsandbytes' CUDA int8 also quantizes activations, LLM.int8).
BOUNDS = {"fp32": 1e-3, "bf16": 0.05, "int8": 0.08, "nf4": 0.20}


def relative_error(mesh: torch.Tensor, ref: torch.Tensor) -> float:
    return float((mesh - ref).norm() / ref.norm())


@pytest.mark.parametrize("quant", [q for q in QUANTS if q != "q4"])  # q4: CPU nodes only
def test_cuda_spans_match_the_cpu_reference(
    quant: str,
    default_source: ModelSource,
    smollm_reference: Any,
    english_ids: torch.Tensor,
    smollm_tokenizer: Any,
) -> None:
    """Three CUDA spans and a CUDA head: every tensor on the GPU, logits within the quant's
    bound of the CPU fp32 model, the greedy answer still right."""
    spans = LayerSpan(0, 30).split(3)
    shards = [load_shard(default_source, s, quant, device="cuda:0") for s in spans]
    for shard in shards:
        roots = [shard.layers, *([shard.fast.layers] if shard.fast is not None else [])]
        assert {t.device.type for t in _tensors(roots, depth=4)} == {"cuda"}
    head = load_head(default_source, head_dtype(quant), device="cuda:0")
    ids = english_ids[:, :64]
    mesh = Chain(head, shards).step(ids)
    assert mesh.device.type == "cpu"  # logits come back to the host for sampling
    error = relative_error(mesh, reference_logits(smollm_reference, ids, ids[:, :0]))
    print(f"cuda {quant} relative logit error {error:.5f}")
    assert error < BOUNDS[quant]
    answer = smollm_tokenizer.decode(
        greedy(Chain(head, shards), france_prompt(smollm_tokenizer), 8)
    )
    assert "Paris" in answer


def test_cuda_caches_live_on_the_gpu_and_batches_match_single_steps(
    default_source: ModelSource,
) -> None:
    from meshnet.models.cache import new_cache

    shard = load_shard(default_source, LayerSpan(0, 10), "bf16", device="cuda:0")
    caches = [new_cache(), new_cache()]
    prompts = [torch.randn(1, 5, 576), torch.randn(1, 9, 576)]
    outs = shard.forward_many(prompts, caches, [0, 0])
    assert all(c.static is None or c.static.keys.device.type == "cuda" for c in caches)
    alone = [shard.forward(p, new_cache(), 0) for p in prompts]
    for batched, single in zip(outs, alone, strict=True):
        assert relative_error(batched.float(), single.float()) < 0.02


def _mesh(tmp: Path, devices: tuple[str, str]) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """Tracker-as-entry 0:15 on `devices[0]`, a node 15:30 on `devices[1]`, fp32."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tracker_args = ["tracker", "--port", str(port), "--layers", "0:15", "--quant", "fp32"]
    tracker = start([*tracker_args, "--device", devices[0]], tmp / "t.log")
    wait_for(lambda: "join this mesh" in (tmp / "t.log").read_text(), 120, "the tracker")
    key = (Path.home() / ".meshnet" / "swarm.key").read_text().strip()
    env = {**os.environ, "MESHNET_SWARM_KEY": key}
    node_args = ["node", "--tracker", url, "--port", str(free_port()), "--layers", "15:30"]
    node = start([*node_args, "--quant", "fp32", "--device", devices[1]], tmp / "n.log", env)
    routable = lambda: get_json(f"{url}/v1/coverage")["models"][0]["routable"]  # noqa: E731
    wait_for(routable, 300, "layers 15:30")
    return url, [node, tracker]


def _completion(url: str, prompt: str) -> str:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    answer = client.completions.create(model="default", prompt=prompt, temperature=0, max_tokens=16)
    return answer.choices[0].text


def test_a_mixed_mesh_answers_as_an_all_cpu_one(tmp_path: Path) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    answers = {}
    for devices in (("cpu", "cpu"), ("cpu", "cuda")):
        folder = tmp_path / "-".join(devices)
        folder.mkdir()
        url, procs = _mesh(folder, devices)
        try:
            answers[devices] = [_completion(url, p) for p in prompts]
        finally:
            for process in procs:
                stop(process)
    assert answers[("cpu", "cuda")] == answers[("cpu", "cpu")]


def test_the_decode_benchmark_has_cuda_rows() -> None:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "decode.py"), "--tiny", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if "cuda:0, fast path" in line]
    assert len(rows) == 2 and all(float(row.split("|")[2]) > 0 for row in rows)
