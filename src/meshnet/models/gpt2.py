"""GPT-2: learned position embeddings, LayerNorm with bias, Conv1D projections."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshnet.errors import ModelError
from meshnet.models import registry
from meshnet.models.spec import ModelSpec


class GPT2:
    model_types: tuple[str, ...] = ("gpt2",)

    def spec_from_config(self, config: Mapping[str, Any]) -> ModelSpec:
        hidden = int(config["n_embd"])
        return ModelSpec(
            model_type="gpt2",
            num_layers=int(config["n_layer"]),
            hidden_size=hidden,
            num_heads=int(config["n_head"]),
            num_kv_heads=int(config["n_head"]),
            intermediate_size=int(config.get("n_inner") or 4 * hidden),
            vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            max_positions=int(config.get("n_positions", 1024)),
        )

    def spec_from_gguf(self, fields: Mapping[str, Any], tensor_names: set[str]) -> ModelSpec:
        raise ModelError("GPT-2 GGUF files are not supported; use a Hugging Face checkpoint")

    def layer_params(self, spec: ModelSpec) -> tuple[int, int, int]:
        h, inner = spec.hidden_size, spec.intermediate_size
        linear = h * 3 * h + h * h + h * inner + inner * h  # c_attn, c_proj, c_fc, mlp.c_proj
        out_rows = 3 * h + h + inner + h
        other = 4 * h + out_rows  # two LayerNorms (weight + bias) and every projection's bias
        return linear, out_rows, other

    def layer_names(self, index: int) -> list[str]:
        return [f"transformer.h.{index}.", f"h.{index}."]

    def head_names(self) -> dict[str, list[str]]:
        return {
            "embed.weight": ["transformer.wte.weight", "wte.weight"],
            "pos_embed.weight": ["transformer.wpe.weight", "wpe.weight"],
            "norm.weight": ["transformer.ln_f.weight", "ln_f.weight"],
            "norm.bias": ["transformer.ln_f.bias", "ln_f.bias"],
            "lm_head.weight": ["lm_head.weight"],
        }

    def gguf_name(self, hf_name: str, spec: ModelSpec) -> tuple[str, str | None]:
        raise ModelError("GPT-2 GGUF files are not supported")

    def hf_config(self, spec: ModelSpec, raw: Mapping[str, Any]) -> Any:
        from transformers import GPT2Config

        config = GPT2Config(**{k: v for k, v in raw.items() if k != "architectures"})
        config._attn_implementation = "sdpa"
        return config

    def build_layer(self, config: Any, index: int) -> Any:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return GPT2Block(config, layer_idx=index)

    def layer_extras(self, config: Any) -> Any:
        return None

    def fast_path(self, layers: Any, config: Any, extras: Any, compile: bool) -> Any | None:
        return None  # GPT-2 runs transformers' layers (it is the test architecture)

    def run_layers(self, layers: Any, hidden: Any, cache: Any, position: int, extras: Any) -> Any:
        from meshnet.models.layer_ops import causal_mask

        mask = causal_mask(hidden, position)
        for layer in layers:
            hidden = layer(hidden, cache=cache, attention_mask=mask, use_cache=True)
        return hidden

    def build_head(self, config: Any) -> Any:
        from torch import nn

        from meshnet.models.shard import Head, unset_embedding

        return Head(
            unset_embedding(config.vocab_size, config.n_embd),
            unset_embedding(config.n_positions, config.n_embd),
            nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
            nn.Linear(config.n_embd, config.vocab_size, bias=False),
        )


registry.register(GPT2())
