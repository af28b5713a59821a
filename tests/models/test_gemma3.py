"""Gemma 3 270M from its real Q4_K_M GGUF file: chained spans against transformers' own Gemma 3
model holding the same dequantized weights, past the sliding window; sizing of every quant."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from meshnet.models.loader import load_head, load_shard, load_tokenizer, open_checkpoint
from meshnet.models.quantize import local_layer_bytes
from meshnet.models.source import ModelSource
from meshnet.types import CONVERSIONS, LayerSpan, Quant
from tests.models.chain import Chain, reference_logits

pytestmark = pytest.mark.slow
DATA_TEXT = "english.txt"


@pytest.fixture(scope="module")
def gemma3_reference(gemma3_source: ModelSource) -> Any:
    """transformers' Gemma3ForCausalLM (fp32) with the weights our reader dequantizes."""
    from transformers import Gemma3ForCausalLM
    from transformers.initialization import no_init_weights

    config = gemma3_source.arch.hf_config(gemma3_source.spec, gemma3_source.raw_config)
    with no_init_weights():  # every weight is loaded below: random init costs ~5 s
        model = Gemma3ForCausalLM(config).eval()
    checkpoint = open_checkpoint(gemma3_source)
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    state = {k: checkpoint.read(tied.get(k, k)) for k in model.state_dict()}
    model.load_state_dict(state, strict=True)
    return model


def test_the_gguf_reads_as_gemma3(gemma3_source: ModelSource) -> None:
    spec = gemma3_source.spec
    assert (spec.model_type, spec.num_layers, spec.hidden_size) == ("gemma3_text", 18, 640)
    assert (spec.head_dim, spec.num_kv_heads, spec.vocab_size) == (256, 1, 262144)
    assert spec.tie_word_embeddings and spec.extra["sliding_window"] == 512


def test_completion_prompts_start_with_bos(gemma3_source: ModelSource) -> None:
    """Gemma is trained with `<bos>` first: a completion prompt gets it (SmolLM2 has none)."""
    from meshnet.text.codec import HfCodec

    tokenizer = load_tokenizer(gemma3_source)
    assert HfCodec(tokenizer).encode("The capital of France is")[0] == tokenizer.bos_token_id == 2


def test_chained_spans_equal_the_whole_model_past_the_window(
    gemma3_source: ModelSource, gemma3_reference: Any
) -> None:
    """A 600-token prompt in 128-token chunks (every sliding layer drops keys from token 512
    on) and 8 cached decode steps: three fp32 spans against the whole model."""
    from tests.models.fixtures import DATA

    tokenizer = load_tokenizer(gemma3_source)
    ids = tokenizer((DATA / DATA_TEXT).read_text(), return_tensors="pt").input_ids[:, :600]
    assert ids.shape[1] == 600
    shards = [load_shard(gemma3_source, s, "fp32") for s in LayerSpan(0, 18).split(3)]
    chain = Chain(load_head(gemma3_source), shards)
    mesh = [chain.step(ids[:, i : i + 128]) for i in range(0, 600, 128)]
    tokens = []
    for _ in range(8):
        tokens.append(mesh[-1][:, -1].argmax(-1, keepdim=True))
        mesh.append(chain.step(tokens[-1]))
    ours = torch.cat(mesh, dim=1)[:, :607]
    ref = reference_logits(gemma3_reference, ids, torch.cat(tokens, dim=1), chunk_tokens=128)
    ref = ref[:, :607]
    # two bf16 boundaries (relative 2^-9 each): measured 0.0044 relative on a short prompt
    error = float((ours - ref).norm() / ref.norm())
    assert error < 0.02, f"relative logit error {error:.4f}"
    agree = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    assert agree > 0.95, f"next-token agreement {agree:.3f}"


@pytest.mark.parametrize("quant", CONVERSIONS)
def test_layer_bytes_match_bytes_loaded(quant: Quant, gemma3_source: ModelSource) -> None:
    shard = load_shard(gemma3_source, LayerSpan(5, 7), quant)  # a global and a sliding layer
    predicted = 2 * local_layer_bytes(gemma3_source.spec, quant)
    assert abs(predicted - shard.weight_bytes()) / shard.weight_bytes() < 0.02
