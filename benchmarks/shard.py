"""Shard overhead: a meshnet shard of 10 layers vs the same 10 layers in transformers' model,
and the memory a layer costs at each quantization.

    python benchmarks/shard.py           # the default model, layers 10:20, all quantizations
    python benchmarks/shard.py --tiny    # a tiny random model, seconds (what the tests run)

The monolithic side is transformers' own `LlamaModel` forward (its layer classes, masks,
rotary and cache handling) over the very same weights and linear modules; the shard side is
`Shard.forward`. Decode: ms per token with a 128-token cache; prefill: tokens/s for one
128-token chunk. Medians of alternated calls (shard, monolithic, shard, ...), so machine
noise hits both sides alike.

Memory: each quantization's span is loaded again in a fresh process, after one layer of it
(which pays the imports, kernels and warm-up buffers); "RSS per layer" is what the span added
to that process's resident memory, over its layers: what a layer really costs a node
(allocator slack and load-time copies included). "Weights per
layer" is what the shard holds (`Shard.weight_bytes`), "sizing" what the planner predicts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from meshnet.models.cache import new_cache, truncate
from meshnet.models.loader import load_shard
from meshnet.models.quantize import local_layer_bytes
from meshnet.models.shard import Shard
from meshnet.models.source import resolve
from meshnet.types import LayerSpan, parse_quant

MIB = 1 << 20


def paired_medians(
    a: Callable[[], object], b: Callable[[], object], repeat: int
) -> tuple[float, float]:
    """Median seconds of `a` and of `b`, calls alternated so drift and noise hit both alike."""
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for fn, out in ((a, samples[0]), (b, samples[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(samples[0]), statistics.median(samples[1])


def monolithic(shard: Shard) -> torch.nn.Module:
    """transformers' decoder model over the shard's weights: its own layer classes holding
    the shard's linear modules (quantized ones included) and norm weights."""
    from transformers import AutoConfig, AutoModel

    fields = {k: v for k, v in shard.config.to_dict().items() if k != "architectures"}
    fields["num_hidden_layers"] = len(shard.layers)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    for theirs, ours in zip(model.layers, shard.layers, strict=True):
        transplant(theirs, ours)
    model.rotary_emb = type(model.rotary_emb)(config=config)
    model.norm = torch.nn.Identity()
    model.embed_tokens = None
    return model.eval()


def transplant(theirs: torch.nn.Module, ours: torch.nn.Module) -> None:
    """Give transformers' layer `theirs` the weights of our layer `ours` (same names)."""
    for name, module in ours.named_modules():
        if not name or list(module.children()):
            continue
        if hasattr(module, "variance_epsilon"):  # a norm: transformers' own module, our weight
            theirs.get_submodule(name).weight = module.weight
        else:
            theirs.set_submodule(name, module)


def measure(shard: Shard, tokens: int, repeat: int) -> tuple[float, float, float, float]:
    """(shard decode ms, mono decode ms, shard prefill tok/s, mono prefill tok/s)."""
    from transformers import DynamicCache

    model = monolithic(shard)
    hidden = shard.config.hidden_size
    prompt = torch.randn(1, tokens, hidden).to(shard.compute_dtype)
    step = torch.randn(1, 1, hidden).to(shard.compute_dtype)

    def shard_prefill() -> object:
        return shard.forward(prompt, new_cache(), 0)

    def mono_prefill() -> object:
        with torch.inference_mode():
            return model(inputs_embeds=prompt, cache=DynamicCache(), use_cache=True)

    cache = new_cache()
    shard.forward(prompt, cache, 0)
    mono_cache = DynamicCache()
    with torch.inference_mode():
        model(inputs_embeds=prompt, cache=mono_cache, use_cache=True)

    def shard_step() -> object:  # crop back so every step sees the same cache length
        out = shard.forward(step, cache, tokens)
        truncate(cache, tokens)
        return out

    def mono_step() -> object:
        with torch.inference_mode():
            out = model(inputs_embeds=step, cache=mono_cache, use_cache=True)
        mono_cache.crop(-1)  # back to `tokens`
        return out

    for fn in (shard_step, mono_step):
        fn()
    shard_d, mono_d = paired_medians(shard_step, mono_step, repeat * 8)
    shard_p, mono_p = paired_medians(shard_prefill, mono_prefill, repeat)
    return shard_d * 1e3, mono_d * 1e3, tokens / shard_p, tokens / mono_p


def rss_bytes() -> int:
    """This process's resident memory (Linux `/proc/self/status`)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def memory_child(model: str, span: str, quant: str) -> None:
    """Run in a fresh process: load one layer first (imports, kernels and warm-up buffers
    paid), then the span; print what the span added, and what it holds, as JSON."""
    source = resolve(model)
    layers = LayerSpan.parse(span)
    warm = load_shard(source, LayerSpan(layers.start, layers.start + 1), parse_quant(quant))
    before = rss_bytes()
    shard = load_shard(source, layers, parse_quant(quant))
    grown = rss_bytes() - before
    print(json.dumps({"rss": grown, "weights": shard.weight_bytes(), "warm": len(warm.span)}))


def memory_row(model: str, span: LayerSpan, quant: str) -> str:
    """'| RSS per layer | weights per layer | sizing per layer |' in MiB, from a fresh process."""
    child = [sys.executable, __file__, "--memory-child", model, str(span), quant]
    out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    layers = len(span)
    sizing = local_layer_bytes(resolve(model).spec, parse_quant(quant))
    return (
        f"{figures['rss'] / layers / MIB:.2f} | {figures['weights'] / layers / MIB:.2f} | "
        f"{sizing / MIB:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(*args.memory_child)
        return
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.models.fixtures import tiny_source

        source = tiny_source()
        span, quants, tokens, repeat = LayerSpan(2, 4), ["fp32", "nf4", "q4"], 16, 2
    else:
        source = resolve("default")
        span, quants, tokens, repeat = (
            LayerSpan(10, 20),
            ["fp32", "bf16", "int8", "nf4", "q4"],
            128,
            args.repeat,
        )
    print(
        f"| quant | shard decode ms/token | monolithic decode ms/token | decode ratio | "
        f"shard prefill tok/s | monolithic prefill tok/s | prefill ratio | RSS per layer MiB | "
        f"weights per layer MiB | sizing per layer MiB |  ({span})"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for quant in quants:
        shard = load_shard(source, span, quant)
        sd, md, sp, mp = measure(shard, tokens, repeat)
        del shard
        memory = memory_row(str(source.path), span, quant)
        print(
            f"| {quant} | {sd:.2f} | {md:.2f} | {sd / md:.3f} | {sp:,.0f} | {mp:,.0f} | "
            f"{sp / mp:.3f} | {memory}"
        )


if __name__ == "__main__":
    main()
