"""int8 and nf4 shards: logits close to the fp32 reference, greedy text still sensible."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from meshnet.models.loader import load_head, load_shard
from meshnet.models.sizing import layer_bytes
from meshnet.models.source import ModelSource, resolve
from meshnet.types import LayerSpan
from tests.models.chain import Chain, greedy, reference_logits

# Relative error ||mesh - ref|| / ||ref|| of the logits; measured: see docs/quality.md.
BOUNDS = {"int8": 0.12, "nf4": 0.40}


def relative_error(mesh: torch.Tensor, ref: torch.Tensor) -> float:
    return float((mesh - ref).norm() / ref.norm())


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_quantized_gpt2_shards_stay_close(quant: str, tiny_folder: Callable[[str], Path]) -> None:
    from transformers import AutoModelForCausalLM

    folder = tiny_folder("gpt2")
    source = resolve(str(folder))
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    shards = [load_shard(source, s, quant) for s in LayerSpan(0, 6).split(3)]
    chain = Chain(load_head(source), shards)
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(2))
    mesh = chain.step(ids)
    ref = reference_logits(reference, ids, ids[:, :0])
    assert relative_error(mesh, ref) < BOUNDS[quant]


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_quantized_smollm2_is_close_and_answers(
    quant: str,
    default_source: ModelSource,
    smollm_reference: Any,
    english_ids: torch.Tensor,
    smollm_tokenizer: Any,
) -> None:
    shards = [load_shard(default_source, s, quant) for s in LayerSpan(0, 30).split(3)]
    head = load_head(default_source)
    ids = english_ids[:, :64]
    mesh = Chain(head, shards).step(ids)
    ref = reference_logits(smollm_reference, ids, ids[:, :0])
    error = relative_error(mesh, ref)
    print(f"{quant} relative logit error {error:.4f}")
    assert error < BOUNDS[quant], f"{quant} relative logit error {error:.4f}"
    tokenizer = smollm_tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    answer = tokenizer.decode(greedy(Chain(head, shards), prompt, 8))
    print(f"{quant} answer {answer!r}")
    # nf4 still answers "The capital of France is Paris". bitsandbytes' CPU int8 (rowwise
    # LLM.int8, fp16 inputs) loses 1-4% per layer on this 135M model whose weights were
    # already 4-bit; its answer stays on topic ("L'Étoile de France") but is not Paris.
    assert ("Paris" in answer) if quant == "nf4" else ("France" in answer)


@pytest.mark.parametrize("quant", ["fp32", "bf16", "int8", "nf4"])
def test_layer_bytes_from_config_match_bytes_loaded(
    quant: str, default_source: ModelSource
) -> None:
    shard = load_shard(default_source, LayerSpan(4, 6), quant)
    predicted = 2 * layer_bytes(
        default_source.spec, quant, compute_bytes=shard.compute_dtype.itemsize
    )
    assert abs(predicted - shard.weight_bytes()) / shard.weight_bytes() < 0.05
