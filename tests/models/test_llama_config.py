"""The Llama family without transformers: `FamilyConfig` reads a config.json as transformers'
config classes do, `Rotary` gives their rotary module's numbers, and a node that loads a
span and runs it imports no transformers at all (ADR-0041)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from meshnet.models import llama_config
from meshnet.models.llama_layers import Rotary

BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}
CASES: list[tuple[str, dict[str, Any]]] = [
    ("llama", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True, "rms_norm_eps": 1e-5}),
    ("llama", {"rope_theta": 500000.0, "head_dim": 32}),
    (
        "llama",  # Llama 3.1's rotary scaling, as its config.json spells it
        {
            "rope_theta": 500000.0,
            "max_position_embeddings": 131072,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    ("mistral", {}),  # transformers' default window: 4096 on every layer
    ("mistral", {"sliding_window": None}),
    ("mistral", {"sliding_window": 16, "attention_bias": True}),
    ("qwen2", {}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3}),
    ("qwen3", {"head_dim": 32, "attention_bias": True}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
    (
        "qwen3",
        {
            "use_sliding_window": True,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] * 3,
        },
    ),
]


def transformers_view(model_type: str, raw: dict[str, Any]) -> dict[str, Any]:
    """What transformers' own classes make of `raw`: fields, biases, windows, frequencies."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **raw)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    attn = [layer.self_attn for layer in model.model.layers]
    rotary = type(model.model.rotary_emb)(config=config)
    return {
        "head_dim": attn[0].head_dim,
        "eps": model.model.layers[0].input_layernorm.variance_epsilon,
        "qkv_bias": attn[0].q_proj.bias is not None,
        "o_bias": attn[0].o_proj.bias is not None,
        "mlp_bias": model.model.layers[0].mlp.up_proj.bias is not None,
        "qk_norm": hasattr(attn[0], "q_norm"),
        "positions": config.max_position_embeddings,
        "windows": tuple(
            getattr(a, "sliding_window", None) or getattr(config, "sliding_window", None)
            if model_type == "mistral"
            else getattr(a, "sliding_window", None)
            for a in attn
        ),
        "inv_freq": rotary.inv_freq,
        "scaling": rotary.attention_scaling,
    }


@pytest.mark.parametrize(("model_type", "extra"), CASES)
def test_family_config_reads_a_config_json_as_transformers_does(
    model_type: str, extra: dict[str, Any]
) -> None:
    raw = {**BASE, **extra}
    ours = llama_config.from_mapping({**raw, "model_type": model_type})
    theirs = transformers_view(model_type, json.loads(json.dumps(raw)))
    assert ours.head_dim == theirs["head_dim"]
    assert ours.rms_norm_eps == theirs["eps"]
    assert (ours.qkv_bias, ours.o_bias, ours.mlp_bias) == (
        theirs["qkv_bias"],
        theirs["o_bias"],
        theirs["mlp_bias"],
    )
    assert ours.qk_norm == theirs["qk_norm"]
    assert ours.max_position_embeddings == theirs["positions"]
    assert ours.windows == theirs["windows"]
    rotary = Rotary(ours)
    assert torch.equal(rotary.inv_freq, theirs["inv_freq"])
    assert rotary.attention_scaling == theirs["scaling"]


def test_rotary_gives_transformers_cos_and_sin_bit_for_bit() -> None:
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    raw = {**BASE, "rope_theta": 100000.0}
    theirs = LlamaRotaryEmbedding(config=AutoConfig.for_model("llama", **raw))
    ours = Rotary(llama_config.from_mapping({**raw, "model_type": "llama"}))
    positions = torch.arange(3000).unsqueeze(0)
    for dtype in (torch.float32, torch.bfloat16):
        probe = torch.empty(1, dtype=dtype)
        for a, b in zip(ours(probe, positions), theirs(probe, positions), strict=True):
            assert torch.equal(a, b)


def test_an_unknown_rotary_type_takes_transformers_module(tmp_path: Path) -> None:
    from meshnet.models.registry import get

    raw = {**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    config = llama_config.from_mapping(raw)
    extras = get("llama").layer_extras(config)
    assert type(extras).__name__ == "LlamaRotaryEmbedding"


LEAN_NODE = """
import sys
from meshnet.models.cache import new_cache
from meshnet.models.loader import load_shard
from meshnet.models.source import resolve
from meshnet.types import LayerSpan
import meshnet.assemble.node  # the node composition root, entry role included
import torch

shard = load_shard(resolve(sys.argv[1]), LayerSpan(1, 3), sys.argv[2])
shard.forward(torch.zeros(1, 5, shard.config.hidden_size), new_cache(), 0)
heavy = ("transformers", "bitsandbytes", "fastapi")
print(sorted(m for m in sys.modules if m.split(".")[0] in heavy))
"""


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mistral-sliding"])
@pytest.mark.parametrize("quant", ["fp32", "q4"])
def test_a_node_running_a_llama_family_span_imports_no_transformers(
    tiny_folder: Any, model_type: str, quant: str
) -> None:
    """Nor FastAPI: only an entry's API needs it (`assemble.node.entry_api`)."""
    folder = tiny_folder(model_type)
    out = subprocess.run(
        [sys.executable, "-c", LEAN_NODE, str(folder), quant],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
