"""Perplexity of a model run through the shard path, per quantization.

    python benchmarks/quality.py          # the default model, 2,048 tokens of english.txt
    python benchmarks/quality.py --model path/to/gemma-3-270m-q4_k_m.gguf   # another model
    python benchmarks/quality.py --tiny   # a tiny random model (what the tests run)

Three shards and the head, 128-token chunks, bf16 activations between shards: the mesh's path.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from meshnet.models.loader import load_head, load_shard, load_tokenizer
from meshnet.models.source import ModelSource, resolve
from meshnet.types import LayerSpan

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.models.chain import Chain  # noqa: E402


def perplexity(source: ModelSource, quant: str, ids: torch.Tensor, fast: bool = True) -> float:
    spans = LayerSpan(0, source.spec.num_layers).split(3)
    shards = [load_shard(source, s, quant, fast=fast) for s in spans]
    logits = Chain(load_head(source), shards).step(ids)  # [1, T, V] fp32
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    return math.exp(float(nll))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--model", default="default", help="what `meshnet --model` takes")
    args = parser.parse_args()
    if args.tiny:
        from tests.models.fixtures import tiny_source

        source = tiny_source()
        ids = torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(0))
        quants = [("fp32", True), ("nf4", True), ("q4", True)]
    else:
        source = resolve(args.model)
        text = (ROOT / "tests" / "data" / "english.txt").read_text()
        ids = load_tokenizer(source)(text, return_tensors="pt")["input_ids"][:, : args.tokens]
        quants = [("fp32", True), ("bf16", True), ("int8", True), ("int8", False), ("nf4", True)]
        quants.append(("q4", True))
    print(f"| quant | perplexity ({ids.shape[1]} tokens, {source.model_id}) |")
    print("|---|---:|")
    for quant, fast in quants:
        name = quant if fast else f"{quant}, --no-fast-path"
        print(f"| {name} | {perplexity(source, quant, ids, fast):.3f} |")


if __name__ == "__main__":
    main()
